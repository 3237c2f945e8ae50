"""The ``shm`` weight source: full HF-format tensors in one host shared-memory file.

The sender (:func:`pack_to_shm`) writes every tensor once; every worker of every replica maps the
file read-only and hands the tensors to vLLM's own loaders, which narrow each to the worker's TP
shard (one copy on the host, no bytes pickled). It is the ``sync.method=shm`` strategy (a
single-rank trainer assembles the whole model) and the reference DDMA is checked against.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megarl.generator.weight_source import WeightSource, register_weight_source

_ALIGN = 64  # bytes; every tensor starts on a cache-line boundary in the shared file


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


class _ShmSource(WeightSource):
    def __init__(self, source: dict):
        self.source = source

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        path = self.source["path"]
        if not os.path.exists(path):
            raise FileNotFoundError(f"weight file {path} is gone: the sender unlinked it before this "
                                    f"worker read it (update timed out?)")
        buf = torch.from_file(path, shared=True, size=self.source["nbytes"], dtype=torch.uint8)
        for name, dtype_name, shape, off in self.source["entries"]:
            dtype = getattr(torch, dtype_name)
            n = int(torch.Size(shape).numel()) * dtype.itemsize
            yield name, buf[off:off + n].view(dtype).view(shape)


def _open_shm(source: dict, worker: Any = None) -> WeightSource:
    return _ShmSource(source)


register_weight_source("shm", _open_shm)

__all__ = ["ShmWeights", "pack_to_shm"]
