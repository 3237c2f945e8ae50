"""The ``nccl`` transport (any host, CUDA): the bucket schedule of :mod:`.buckets` (rounds of batched
isend/irecv per planned pair under a memory budget, two rounds in flight) over a DDMA process group of
its own.

The group: trainer ranks first (sorted ``SrcRank``), then generator workers (sorted ``DstRank``),
built once per sync spec directly on the rendezvous store (``ProcessGroupNCCL`` on CUDA; never the
trainer's WORLD nor vLLM's). On CPU the very same code runs over a gloo group, which is how the test
suite checks its logic (tests/e2e/test_ddma_transport.py): over gloo as it is (no coalescing: one Work per
op), and over ``CoalescingGlooDouble`` (tests/e2e/test_ddma_sync.py), a stand-in with the signatures and
the coalescing contract of NCCL's c10d ``Backend``, so the branch NCCL takes runs on CPU as well.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from megarl.ddma.transport.base import gloo_group, group_prefix
from megarl.ddma.transport.buckets import BucketedTransport, Seg, chunk_segments, pair_streams, param_groups

# Builds the group for host tensors: (store, rank, size, timeout_s, prefix=...) -> a c10d Backend. gloo;
# the tests swap in a coalescing stand-in for NCCL's Backend (tests/e2e/test_ddma_sync.py CoalescingGlooDouble).
HOST_GROUP = gloo_group


class NcclTransport(BucketedTransport):
    name, moves = "nccl", "cuda"

    def check_wire(self, wire) -> None:
        pass  # CUDA in production; host tensors run the same code over gloo (the CPU tests)

    def pg(self, device: torch.device):
        """DDMA's own group, created once: NCCL for CUDA tensors, gloo for host tensors (``HOST_GROUP``).

        Every rank of the group calls this at the start of each sync, also a rank with no pairs (a
        trainer rank that sends nothing, a worker that receives nothing), and joins the communicator
        here: a batched round creates NCCL's communicator lazily, as a collective of *all* the group's
        ranks (torch's ``batch_isend_irecv`` note), so a rank that never posts a round would leave the
        others in ``ncclCommInitRank`` until the timeout. ``eager_connect_single_device`` (a c10d
        ``Backend`` method) creates it now, under the key the batched rounds use (the device); gloo
        connects every pair in its constructor and takes the call as a no-op. Each group has a store
        prefix of its own (:func:`~megarl.ddma.transport.base.group_prefix`)."""
        if self._pg is None:
            side = self.side
            rank, size = side.group_rank(side.rank), len(side.src_ranks) + len(side.dst_ranks)
            if device.type == "cuda":
                from torch.distributed.distributed_c10d import ProcessGroupNCCL

                if device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_device(device)  # batch_isend_irecv's note: NCCL p2p needs the current device set
                opts = ProcessGroupNCCL.Options()
                opts._timeout = timedelta(seconds=self.spec.timeout_s)
                prefix = group_prefix(side.store, "ddma/nccl", rank)
                pg = ProcessGroupNCCL(torch.distributed.PrefixStore(prefix, side.store), rank, size, opts)
            else:
                pg = HOST_GROUP(side.store, rank, size, self.spec.timeout_s, prefix="ddma/nccl-on-gloo")
            pg.eager_connect_single_device(device)
            self._pg = pg
        return self._pg


__all__ = ["NcclTransport", "HOST_GROUP", "Seg", "param_groups", "pair_streams", "chunk_segments"]
