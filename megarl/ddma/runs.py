"""Copy runs: (src_offset, dst_offset, length) element ranges that a DDMA plan executes.

`merge_contiguous_runs_ref` is the pure-Python reference of the C++ `megarl._C.merge_contiguous_runs`
(csrc/merge_runs.cpp); use :func:`merge_contiguous_runs`, which picks the C++ one when built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megarl import native

RunsLike = torch.Tensor | Sequence[int]


def as_run_tensor(values: RunsLike, name: str) -> torch.Tensor:
    """Turn a list or tensor of offsets/lengths into the 1-D int64 CPU tensor the kernels take."""
    tensor = torch.as_tensor(values)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.numel() and (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool):
        raise ValueError(f"{name} must hold integers, got {tensor.dtype}")
    return tensor.to(device="cpu", dtype=torch.int64)


def merge_contiguous_runs_ref(
    src_offsets: RunsLike, dst_offsets: RunsLike, lengths: RunsLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge consecutive copies that are contiguous in both source and destination.

    Copy i+1 joins the current run when it starts where the run ends on both sides. Order is kept
    (sort the plan first for maximal merging); zero-length copies are dropped. Returns three int64
    tensors (src_offsets, dst_offsets, lengths).
    """
    src = as_run_tensor(src_offsets, "src_offsets").tolist()
    dst = as_run_tensor(dst_offsets, "dst_offsets").tolist()
    lens = as_run_tensor(lengths, "lengths").tolist()
    if not len(src) == len(dst) == len(lens):
        raise ValueError(
            f"src_offsets, dst_offsets and lengths must have equal lengths, got "
            f"{len(src)}, {len(dst)}, {len(lens)}"
        )
    out_src: list[int] = []
    out_dst: list[int] = []
    out_len: list[int] = []
    for i, (s, d, n) in enumerate(zip(src, dst, lens)):
        if n < 0:
            raise ValueError(f"lengths[{i}] = {n} is negative")
        if s < 0 or d < 0:
            raise ValueError(f"copy {i} has a negative offset (src {s}, dst {d})")
        if n == 0:
            continue
        if out_len and out_src[-1] + out_len[-1] == s and out_dst[-1] + out_len[-1] == d:
            out_len[-1] += n
        else:
            out_src.append(s)
            out_dst.append(d)
            out_len.append(n)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return as_tensor(out_src), as_tensor(out_dst), as_tensor(out_len)


