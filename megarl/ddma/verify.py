"""DDMA verification: position-weighted checksums in HF coordinates, computed on both sides.

A checksum of a set of elements of one HF tensor is ``sum(bits(value) * w(hf_flat_index)) mod
2**64`` with ``w(i) = (i * 2654435761 + 97) mod 2**32``: integer arithmetic, so the result does
not depend on summation order, and a value that lands at a wrong position changes it (unlike a
plain sum of bytes).

The sender computes it for every (destination rank, HF tensor) from the values it sends and the
HF positions its *trainer* layout says they have; the receiver computes it from the staging
tensor it hands to the engine and the positions its *vLLM* layout says they have. The two
layouts are derived independently (megarl/models/layouts.py and megarl/ddma/layouts.py), so a
wrong plan, a wrong offset or a corrupted transfer shows up as a mismatch that names the tensor,
the ranks and the byte range. (A wrong vLLM layout that both the plan and the receiver share is
what the logprob probe catches.)
"""

from __future__ import annotations

import math

import torch

from megarl.models.layouts import ParamLayout

from megarl.native import _C, cuda_kernels_for

_W_MUL, _W_ADD, _MASK32 = 2654435761, 97, 0xFFFFFFFF


class DdmaVerifyError(RuntimeError):
    """The generator does not hold the trainer's weights after a sync."""


def value_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of every element as non-negative int64 (1-, 2- or 4-byte dtypes)."""
    flat = t.reshape(-1)
    size = flat.element_size()
    if size == 1:
        return flat.view(torch.uint8).to(torch.int64)
    if size == 2:
        return flat.view(torch.int16).to(torch.int64) & 0xFFFF
    if size == 4:
        return flat.view(torch.int32).to(torch.int64) & _MASK32
    raise ValueError(f"checksums take 1/2/4-byte dtypes, got {t.dtype}")


def weighted_checksum(bits: torch.Tensor, hf_index: torch.Tensor) -> int:
    """``sum(bits * w(hf_index)) mod 2**64`` as a Python int in [0, 2**64)."""
    w = (hf_index * _W_MUL + _W_ADD) & _MASK32
    return int((bits * w).sum()) & 0xFFFFFFFFFFFFFFFF


def hf_flat_index(layout: ParamLayout, hf_name: str, local_flat: torch.Tensor) -> torch.Tensor:
    """HF flat (row-major) index of each local flat element of ``layout`` that belongs to
    ``hf_name``; raises ValueError for an element no piece of that tensor covers."""
    shape = layout.local_shape
    out = torch.full_like(local_flat, -1)
    for p in layout.pieces:
        if p.hf_name != hf_name:
            continue
        inner = math.prod(shape[p.dim + 1:])
        rows, hf_rows = shape[p.dim], p.hf_shape[p.dim]
        o, rem = local_flat // (rows * inner), local_flat % (rows * inner)
        r, c = rem // inner, rem % inner
        mine = (r >= p.local_start) & (r < p.local_start + p.length)
        hf = o * (hf_rows * inner) + (p.hf_start + r - p.local_start) * inner + c
        out = torch.where(mine, hf, out)
    if bool((out < 0).any()):
        bad = int(local_flat[out < 0][0])
        raise ValueError(f"local element {bad} of a {shape} tensor is not part of {hf_name}")
    return out


def run_indices(offsets: list[int], lengths: list[int]) -> torch.Tensor:
    """Concatenated ``arange(offset, offset + length)`` for every run, as one int64 tensor."""
    if not offsets:
        return torch.empty(0, dtype=torch.int64)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.tensor(offsets, dtype=torch.int64)
    base = torch.repeat_interleave(starts - torch.cumsum(lengths_t, 0) + lengths_t, lengths_t)
    return base + torch.arange(int(lengths_t.sum()), dtype=torch.int64)


Segments = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (local offsets, lengths, HF start indices)


def hf_segments(layout: ParamLayout, hf_name: str, offsets: list[int], lengths: list[int]) -> Segments:
    """Split local element runs of ``hf_name`` into segments whose HF flat indices are affine
    (``hf_start + k``): a run is cut wherever it leaves one outer index's block of piece rows."""
    shape = layout.local_shape
    pieces = [p for p in layout.pieces if p.hf_name == hf_name]
    out_off, out_len, out_hf = [], [], []
    for start, n in zip(offsets, lengths):
        pos, end = start, start + n
        while pos < end:
            for p in pieces:
                inner = math.prod(shape[p.dim + 1:])
                block = shape[p.dim] * inner
                o, r = divmod(pos, block)
                r //= inner
                if p.local_start <= r < p.local_start + p.length:
                    break
            else:
                raise ValueError(f"local element {pos} of a {shape} tensor is not part of {hf_name}")
            seg_end = min(end, o * block + (p.local_start + p.length) * inner)
            hf = o * p.hf_shape[p.dim] * inner + (p.hf_start - p.local_start) * inner + (pos - o * block)
            out_off.append(pos)
            out_len.append(seg_end - pos)
            out_hf.append(hf)
            pos = seg_end
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_t(out_off), as_t(out_len), as_t(out_hf)


