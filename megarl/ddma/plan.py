"""DDMA reference planner (pure Python): which flat element runs every trainer rank sends to every
vLLM worker so each worker's parameters become the trainer's weights.

:func:`plan_sync` walks the source and destination layouts (:mod:`megarl.ddma.layouts`) in HF
coordinates and emits, for every (source rank, destination rank) pair, :class:`Copy` runs over the
*row-major flattened local tensors*: ``dst[dst_param].view(-1)[dst_offset:+numel] =
src[src_param].view(-1)[src_offset:+numel]``. Runs are merged when contiguous on both sides
(:func:`megarl.ddma.runs.merge_contiguous_runs_ref`), per (hf_name, src_param, dst_param), so a
copy never spans two HF tensors.

Guarantees (checked while planning; a violation raises ValueError): every destination element
that holds HF data is written exactly once; vLLM vocab padding rows are never written.

Choice of sender (load balance): source pieces with identical HF coordinates are replicas (DP
replicas hold every piece; norms are also replicated over TP). For each destination piece, each
overlap with a source piece is one unit; units are assigned in a fixed order (destination ranks,
then parameters, then pieces) to the replica that has sent the fewest elements so far (ties: the
lowest ``SrcRank``). Greedy least-loaded: within a DP group the bytes sent differ by at most one
unit (at most one HF tensor's slice).

Plans are cached per ``(dims, src topology, dst topology, impl)`` (``functools.lru_cache``); treat
the returned plan as read-only. ``plan_sync(..., impl="auto")`` uses the C++ planner
(:mod:`megarl.ddma.plan_native`, csrc/plan.cpp) when the extension is built: the same plan, copy for
copy, much faster at 405B scale; the Python code here stays the reference it is tested against.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from types import MappingProxyType
from typing import Mapping

import torch

from megarl.ddma import plan_native
from megarl.ddma.layouts import (DstRank, GeneratorTopology, SrcRank, TrainerTopology, destination_layouts,
                                 source_layouts)
from megarl.ddma.plan_types import Copy, SyncPlan, local_shapes
from megarl.ddma.runs import merge_contiguous_runs_ref
from megarl.models.layouts import ModelDims, ParamLayout


@dataclasses.dataclass
class _SrcGroup:
    """Source pieces with identical HF coordinates (replicas)."""

    dim: int
    hf_start: int
    length: int
    holders: list[tuple[SrcRank, str, int, tuple[int, ...]]]  # (rank, param, local_start, local_shape)


def _index_sources(src_lay: Mapping[SrcRank, Mapping[str, ParamLayout]]) -> dict[str, tuple[list[int], list[_SrcGroup]]]:
    groups: dict[str, dict[tuple[int, int, int], _SrcGroup]] = {}
    for rank in sorted(src_lay):
        for param, layout in src_lay[rank].items():
            for p in layout.pieces:
                key = (p.dim, p.hf_start, p.length)
                g = groups.setdefault(p.hf_name, {}).setdefault(key, _SrcGroup(p.dim, p.hf_start, p.length, []))
                g.holders.append((rank, param, p.local_start, layout.local_shape))
    index = {}
    for hf_name, by_key in groups.items():
        ordered = sorted(by_key.values(), key=lambda g: g.hf_start)
        for a, b in zip(ordered, ordered[1:]):
            if a.dim != b.dim or a.hf_start + a.length > b.hf_start:
                raise ValueError(f"source pieces of {hf_name} overlap without being replicas: "
                                 f"dim {a.dim} [{a.hf_start}, +{a.length}) and dim {b.dim} [{b.hf_start}, +{b.length})")
        index[hf_name] = ([g.hf_start for g in ordered], ordered)
    return index


def _runs(outer: int, inner: int, src_row: int, src_start: int, dst_row: int, dst_start: int, n: int):
    """Flat runs of rows ``[start, start+n)`` along the split dim of a tensor viewed as
    (outer, row, inner): one run per outer index, or one run in all when they are contiguous."""
    if outer == 1 or (n == src_row == dst_row):  # then src_start == dst_start == 0 for outer > 1
        return [(src_start * inner, dst_start * inner, outer * n * inner)]
    return [(o * src_row * inner + src_start * inner, o * dst_row * inner + dst_start * inner, n * inner)
            for o in range(outer)]


def _build(dims: ModelDims, src: TrainerTopology, dst: GeneratorTopology) -> SyncPlan:
    return _plan_layouts(src, dst, source_layouts(dims, src), destination_layouts(dims, dst))


def _plan_layouts(src: TrainerTopology, dst: GeneratorTopology, src_lay: Mapping[SrcRank, Mapping[str, ParamLayout]],
                  dst_lay: Mapping[DstRank, Mapping[str, ParamLayout]]) -> SyncPlan:
    """The reference plan over given layouts (split from :func:`_build` so tests can feed odd layouts)."""
    index = _index_sources(src_lay)
    load = {r: 0 for r in src_lay}
    # (src_rank, dst_rank) -> (hf_name, src_param, dst_param) -> list of (src_off, dst_off, n)
    raw: dict[tuple[SrcRank, DstRank], dict[tuple[str, str, str], list[tuple[int, int, int]]]] = {}
    for drank in sorted(dst_lay):
        for dparam, dlayout in dst_lay[drank].items():
            for piece in dlayout.pieces:
                if piece.hf_name not in index:
                    raise ValueError(f"no trainer rank holds {piece.hf_name} (needed by {drank} {dparam})")
                starts, groups = index[piece.hf_name]
                lo, hi = piece.hf_start, piece.hf_start + piece.length
                shape = piece.hf_shape
                outer, inner = math.prod(shape[:piece.dim]), math.prod(shape[piece.dim + 1:])
                covered = 0
                i = max(0, bisect.bisect_right(starts, lo) - 1)
                while i < len(groups) and groups[i].hf_start < hi:
                    g = groups[i]
                    i += 1
                    a, b = max(lo, g.hf_start), min(hi, g.hf_start + g.length)
                    if a >= b:
                        continue
                    if g.dim != piece.dim:
                        raise ValueError(f"{piece.hf_name}: source split on dim {g.dim}, destination on dim "
                                         f"{piece.dim}; mixed-dim planning is not implemented")
                    covered += b - a
                    srank, sparam, s_local, s_shape = min(g.holders, key=lambda h: (load[h[0]], h[0]))
                    load[srank] += (b - a) * outer * inner
                    runs = _runs(outer, inner, s_shape[g.dim], s_local + a - g.hf_start,
                                 dlayout.local_shape[piece.dim], piece.local_start + a - piece.hf_start, b - a)
                    raw.setdefault((srank, drank), {}).setdefault((piece.hf_name, sparam, dparam), []).extend(runs)
                if covered != piece.length:
                    raise ValueError(f"{drank} {dparam}: {piece.hf_name} rows [{lo}, {hi}) are covered "
                                     f"{covered}/{piece.length} by the trainer's pieces")
    pairs = {}
    for pair in sorted(raw):
        copies = []
        for (hf_name, sparam, dparam), runs in raw[pair].items():
            runs.sort()
            s, d, n = merge_contiguous_runs_ref(*zip(*runs))
            copies.extend(Copy(hf_name, sparam, so, dparam, do, k)
                          for so, do, k in zip(s.tolist(), d.tolist(), n.tolist()))
        pairs[pair] = tuple(copies)
    return SyncPlan(src, dst, MappingProxyType(pairs), local_shapes(src_lay), local_shapes(dst_lay))


IMPLS = ("auto", "native", "ref")


def plan_sync(dims: ModelDims, src: TrainerTopology, dst: GeneratorTopology, impl: str = "auto") -> SyncPlan:
    """The (cached) copy plan from a trainer topology to a generator topology; see module docstring.

    ``impl``: ``"ref"`` this module's Python planner, ``"native"`` the C++ one (csrc/plan.cpp; the
    same plan, copy for copy), ``"auto"`` native when the extension has it, else ref."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        impl = "native" if plan_native.available() else "ref"
    return _plan_cached(dims, src, dst, impl)  # key on the resolved impl: "auto" shares its entry


@functools.lru_cache(maxsize=32)
def _plan_cached(dims: ModelDims, src: TrainerTopology, dst: GeneratorTopology, impl: str) -> SyncPlan:
    if impl == "ref":
        return _build(dims, src, dst)
    return plan_native.plan_layouts_native(src, dst, source_layouts(dims, src), destination_layouts(dims, dst))


def execute_plan_ref(plan: SyncPlan, src_tensors: Mapping[SrcRank, Mapping[str, torch.Tensor]],
                     dst_tensors: Mapping[DstRank, Mapping[str, torch.Tensor]]) -> None:
    """Run every copy in-process (reference executor; contiguous tensors, any dtypes)."""
    for (s, d), copies in plan.pairs.items():
        for c in copies:
            src_flat = src_tensors[s][c.src_param].view(-1)
            dst_flat = dst_tensors[d][c.dst_param].view(-1)
            dst_flat[c.dst_offset:c.dst_offset + c.numel].copy_(src_flat[c.src_offset:c.src_offset + c.numel])


__all__ = ["Copy", "SyncPlan", "plan_sync", "execute_plan_ref"]