def merge_contiguous_runs(
    src_offsets: RunsLike, dst_offsets: RunsLike, lengths: RunsLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`merge_contiguous_runs_ref` in C++ (``megarl._C``) when built, else the reference."""
    merge = native.native_function("merge_contiguous_runs")
    if merge is None:
        native.warn_fallback_once()
        return merge_contiguous_runs_ref(src_offsets, dst_offsets, lengths)
    return merge(as_run_tensor(src_offsets, "src_offsets"), as_run_tensor(dst_offsets, "dst_offsets"),
                 as_run_tensor(lengths, "lengths"))


# --- Blocks: runs folded into strided rectangles, the landing tables of the transports --------------
#
# A landing used to expand its runs into two int64 indices per element (16 B/element, kept on the
# device by cuda_ipc; rebuilt on the CPU every sync for FP8). A *block* says the same with six or eight
# integers: ``rows`` runs of ``length`` elements, the i-th starting at ``start + i * stride`` on each
# side. Consecutive runs of one length whose starts advance by constant strides fold into one block:
# a dim-1 piece (one run per row) becomes one block, Megatron's per-group ``linear_qkv`` runs become
# three (q, k, v), so a (sender, parameter) pair takes a handful of strided copies, one launch each.
# Tables are built once per plan (O(runs) time and memory) and held as Python ints on the host: the
# device holds no index memory at all, and a copy is ``as_strided`` on each side.

BLOCK_INTS = 6  # (src_start, src_stride, dst_start, dst_stride, rows, length)
FP8_BLOCK_INTS = 8  # (code_start, code_stride, scale_start, scale_stride, dst_start, dst_stride, rows, length)
CHUNK_ELEMENTS = 1 << 22  # a block landed in row chunks of at most ~4M elements: FP8's float32
                          # temporaries stay ~24 MB however large the block (an embedding is ~500M)


def _fold(pieces: list[tuple[int, ...]], n_sides: int) -> list[tuple[int, ...]]:
    """Fold single-row pieces ``(start_1, ..., start_n, length)`` (the last start: the destination's) into
    blocks ``(start_1, stride_1, ..., start_n, stride_n, rows, length)``. Pieces are taken by length, then
    destination start (destination runs are disjoint, so the order they land in does not matter), and a
    piece joins the block before it when it has the same length and every start is the block's next one
    (constant stride per side, strides > 0): Megatron's per-group q, k and v runs, interleaved in the
    plan, fold into one block each."""
    out: list[list[int]] = []
    for piece in sorted(pieces, key=lambda p: (p[n_sides], p[n_sides - 1])):
        starts, length = piece[:n_sides], piece[n_sides]
        if out:
            b = out[-1]
            rows = b[2 * n_sides]
            if b[2 * n_sides + 1] == length:
                if rows == 1:
                    strides = [starts[k] - b[2 * k] for k in range(n_sides)]
                    if all(st > 0 for st in strides):
                        for k in range(n_sides):
                            b[2 * k + 1] = strides[k]
                        b[2 * n_sides] = 2
                        continue
                elif all(starts[k] == b[2 * k] + rows * b[2 * k + 1] for k in range(n_sides)):
                    b[2 * n_sides] = rows + 1
                    continue
        block = []
        for k in range(n_sides):
            block += [starts[k], 0]
        out.append(block + [1, length])
    return [tuple(b) for b in out]


def copy_blocks(src_offsets: Sequence[int], dst_offsets: Sequence[int], lengths: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The runs ``(src_offsets[i], dst_offsets[i], lengths[i])``, in order, as blocks
    ``(src_start, src_stride, dst_start, dst_stride, rows, length)`` (:data:`BLOCK_INTS` ints each)."""
    pieces = [(s, d, n) for s, d, n in zip(src_offsets, dst_offsets, lengths) if n > 0]
    return tuple(_fold(pieces, 2))


def fp8_blocks(code_starts: Sequence[int], src_offsets: Sequence[int], dst_offsets: Sequence[int],
               lengths: Sequence[int], scale_bases: Sequence[int], cols: int) -> tuple[tuple[int, ...], ...]:
    """FP8 landing blocks ``(code_start, code_stride, scale_start, scale_stride, dst_start, dst_stride, rows,
    length)`` whose every row lies inside one source row, so one row scale serves it.

    Run i's element j is code ``code_starts[i] + j`` (the codes buffer: the sender's wire tensor, or a
    packed message), comes from source element ``src_offsets[i] + j`` of a ``cols``-wide parameter, is
    scaled by ``scales[scale_bases[i] + (src_offsets[i] + j) // cols]`` and lands at ``dst_offsets[i] + j``.
    A run is cut at source row edges (a partial first row, its whole rows as one block, a partial last
    row), then consecutive pieces fold as in :func:`copy_blocks`."""
    pieces: list[tuple[int, ...]] = []
    for c0, s0, d0, n, base in zip(code_starts, src_offsets, dst_offsets, lengths, scale_bases):
        pos, end = s0, s0 + n
        while pos < end:
            row, col = divmod(pos, cols)
            if col == 0 and end - pos >= 2 * cols:  # whole rows: one block of its own, stride cols
                rows = (end - pos) // cols
                pieces.append((c0 + pos - s0, cols, base + row, 1, d0 + pos - s0, cols, rows, cols))
                pos += rows * cols
                continue
            take = min(end, (row + 1) * cols) - pos
            pieces.append((c0 + pos - s0, base + row, d0 + pos - s0, take))
            pos += take
    # whole-row blocks are already blocks; single-row pieces fold among themselves around them
    out: list[tuple[int, ...]] = []
    run: list[tuple[int, ...]] = []
    for p in pieces:
        if len(p) == FP8_BLOCK_INTS:
            out += _fold(run, 3)
            run = []
            out.append(p)
        else:
            run.append(p)
    return tuple(out + _fold(run, 3))


def table_bytes(blocks: Sequence[tuple[int, ...]]) -> int:
    """What a block table holds, counted as int64s (its memory, O(blocks))."""
    return 8 * sum(len(b) for b in blocks)


def _rows(t: torch.Tensor, start: int, stride: int, rows: int, length: int) -> torch.Tensor:
    """``rows`` x ``length`` view of 1-D ``t``: row i is ``t[start + i * stride : ... + length]``."""
    return t.as_strided((rows, length), (stride, 1), t.storage_offset() + start)


def _row_chunks(rows: int, length: int):
    step = max(1, CHUNK_ELEMENTS // max(1, length))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step) - r0


def land_blocks(dst: torch.Tensor, src: torch.Tensor, blocks: Sequence[tuple[int, ...]]) -> None:
    """``dst[dst_start + i*dst_stride : +length] = src[src_start + i*src_stride : +length]`` for every row
    of every block (1-D tensors of one dtype, on one device): one strided copy per block."""
    land_views(dst, source_views(src, blocks))


def source_views(src: torch.Tensor, blocks: Sequence[tuple[int, ...]]) -> tuple[tuple, ...]:
    """``blocks`` with their source side made views of ``src``, for :func:`land_views`: ``(dst_start,
    dst_stride, rows, length, view)`` each, in bytes, the view in the widest word (:func:`_word`) that the
    block's starts, strides and length allow on both sides, for a destination whose storage starts on an
    8-byte boundary (a fresh staging tensor; :func:`land_views` checks). A source that outlives one landing
    (an opened IPC storage) keeps its views, so a sync makes only the destination's."""
    sb, isz = src.view(torch.uint8), src.element_size()
    out = []
    for s0, ss, d0, ds, rows, n in blocks:
        s0, ss, d0, ds, n = s0 * isz, ss * isz, d0 * isz, ds * isz, n * isz
        word = _word(sb.storage_offset() + s0, ss, d0, ds, n)
        out.append((d0, ds, rows, n, _rows(sb, s0, ss, rows, n).view(word)))
    return tuple(out)


def land_views(dst: torch.Tensor, views: Sequence[tuple]) -> None:
    """Copy each :func:`source_views` block into 1-D ``dst``: one strided copy per block, in the source
    view's words (in bytes where ``dst``'s storage does not start on a word boundary)."""
    db = dst.view(torch.uint8)
    for d0, ds, rows, n, src in views:
        b = _rows(db, d0, ds, rows, n)
        if db.storage_offset() % src.element_size():
            src = src.view(torch.uint8)
        else:
            b = b.view(src.dtype)
        b.copy_(src)


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _word(*byte_ints: int) -> torch.dtype:
    """The widest word (8, 4 or 2 bytes, else 1) dividing every one of ``byte_ints`` (a block's byte starts,
    strides and length): a GPU copy kernel moves one element per thread step, so a block copied as bf16
    takes 4x the steps of int64 words, as bytes 8x."""
    g = math.gcd(*byte_ints)
    return next((dt for w, dt in _WORDS if g % w == 0), torch.uint8)


def copy_byte_blocks(dst: torch.Tensor, src: torch.Tensor, blocks: Sequence[tuple[int, ...]]) -> int:
    """:func:`land_blocks` over byte tensors (1-D uint8), each block moved in the widest word its starts
    (storage offsets included), strides and length allow (:func:`_word`). One strided copy per block;
    returns how many."""
    for s0, ss, d0, ds, rows, n in blocks:
        a, b = _rows(src, s0, ss, rows, n), _rows(dst, d0, ds, rows, n)
        word = _word(a.storage_offset(), ss, b.storage_offset(), ds, n)
        b.view(word).copy_(a.view(word))
    return len(blocks)


def dequant_blocks(dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   blocks: Sequence[tuple[int, ...]]) -> int:
    """Land FP8 blocks: ``dst`` rows = e4m3 ``codes`` rows (uint8) x their row's float32 scale, cast to
    ``dst``'s dtype -- the elementwise product ``transport.base.dequant`` takes, so the bits are its bits.
    Returns the largest scratch (float32 product and cast) held at once, in bytes."""
    fp8 = torch.float8_e4m3fn
    peak = 0
    for c0, cs, g0, gs, d0, ds, rows, n in blocks:
        for r0, r in _row_chunks(rows, n):
            q = _rows(codes, c0 + r0 * cs, cs, r, n).view(fp8)
            sc = scales.as_strided((r, 1), (gs, 1), scales.storage_offset() + g0 + r0 * gs)
            _rows(dst, d0 + r0 * ds, ds, r, n).copy_((q.float() * sc).to(dst.dtype))
            peak = max(peak, r * n * (4 + dst.element_size()))
    return peak