def _run_indices_on(starts: torch.Tensor, lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """:func:`run_indices` built on ``device`` from the (small) per-run tensors."""
    starts, lengths = starts.to(device), lengths.to(device)
    base = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
    return base + torch.arange(base.numel(), dtype=torch.int64, device=device)


CHUNK_ELEMENTS = 1 << 22  # elements per chunk of the torch path: at most ~48 bytes each (two int64
                          # index tensors, the gathered values, their int64 bits, the weights, the
                          # products), so ~200 MB on a device, whatever the tensor's size


def checksum_segments(flat: torch.Tensor, segments: Segments) -> int:
    """:func:`weighted_checksum` of ``flat``'s elements over ``segments``, where the data is: C++ for
    host tensors when built; for CUDA tensors the CUDA kernel (csrc/cuda/checksum.cu, one launch at HBM
    speed) when the extension was built with it, else torch ops on the device
    (:func:`checksum_segments_torch`, a few launches per 4M elements). Only the 8-byte result leaves the
    device either way."""
    offs, lens, hfs = segments
    if flat.device.type == "cpu" and _C is not None and hasattr(_C, "weighted_checksum_segments"):
        return int(_C.weighted_checksum_segments(flat.contiguous(), offs, lens, hfs))
    if (flat.device.type == "cuda" and _C is not None and hasattr(_C, "weighted_checksum_segments_cuda")
            and cuda_kernels_for(flat.device)):
        return int(_C.weighted_checksum_segments_cuda(flat.contiguous(), offs, lens, hfs))
    return checksum_segments_torch(flat, segments)


def checksum_segments_torch(flat: torch.Tensor, segments: Segments, chunk: int = CHUNK_ELEMENTS) -> int:
    """The torch path of :func:`checksum_segments`, on ``flat``'s device, ``chunk`` elements at a time:
    the segments' elements, taken in order, are cut into chunks (a chunk edge may fall inside a
    segment), each chunk's index tensors are built on the device from its (small) per-segment starts
    and lengths, and the partial sums add up on the device. int64 products and sums wrap modulo 2**64
    on every device, so the result is the unchunked one and the C++ kernel's."""
    if segments[1].numel() == 0:
        return 0
    return int(_checksum_torch_on_device(flat, segments, chunk)) & 0xFFFFFFFFFFFFFFFF


def _checksum_torch_on_device(flat: torch.Tensor, segments: Segments, chunk: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """:func:`checksum_segments_torch`'s sum as an int64 scalar on ``flat``'s device (not read back)."""
    offs, lens, hfs = segments
    flat = flat.reshape(-1)
    acc = torch.zeros((), dtype=torch.int64, device=flat.device)
    if lens.numel() == 0:
        return acc
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    total = int(ends[-1])
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        i0 = int(torch.searchsorted(ends, torch.tensor(lo), right=True))  # first segment ending after lo
        i1 = int(torch.searchsorted(starts, torch.tensor(hi)))  # segments starting before hi
        s, n = starts[i0:i1], lens[i0:i1]
        cut_lo, cut_hi = (lo - s).clamp(min=0), (s + n - hi).clamp(min=0)
        n = n - cut_lo - cut_hi
        idx = _run_indices_on(offs[i0:i1] + cut_lo, n, flat.device)
        hf = _run_indices_on(hfs[i0:i1] + cut_lo, n, flat.device)
        acc += (value_bits(flat[idx]) * ((hf * _W_MUL + _W_ADD) & _MASK32)).sum()
        del idx, hf
    return acc


class DigestBatch:
    """One sync's digests on one side, summed per key and read back from the device once.

    On a host tensor each :meth:`add` is the C++ kernel's sum, at once. On a device each is queued on
    the current stream and not waited for (issue 46: the IPC sync spent 29 of its 54 ms on ~146 digests
    a side, each copying its table over and reading its 8 bytes back, a stream sync each): the CUDA
    kernel's batched form (``weighted_checksum_segments_cuda_add``) adds into an int64 slot of the key
    on the device, reading a segment table put on the device once per plan (``tables``: the side's
    cache, kept across syncs); without that kernel the torch path adds its on-device sum into the slot.
    :meth:`values` reads every slot back in one copy. Sums wrap mod 2**64 whatever the order, so the
    values are :func:`checksum_segments`' to the bit. ``deferred`` forces the device path on the host
    (the CPU tests of its bookkeeping)."""

    def __init__(self, tables: dict | None = None, deferred: bool | None = None):
        self.tables = {} if tables is None else tables  # table key -> (device table, total, reach)
        self.deferred = deferred
        self._host: dict = {}    # key -> int (summed mod 2**64)
        self._slots: dict = {}   # key -> int64 tensor of one element on the device
        self.readbacks = 0       # device-to-host copies made by values() (one per call with queued work)
        self.digests = 0         # digests added (add and set): none on a sync that is not verified

    def reset(self, key) -> None:
        """Forget ``key``'s sum (a parameter reported again replaces its earlier report)."""
        self._host.pop(key, None)
        self._slots.pop(key, None)

    def set(self, key, value: int) -> None:
        """Add a digest computed elsewhere (the fused copy + digest of zero_copy) to ``key``."""
        self.digests += 1
        self._host[key] = (self._host.get(key, 0) + value) & 0xFFFFFFFFFFFFFFFF

    def add(self, key, flat: torch.Tensor, segments: Segments, table_key=None) -> None:
        """Add :func:`checksum_segments` of ``flat`` over ``segments`` to ``key``'s sum; ``table_key``
        (default ``key``) names the segments in ``tables`` (the same segments every sync)."""
        deferred = flat.device.type != "cpu" if self.deferred is None else self.deferred
        if not deferred:
            return self.set(key, checksum_segments(flat, segments))
        self.digests += 1
        flat = flat.reshape(-1)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = torch.zeros(1, dtype=torch.int64, device=flat.device)
        kernel = _cuda_add_kernel(flat)
        if kernel is None:
            slot += _checksum_torch_on_device(flat, segments)
            return
        tk = key if table_key is None else table_key
        entry = self.tables.get(tk)
        if entry is None or entry[0].device != flat.device:
            offs, lens, hfs = segments
            reach = int((offs + lens).max()) if lens.numel() else 0
            entry = self.tables[tk] = (torch.cat([offs, lens, hfs, torch.cumsum(lens, 0)]).to(flat.device),
                                       int(lens.sum()), reach)
        table, total, reach = entry
        if reach > flat.numel():  # the bounds check the C++ kernel makes from host tables
            raise ValueError(f"a segment reaches element {reach}, outside the tensor of {flat.numel()} elements")
        kernel(flat.contiguous(), table, total, slot)

    def values(self) -> dict:
        """Every key's sum, as an int in [0, 2**64): one device-to-host copy for all the queued ones."""
        out = dict(self._host)
        if self._slots:
            keys = list(self._slots)
            got = torch.cat([self._slots[k] for k in keys]).tolist()  # the one readback
            self.readbacks += 1
            for k, v in zip(keys, got):
                out[k] = (out.get(k, 0) + v) & 0xFFFFFFFFFFFFFFFF
        return out


def _cuda_add_kernel(flat: torch.Tensor):
    """The batched CUDA digest kernel for ``flat``, or None (a host tensor, no such build, or a GPU the
    build cannot run: see :func:`megarl.native.cuda_kernels_for`)."""
    if flat.device.type != "cuda" or _C is None or not hasattr(_C, "weighted_checksum_segments_cuda_add"):
        return None
    return _C.weighted_checksum_segments_cuda_add if cuda_kernels_for(flat.device) else None


__all__ = ["DdmaVerifyError", "value_bits", "weighted_checksum", "hf_flat_index", "run_indices",
           "hf_segments", "checksum_segments", "checksum_segments_torch", "CHUNK_ELEMENTS", "DigestBatch"]
