"""Glue between the DDMA layouts and the C++ planner (``megarl._C.plan_copies``, csrc/plan.cpp).

:func:`plan_layouts_native` flattens the layouts into int64 tables, calls C++ once, and turns the
answer back into the same :class:`~megarl.ddma.plan_types.SyncPlan` that the Python reference
(:func:`megarl.ddma.plan._plan_layouts`) builds, copy for copy.

Tables (the column order is csrc/plan.cpp's ``SrcCol`` / ``DstCol``): strings (HF names and local
parameter names) are interned to ids into one ``names`` list. Ranks are passed in sorted order, so a
rank's index is its ``SrcRank`` / ``DstRank`` order, which the C++ tie-breaks rely on. DP replicas
(and generator replicas) share one layout dict, so each distinct dict is flattened once
(``*_offsets`` is a CSR index over the piece rows, ``*_rank_layout`` maps every rank to its dict):
Python work stays proportional to the distinct layouts, not to the number of ranks. The answer
likewise lists each distinct copy once (most repeat across replicas) plus an index per plan position.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from megarl.ddma.layouts import DstRank, GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.plan_types import Copy, SyncPlan, local_shapes
from megarl.native import native_function
from megarl.models.layouts import ParamLayout

_FUNCTION = "plan_copies"


def available() -> bool:
    """Whether the built extension has the C++ planner."""
    return native_function(_FUNCTION) is not None


class _Names:
    """String -> id interning; ``names[id]`` is the string (one object, shared by every Copy)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []

    def __call__(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
        return i


def _flatten(ranks: Sequence, lay: Mapping, names: _Names, outer_inner: bool) -> tuple[torch.Tensor, ...]:
    """(pieces [N, cols], layout offsets [L+1], rank -> layout [R]) for ranks in the given order."""
    rows: list[int] = []
    offsets, rank_layout = [0], []
    seen: dict[int, int] = {}  # id(layout dict) -> layout index; the dicts live in `lay` meanwhile
    for rank in ranks:
        params: Mapping[str, ParamLayout] = lay[rank]
        k = seen.get(id(params))
        if k is None:
            k = seen[id(params)] = len(offsets) - 1
            for param, layout in params.items():
                pid = names(param)
                for p in layout.pieces:
                    rows += (pid, names(p.hf_name), p.dim, p.hf_start, p.length, p.local_start,
                             layout.local_shape[p.dim])
                    if outer_inner:
                        shape = p.hf_shape
                        outer = inner = 1
                        for s in shape[:p.dim]:
                            outer *= s
                        for s in shape[p.dim + 1:]:
                            inner *= s
                        rows += (outer, inner)
            offsets.append(len(rows))
        rank_layout.append(k)
    cols = 9 if outer_inner else 7
    pieces = torch.tensor(rows, dtype=torch.int64).reshape(-1, cols)
    offsets_t = torch.tensor(offsets, dtype=torch.int64) // cols
    return pieces, offsets_t, torch.tensor(rank_layout, dtype=torch.int64)


def plan_layouts_native(src: TrainerTopology, dst: GeneratorTopology,
                        src_lay: Mapping[SrcRank, Mapping[str, ParamLayout]],
                        dst_lay: Mapping[DstRank, Mapping[str, ParamLayout]]) -> SyncPlan:
    """The C++ plan over given layouts; equal to ``plan._plan_layouts`` (raises the same ValueErrors)."""
    plan_copies = native_function(_FUNCTION)
    if plan_copies is None:
        raise RuntimeError("megarl._C has no plan_copies (extension not built, or built from older sources); "
                           "rebuild with `pip install --no-build-isolation -e .` or use impl='ref'")
    names = _Names()
    src_ranks, dst_ranks = sorted(src_lay), sorted(dst_lay)
    src_tables = _flatten(src_ranks, src_lay, names, outer_inner=False)
    dst_tables = _flatten(dst_ranks, dst_lay, names, outer_inner=True)
    pair_rows, unique_rows, copy_index = plan_copies(names.names, [str(r) for r in dst_ranks], *src_tables,
                                                     *dst_tables)
    # Copies are immutable, and most repeat across replicas: one object per distinct copy.
    n = names.names
    unique = [Copy(n[h], n[sp], so, n[dp], do, k) for h, sp, so, dp, do, k in unique_rows.tolist()]
    index = copy_index.tolist()
    pairs, start = {}, 0
    for s, d, end in pair_rows.tolist():
        pairs[(src_ranks[s], dst_ranks[d])] = tuple(map(unique.__getitem__, index[start:end]))
        start = end
    return SyncPlan(src, dst, MappingProxyType(pairs), local_shapes(src_lay), local_shapes(dst_lay))


__all__ = ["available", "plan_layouts_native"]
