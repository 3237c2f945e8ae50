"""What a DDMA plan is, shared by the Python reference planner (plan.py) and the C++ one's glue
(plan_native.py): the :class:`Copy` runs per (source rank, destination rank) pair, in a
:class:`SyncPlan` with the local shapes they index. Both planners build these, so neither imports
the other for them.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from megarl.ddma.layouts import DstRank, GeneratorTopology, SrcRank, TrainerTopology
from megarl.models.layouts import ParamLayout


@dataclasses.dataclass(frozen=True)
class Copy:
    """``dst[dst_param].view(-1)[dst_offset:dst_offset+numel] = src[src_param].view(-1)[src_offset:...]``."""

    hf_name: str
    src_param: str
    src_offset: int
    dst_param: str
    dst_offset: int
    numel: int


@dataclasses.dataclass(frozen=True, eq=False)
class SyncPlan:
    src: TrainerTopology
    dst: GeneratorTopology
    pairs: Mapping[tuple[SrcRank, DstRank], tuple[Copy, ...]]  # only pairs with at least one copy
    src_shapes: Mapping[SrcRank, Mapping[str, tuple[int, ...]]]
    dst_shapes: Mapping[DstRank, Mapping[str, tuple[int, ...]]]

    def elements_sent(self) -> dict[SrcRank, int]:
        out = {r: 0 for r in self.src_shapes}
        for (s, _), copies in self.pairs.items():
            out[s] += sum(c.numel for c in copies)
        return out

    def elements_received(self) -> dict[DstRank, int]:
        out = {r: 0 for r in self.dst_shapes}
        for (_, d), copies in self.pairs.items():
            out[d] += sum(c.numel for c in copies)
        return out

    def bytes_sent(self, bytes_per_element: int = 2) -> dict[SrcRank, int]:
        return {r: n * bytes_per_element for r, n in self.elements_sent().items()}

    def bytes_received(self, bytes_per_element: int = 2) -> dict[DstRank, int]:
        return {r: n * bytes_per_element for r, n in self.elements_received().items()}

    def messages_sent(self) -> dict[SrcRank, int]:
        """Peers each source rank sends to (one message per (src, dst) pair before bucketing)."""
        out = {r: 0 for r in self.src_shapes}
        for s, _ in self.pairs:
            out[s] += 1
        return out

    def messages_received(self) -> dict[DstRank, int]:
        out = {r: 0 for r in self.dst_shapes}
        for _, d in self.pairs:
            out[d] += 1
        return out

    def copies_sent(self) -> dict[SrcRank, int]:
        out = {r: 0 for r in self.src_shapes}
        for (s, _), copies in self.pairs.items():
            out[s] += len(copies)
        return out

    def num_copies(self) -> int:
        return sum(len(c) for c in self.pairs.values())

    def summary(self, bytes_per_element: int = 2) -> dict:
        sent, recv = self.bytes_sent(bytes_per_element), self.bytes_received(bytes_per_element)
        return {"pairs": len(self.pairs), "copies": self.num_copies(), "bytes_total": sum(sent.values()),
                "bytes_sent_max": max(sent.values(), default=0), "bytes_sent_min": min(sent.values(), default=0),
                "bytes_received_max": max(recv.values(), default=0),
                "messages_sent_max": max(self.messages_sent().values(), default=0),
                "messages_received_max": max(self.messages_received().values(), default=0)}


def local_shapes(lay: Mapping[object, Mapping[str, ParamLayout]]) -> Mapping[object, Mapping[str, tuple[int, ...]]]:
    """Every rank's ``{param: local_shape}`` (read-only), as :class:`SyncPlan` stores it."""
    return MappingProxyType(
        {r: MappingProxyType({n: l.local_shape for n, l in params.items()}) for r, params in lay.items()})


__all__ = ["Copy", "SyncPlan", "local_shapes"]
