"""Run megatron-core 0.16.1 on CPU-only torch (tests, 2-core CI, laptops).

Megatron hard-codes CUDA in a few places on the paths we use (model forward/backward, the
pipeline schedules, megatron DDP, the DistributedOptimizer, clip_grads). On a machine without
CUDA every one of those calls raises, so each redirect below only changes calls that would
otherwise crash; code that checks ``torch.cuda.is_available()`` first is untouched.

The layer is applied only when CUDA is unavailable and is idempotent. The rest of the CPU recipe
lives with the callers (see DESIGN.md): ``use_cpu_initialization=True``, fp32/bf16 params,
``sequence_parallel=False``, an explicit bool attention mask and
``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)``
(done by :func:`megarl.utils.dist.init_model_parallel`).
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any, Callable

import torch

_APPLIED = False
_LOCK = threading.Lock()

# Modules that allocate with a literal device="cuda" (pipeline schedules, optimizer, grad scaler,
# clip_grads, DDP buffers, broadcast_data). Their module-global `torch` is swapped for a proxy.
_LITERAL_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (clip_grads fallback without apex/TE)
)

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return wrapper


class _TorchWithCudaAllocsOnCpu:
    """Stands in for `torch` inside the modules above: everything delegates to torch, except the
    factories, which turn device="cuda" into device="cpu"."""

    def __init__(self) -> None:
        for name in ("zeros", "ones", "empty", "full", "tensor", "arange"):
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_type_name_depth = 0
_original_tensor_type = torch.Tensor.type


def _type_with_cuda_names(self: torch.Tensor, *args, **kwargs):
    out = _original_tensor_type(self, *args, **kwargs)
    if not args and not kwargs and _type_name_depth > 0:
        return _CUDA_TYPE_NAMES.get(out, out)
    return out


def _reporting_cuda_type_names(fn: Callable) -> Callable:
    """While fn runs, `Tensor.type()` names CPU float tensors like CUDA ones, so the optimizers'
    `param.type() == 'torch.cuda.FloatTensor'` dispatch picks the right branch."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _type_name_depth
        _type_name_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _type_name_depth -= 1
    wrapper._megarl_cpu_compat = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_attr(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if isinstance(raw, classmethod):
        if not getattr(raw.__func__, "_megarl_cpu_compat", False):
            setattr(owner, name, classmethod(wrap(raw.__func__)))
    elif isinstance(raw, staticmethod):
        if not getattr(raw.__func__, "_megarl_cpu_compat", False):
            setattr(owner, name, staticmethod(wrap(raw.__func__)))
    elif not getattr(raw, "_megarl_cpu_compat", False):
        setattr(owner, name, wrap(raw))


class _HostStream:
    """The one "stream" of a CPU: work is already done when a call returns, so waits and events are no-ops."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_HostStream":
        return self

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


class _CudaStreamsOnCpu:
    """Stands in for `torch.cuda` inside megatron's MoE token dispatcher: its alltoall dispatcher makes a
    side stream for device-to-host copies at build (``torch.cuda.Stream()``). Here every stream is the
    host stream, so ``current_stream() != cuda_dtoh_stream`` is False and no ``record_stream`` runs."""

    Stream = staticmethod(lambda *a, **k: _HOST_STREAM)
    current_stream = staticmethod(lambda *a, **k: _HOST_STREAM)

    @staticmethod
    def stream(s: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithHostStreams:
    """`torch` for the MoE token dispatcher module: delegates all but `cuda` (:class:`_CudaStreamsOnCpu`)."""

    cuda = _CudaStreamsOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _host_tensor_as_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` converts only CUDA tensors, so on CPU the alltoall
    dispatcher's split sizes stay tensors, which ``all_to_all_single`` rejects: make them numpy here."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _tensor_cuda_noop(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self


def apply_cpu_compat() -> bool:
    """Make megatron-core run on CPU. Returns True if applied (now or before), False on CUDA."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        # torch.cuda.current_device() feeds `device=` arguments: point it at the CPU.
        torch.cuda.current_device = lambda: torch.device("cpu")
        # torch.cuda.synchronize() (p2p communication, DDP): nothing to wait for on CPU.
        torch.cuda.synchronize = lambda device=None: None
        # Tensor.cuda() (optimizer state reload, grad scaler, broadcast_data): stay on the CPU.
        torch.Tensor.cuda = _tensor_cuda_noop
        # Tensor.type() is patched once; it only renames while a wrapped optimizer builder runs.
        torch.Tensor.type = _type_with_cuda_names

        proxy = _TorchWithCudaAllocsOnCpu()
        for module_name in _LITERAL_CUDA_MODULES:
            # literal torch.zeros(..., device="cuda") / torch.tensor(..., device='cuda') -> CPU.
            importlib.import_module(module_name).torch = proxy

        from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

        # `param.type() == 'torch.cuda.FloatTensor'` checks while grouping params (optimizers)
        # and before clipping (clip_grads, also imported by name into optimizer.py).
        _wrap_attr(distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups",
                   _reporting_cuda_type_names)
        _wrap_attr(distrib_optimizer.DistributedOptimizer, "__init__", _reporting_cuda_type_names)
        _wrap_attr(optimizer.Float16OptimizerWithFloat16Params, "__init__",
                   _reporting_cuda_type_names)
        _wrap_attr(clip_grads, "clip_grad_by_total_norm_fp32", _reporting_cuda_type_names)
        optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
        from megatron.core.transformer.moe import moe_utils

        # megatron-core 0.16.1's MoE router tests `te_general_gemm is not None`, a name it binds only
        # when Transformer Engine imports (NameError without TE): None selects its torch.mm path.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.torch = _TorchWithHostStreams()
        token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor_as_numpy
        _APPLIED = True
        return True
