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
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megarl.generator.landing import OnParam, watch_landing
from megarl.generator.weight_source import WeightSource, register_weight_source
from megarl.utils.faults import armed, injected, pause_point

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


# vLLM's stacked FusedMoE parameters ([E, ...], every expert on every worker: no vLLM expert
# parallelism here). DDMA sends expert e's local block as its own parameter ``<param>.<e>``
# (megarl.models.families.spec: EXPERT_GATE_UP / EXPERT_DOWN rows); the landing below hands it to
# FusedMoE's loader under a per-expert checkpoint name, which calls the parameter's loader with
# ``expert_id`` / ``shard_id`` (w1 = gate, w3 = up: w13_weight[e] = [gate_r; up_r]; w2 = down).
EXPERT_PARAMS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def expert_checkpoint_name(dparam: str) -> str:
    """The name FusedMoE's ``load_weights`` takes for DDMA's per-expert block ``dparam``
    (``...mlp.experts.routed_experts.w13_weight.3`` -> ``...mlp.experts.3.gate_up_proj.weight``: one expert's
    fused gate+up, which vLLM splits into halves w1 / w3); other names unchanged."""
    head, _, tail = dparam.rpartition(".")
    prefix, _, param = head.rpartition(".")
    prefix = prefix.removesuffix(".routed_experts")  # vllm 0.32: mlp.experts (MoERunner).routed_experts
    if param not in EXPERT_PARAMS or not tail.isdecimal() or not prefix.endswith(".experts"):
        return dparam
    return f"{prefix}.{tail}.{EXPERT_PARAMS[param]}.weight"


def _copy_local_expert(param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str = "",
                       shard_id: str | None = None, expert_id: int | None = None,
                       return_success: bool = False) -> bool | None:
    """FusedMoE's loader call (same keywords) for a tensor already in the worker's local layout:
    expert ``expert_id``'s half ``w1`` / ``w3`` of ``w13_weight[e]``, or all of ``w2_weight[e]``."""
    if shard_id not in ("w1", "w3", "w2") or expert_id is None:
        raise ValueError(f"ddma landing of {weight_name!r}: expected an expert shard w1/w3/w2 with an "
                         f"expert_id, got shard {shard_id!r}, expert {expert_id!r}")
    block = param.data[int(expert_id)]
    if shard_id != "w2":
        half = block.shape[0] // 2
        block = block.narrow(0, 0 if shard_id == "w1" else half, half)
    if tuple(block.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"ddma landing: expert {expert_id} {shard_id} staging {tuple(loaded_weight.shape)} does "
                         f"not match the worker's block {tuple(block.shape)} of {weight_name}")
    block.copy_(loaded_weight)
    return True if return_success else None


def expert_blocks(on_param: OnParam, layouts: Mapping[str, object]) -> OnParam:
    """Wrap a landing report so a stacked expert parameter (``w13_weight`` [E, ...]) is reported as
    its experts' blocks ``<name>.<e>``, the names DDMA's layouts and checksums use."""
    def report(name: str, t: torch.Tensor) -> None:
        if name not in layouts and f"{name}.0" in layouts and t.dim() == 3:
            for e in range(t.shape[0]):
                on_param(f"{name}.{e}", t[e])
        else:
            on_param(name, t)
    return report


@contextlib.contextmanager
def local_layout_loading(model: torch.nn.Module) -> Iterator[None]:
    """Within this context every parameter of ``model`` loads a local-layout tensor by plain copy.

    The layerwise reload rebuilds parameters from metadata recorded at load time
    (``LAYERWISE_INFO[layer].restore_metadata``) and wraps their ``weight_loader``, so the override
    goes into that metadata (and the live parameters), and is undone afterwards.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    saved: list[tuple[dict, str, Any]] = []

    def override(t: torch.Tensor, name: str) -> None:
        d = t.__dict__
        key = "_weight_loader" if "_weight_loader" in d else "weight_loader"
        saved.append((d, key, d.get(key, _MISSING)))
        d[key] = _copy_local_expert if name in EXPERT_PARAMS and t.dim() == 3 else _copy_local

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None:
            for name, meta in info.restore_metadata[0].items():
                override(meta, name)
        for name, p in layer.named_parameters(recurse=False):
            override(p, name)
    try:
        yield
    finally:
        for d, key, old in reversed(saved):
            if old is _MISSING:
                d.pop(key, None)
            else:
                d[key] = old


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # as megarl/generator/weights.py


@contextlib.contextmanager
def quiet_skipped_layers(model: torch.nn.Module, receiver) -> Iterator[None]:
    """A partial sync (``SyncSpec.skip``: a LoRA run's frozen tensors after its first sync) lands no tensor
    of some layers; vLLM's reload puts their tensors back, as meant, and warns "<Layer>: Failed to load
    weights" for each (62 lines a sync for a 30-layer model). Within the landing, that warning is dropped for
    the classes of the layers this sync left out; a parameter the sync sent and the engine did not land
    still fails verification (``DdmaReceiver.verify_landed``)."""
    import logging

    def skipped_classes() -> set[str]:
        part = getattr(receiver, "_active", receiver)
        out = set()
        for name in getattr(part, "skipped", ()):
            try:
                out.add(type(model.get_submodule(name.rsplit(".", 1)[0])).__name__)
            except AttributeError:
                pass
        return out

    class _Skipped(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.msg == "%s: Failed to load weights" and record.args
                        and record.args[0] in skipped_classes())

    logger, f = logging.getLogger(RELOAD_LOGGER), _Skipped()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _corrupt_first(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fault injection ``ddma_corrupt_landing`` (megarl/utils/faults.py): the first tensor lands with
    one element changed, so the checksums after landing must catch it."""
    for i, (name, t) in enumerate(stream):
        if i == 0:
            t.view(-1)[0] += 1.0
        yield name, t


def _hold_after_first(stream: Iterator[tuple[str, torch.Tensor]], version: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Fault pause ``ddma_received@v<V>`` (megarl/utils/faults.py): once the first tensor of weights vV
    has arrived from the trainer (bytes moved), say so in the replica's log and hold, so a test kills a
    sender in the middle of the transfer."""
    for i, (name, t) in enumerate(stream):
        if i == 0:
            print(f"{time.strftime('%H:%M:%S')} INFO megarl.generator.ddma_source: pid {os.getpid()}: received "
                  f"{t.numel() * t.element_size()} bytes of weights v{version} ({name}): fault pause", flush=True)
            pause_point(f"ddma_received@v{version}")
        yield name, t


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
        stream = ((expert_checkpoint_name(n), t) for n, t in self.receiver.stream(self.version))
        if injected("ddma_corrupt_landing") is not None:
            stream = _corrupt_first(stream)
        if armed(f"ddma_received@v{self.version}"):
            stream = _hold_after_first(stream, self.version)
        return stream

    @contextlib.contextmanager
    def landing(self, model: torch.nn.Module) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(local_layout_loading(model))
            stack.enter_context(quiet_skipped_layers(model, self.receiver))
            if self.receiver.spec.verifies(self.version):
                stack.enter_context(watch_landing(model, expert_blocks(self.receiver.check_landed,
                                                                       self.receiver.layouts)))
            yield

    def after_landing(self) -> None:
        self.receiver.verify_landed(self.version)
        self.worker.__dict__["_megarl_ddma_stats"] = self.receiver.last_stats


register_weight_source("ddma", DdmaSource)

__all__ = ["DdmaSource", "local_layout_loading", "expert_checkpoint_name", "expert_blocks", "EXPERT_PARAMS"]
