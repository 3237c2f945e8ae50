"""The ``ddma`` weight source: a vLLM worker receives only its own shard, straight from the trainer
ranks (megarl/ddma/sync.py), one parameter at a time, in vLLM's local layout.

vLLM's weight loaders take checkpoint tensors (HF names, full shape) and narrow them to the
worker's TP shard. DDMA already delivers the shard, laid out as the worker's parameter is before
vLLM processes it (fused ``qkv_proj = [q_r; k_r; v_r]``, ``gate_up_proj``, padded vocab rows):
so for the duration of the reload, :func:`local_layout_loading` makes every parameter's loader a
plain shape-checked copy. The layerwise reload still runs around it (it restores the
pre-processing parameters, then re-quantizes FP8 and repacks for the CPU kernels layer by layer),
so the engine ends up exactly as if it had loaded the checkpoint, while the bytes on the wire and
the memory held are one shard's.

Verification looks at the engine, not at the wire: the receiver checksums each parameter as the
engine's loader filled it (:func:`megarl.generator.landing.watch_landing`), after the reload, and
compares with the senders' sums. (It once checksummed its staging buffer instead: the reload
buffers a layer's tensors until the whole layer has arrived, so a reused staging buffer was
overwritten before Qwen2's ``qkv_proj`` weight was copied, while every checksum passed.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from megarl.generator.landing import watch_landing
from megarl.generator.weight_source import WeightSource, register_weight_source

_MISSING = object()


def _copy_local(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Load a tensor already in the worker's local layout (the DDMA staging tensor). Fused layers'
    own ``load_weights`` pass ``shard_id`` (None for a whole fused parameter, as DDMA sends)."""
    if shard_id is not None:
        raise ValueError(f"ddma landing got shard {shard_id!r} of a fused parameter; it sends whole "
                         f"local parameters (vLLM names such as qkv_proj), never q/k/v pieces")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"ddma landing: staging tensor {tuple(loaded_weight.shape)} does not match the "
                         f"worker's parameter {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


@contextlib.contextmanager
def local_layout_loading(model: torch.nn.Module) -> Iterator[None]:
    """Within this context every parameter of ``model`` loads a local-layout tensor by plain copy.

    The layerwise reload rebuilds parameters from metadata recorded at load time
    (``LAYERWISE_INFO[layer].restore_metadata``) and wraps their ``weight_loader``, so the override
    goes into that metadata (and the live parameters), and is undone afterwards.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    saved: list[tuple[dict, str, Any]] = []

    def override(t: torch.Tensor) -> None:
        d = t.__dict__
        key = "_weight_loader" if "_weight_loader" in d else "weight_loader"
        saved.append((d, key, d.get(key, _MISSING)))
        d[key] = _copy_local

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None:
            for meta in info.restore_metadata[0].values():
                override(meta)
        for p in layer.parameters(recurse=False):
            override(p)
    try:
        yield
    finally:
        for d, key, old in reversed(saved):
            if old is _MISSING:
                d.pop(key, None)
            else:
                d[key] = old


class DdmaSource(WeightSource):
    """One worker's side of one DDMA sync (its receiver is kept on the worker across syncs)."""

    def __init__(self, source: dict, worker: Any):
        from vllm.distributed import get_tensor_model_parallel_rank

        from megarl.ddma.layouts import DstRank
        from megarl.ddma.sync import DdmaReceiver

        spec = source["spec"]
        rank = DstRank(int(source.get("replica", 0)), get_tensor_model_parallel_rank())
        cache = worker.__dict__.setdefault("_megarl_ddma", {})
        if spec not in cache:
            cache.clear()  # a new topology or store: one receiver at a time
            # staging where the engine's parameters live (CUDA for cuda_ipc / nccl: no host trip)
            device = getattr(worker, "device", None)
            cache[spec] = DdmaReceiver(spec, rank, device=device if device is not None else "cpu")
        self.receiver, self.worker = cache[spec], worker
        self.version = int(source["version"])

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.receiver.stream(self.version)

    @contextlib.contextmanager
    def landing(self, model: torch.nn.Module) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(local_layout_loading(model))
            if self.receiver.spec.verifies(self.version):
                stack.enter_context(watch_landing(model, self.receiver.check_landed))
            yield

    def after_landing(self) -> None:
        self.receiver.verify_landed(self.version)
        self.worker.__dict__["_megarl_ddma_stats"] = self.receiver.last_stats


register_weight_source("ddma", DdmaSource)

__all__ = ["DdmaSource", "local_layout_loading"]
