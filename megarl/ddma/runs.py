"""Copy runs: (src_offset, dst_offset, length) element ranges that a DDMA plan executes.

`merge_contiguous_runs_ref` is the pure-Python reference of the C++ `megarl._C.merge_contiguous_runs`
(csrc/merge_runs.cpp); use :func:`merge_contiguous_runs`, which picks the C++ one when built.
"""

from __future__ import annotations

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
