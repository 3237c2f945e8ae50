"""The generator's weight-update entry point.

A weight update reaches every vLLM worker (each TP rank of each replica) as a small, picklable
*weight source* ``{"kind": ..., ...}``. The worker opens it into an iterator of checkpoint-format
``(hf_name, tensor)`` pairs and hands that to vLLM's layerwise reload
(``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``), which narrows each
tensor to the worker's TP shard, re-quantizes FP8 and repacks (oneDNN on CPU) layer by layer, in
place. Writing into vLLM's parameters directly (``model.load_weights`` after start-up) breaks once
they have been repacked; this path does not.

Sources are a registry (:func:`register_weight_source`), so a transport plugs in without touching
the engine: the built-in ``"shm"`` source is one host shared-memory file holding full HF-format
tensors that every worker of every replica maps read-only (one copy on the host, no bytes pickled).
DDMA will register its own kind whose opener receives only the rows/columns this rank's shard
needs into a staging buffer laid out as the loader expects, yielding the same ``(hf_name, tensor)``
pairs (see DESIGN §5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_ALIGN = 64  # bytes; every tensor starts on a cache-line boundary in the shared file

WeightOpener = Callable[[dict, Any], Iterator[tuple[str, torch.Tensor]]]
_SOURCES: dict[str, WeightOpener] = {}


def register_weight_source(kind: str, opener: WeightOpener) -> None:
    """Teach every worker to open weight sources of ``kind``.

    ``opener(source, worker)`` yields ``(hf_name, tensor)`` pairs in checkpoint format (HF names,
    full logical shape or the slice vLLM's loader expects), ideally grouped by layer so the
    layerwise reload processes and frees each layer as soon as it is complete. Register at import
    time of a module the workers import (this one, or one named in the source's ``"module"``).
    """
    _SOURCES[kind] = opener


def open_weight_source(source: dict, worker: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    kind = source.get("kind")
    if kind not in _SOURCES and source.get("module"):
        __import__(source["module"])  # a transport's module registers its kind on import
    if kind not in _SOURCES:
        raise ValueError(f"unknown weight source kind {kind!r}; registered: {sorted(_SOURCES)}")
    return _SOURCES[kind](source, worker)


# ----------------------------------------------------------------------------------------------
# "shm": one shared-memory file with every tensor, written once by the sender.

@dataclasses.dataclass
class ShmWeights:
    """A packed set of tensors in a host shared-memory file; ``source()`` is what workers get."""

    path: str
    nbytes: int
    entries: list[tuple[str, str, tuple[int, ...], int]]  # (hf_name, dtype, shape, byte offset)

    def source(self) -> dict:
        return {"kind": "shm", "path": self.path, "nbytes": self.nbytes, "entries": self.entries}

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def pack_to_shm(named_tensors: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None = None) -> ShmWeights:
    """Copy ``(hf_name, tensor)`` pairs into one shared-memory file (floating tensors cast to
    ``dtype`` when given: the engine's dtype, so bytes are not wasted on fp32)."""
    items = []
    offset = 0
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        out_dtype = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        nbytes = t.numel() * out_dtype.itemsize
        items.append((name, t, out_dtype, offset))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    total = max(offset, _ALIGN)
    path = os.path.join(_shm_dir(), f"megarl-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    entries = []
    try:
        for name, t, out_dtype, off in items:
            n = t.numel() * out_dtype.itemsize
            buf[off:off + n].view(out_dtype).view(t.shape).copy_(t.detach().to("cpu"))
            entries.append((name, str(out_dtype).removeprefix("torch."), tuple(t.shape), off))
    except BaseException:
        os.unlink(path)
        raise
    del buf
    return ShmWeights(path=path, nbytes=total, entries=entries)


def _open_shm(source: dict, worker: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    path = source["path"]
    if not os.path.exists(path):
        raise FileNotFoundError(f"weight file {path} is gone: the sender unlinked it before this "
                                f"worker read it (update timed out?)")
    buf = torch.from_file(path, shared=True, size=source["nbytes"], dtype=torch.uint8)
    for name, dtype_name, shape, off in source["entries"]:
        dtype = getattr(torch, dtype_name)
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        yield name, buf[off:off + n].view(dtype).view(shape)


register_weight_source("shm", _open_shm)


# ----------------------------------------------------------------------------------------------
# Worker side: mixed into every vLLM worker via EngineArgs(worker_extension_cls=...).

WORKER_EXTENSION = "megarl.generator.weights.MegarlWorkerExtension"


class MegarlWorkerExtension:
    """Methods vLLM mixes into its worker class; called through ``collective_rpc``."""

    def megarl_reload_weights(self, source: dict) -> int:
        """Layerwise-reload this worker's shard from ``source``; returns tensors consumed."""
        count = 0

        def counted():
            nonlocal count
            for item in open_weight_source(source, self):
                count += 1
                yield item

        loading = contextlib.nullcontext()
        if source.get("layout") == "local":  # tensors already in this worker's layout (DDMA)
            from megarl.generator.ddma_source import local_layout_loading

            loading = local_layout_loading(self.model_runner.model)
        with loading:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        _refresh_tied_lm_head(self.model_runner.model)
        return count

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


def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Re-derive a tied lm_head's kernel state from the freshly loaded embedding.

    With tied embeddings the layerwise reload refreshes ``embed_tokens`` only; on CPU the lm_head's
    GEMM runs on a packed copy made when the model first loaded, so without this the engine would
    keep sampling from the old output layer (caught by tests/test_weight_sync.py)."""
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
