"""The ``gloo`` transport (any host, host memory): the bucket schedule of :mod:`.buckets` over a gloo
group of DDMA's own -- buckets of planned runs (``sync.bucket_mb``), packed and landed by one C++ memcpy
per run, two rounds in flight, not one message per parameter.

A ``ProcessGroupGloo`` built on the rendezvous store (never the trainer's or vLLM's world; group ranks:
trainer ranks first, sorted ``SrcRank``, then generator workers, sorted ``DstRank``). gloo connects every
pair in its constructor. FP8 travels in the same stream as uint8 codes followed by the float32 row scales
the copies need.
"""

from __future__ import annotations

import torch

from megarl.ddma.transport.base import gloo_group
from megarl.ddma.transport.buckets import BucketedTransport


class GlooTransport(BucketedTransport):
    name, moves = "gloo", "cpu"

    def pg(self, device: torch.device | None = None):
        if self._pg is None:
            side = self.side
            self._pg = gloo_group(side.store, side.group_rank(side.rank), len(side.src_ranks) + len(side.dst_ranks),
                                  self.spec.timeout_s)
        return self._pg


__all__ = ["GlooTransport"]
