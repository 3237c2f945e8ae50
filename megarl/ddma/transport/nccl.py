"""The ``nccl`` transport (any host, CUDA): rounds of batched isend/irecv per planned pair, under a
memory budget, over a DDMA process group of its own.

The group: trainer ranks first (sorted ``SrcRank``), then generator workers (sorted ``DstRank``),
built once per sync spec directly on the rendezvous store (``ProcessGroupNCCL`` on CUDA; never the
trainer's WORLD nor vLLM's). On CPU the very same code runs over a gloo group, which is how the test
suite checks its logic (tests/test_ddma_transport.py): over gloo as it is (no coalescing: one Work per
op), and over ``CoalescingGlooDouble`` (tests/test_ddma_sync.py), a stand-in with the signatures and
the coalescing contract of NCCL's c10d ``Backend``, so the branch NCCL takes runs on CPU as well.

Schedule, computed alike on every rank from the plan (nothing travels but the bytes):

- each worker's parameters (vLLM order) are cut into **groups** of at most ``spec.bucket_bytes`` of
  engine-dtype staging (a larger parameter is a group of its own);
- for one (sender, worker) pair and one group, the **stream** is the concatenation, parameter by
  parameter, of the pair's copies (raw wire bytes; FP8: the e4m3 codes, then the float32 row scales
  those copies need);
- the stream moves in **chunks** of at most ``bucket_bytes``: round ``(group, chunk)`` posts one isend
  (sender) or irecv (worker) per pair that has that chunk, all at once (one NCCL group), then waits.
  Every op of round r is matched by its peer's op of round r, and every rank posts its rounds in
  the same order, so the schedule cannot deadlock.

Memory budget (``sync.bucket_mb``): a sender holds at most ``bucket_bytes`` of packed chunk per
worker it feeds in a round; a worker holds one group's staging tensors (at most ``bucket_bytes``
unless one parameter is larger), one chunk per sender, and for FP8 one parameter's codes and scales
per sender. The worker yields a group's parameters after its last round.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from datetime import timedelta

import torch

from megarl.ddma.layouts import vllm_param_layouts
from megarl.ddma.transport.base import Transport, engine_dtype, gloo_group, group_prefix, is_fp8, land_fp8, rows_of

# Builds the group for host tensors: (store, rank, size, timeout_s, prefix=...) -> a c10d Backend. gloo;
# the tests swap in a coalescing stand-in for NCCL's Backend (tests/test_ddma_sync.py CoalescingGlooDouble).
HOST_GROUP = gloo_group


@dataclasses.dataclass(frozen=True)
class Seg:
    """``nbytes`` bytes of a pair's stream: from the sender's ``src`` tensor (a wire tensor, or its
    scales for ``kind='scales'``) at ``src_byte``, to the worker's staging of ``dparam`` at
    ``dst_byte`` (``kind='data'``) or its FP8 message buffer for ``dparam`` (``'codes'``/``'scales'``)."""

    dparam: str
    kind: str
    src: str
    src_byte: int
    dst_byte: int
    nbytes: int


def param_groups(layouts, itemsize: int, budget: int) -> list[list[str]]:
    """A worker's parameters (``layouts`` order) cut into groups of at most ``budget`` staging bytes."""
    groups: list[list[str]] = []
    used = 0
    for name, layout in layouts.items():
        nbytes = math.prod(layout.local_shape) * itemsize
        if not groups or used + nbytes > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    return groups


def pair_streams(plan, spec, s, d, groups: list[list[str]]) -> list[list[Seg]]:
    """Per group, the segments of the (sender ``s``, worker ``d``) stream, in stream order."""
    by_param: dict[str, list] = collections.defaultdict(list)
    for c in plan.pairs.get((s, d), ()):
        by_param[c.dst_param].append(c)
    es = engine_dtype(spec).itemsize
    out = []
    for group in groups:
        segs: list[Seg] = []
        for p in group:
            copies = by_param.get(p)
            if not copies:
                continue
            shape = tuple(plan.src_shapes[s][copies[0].src_param])
            if not is_fp8(spec, shape):
                segs += [Seg(p, "data", c.src_param, c.src_offset * es, c.dst_offset * es, c.numel * es) for c in copies]
                continue
            off = 0
            for c in copies:  # codes, one byte per element, packed in copy order
                segs.append(Seg(p, "codes", c.src_param, c.src_offset, off, c.numel))
                off += c.numel
            off = -(-off // 4) * 4  # the scales start 4-byte aligned in the worker's message buffer
            for c in copies:  # then each copy's span of float32 row scales
                a, b = rows_of(c, shape[1])
                segs.append(Seg(p, "scales", c.src_param, 4 * a, off, 4 * (b - a)))
                off += 4 * (b - a)
        out.append(segs)
    return out


def chunk_segments(segs: list[Seg], start: int, end: int):
    """The parts of ``segs`` inside stream bytes ``[start, end)``: ``(seg, first byte in seg, n)``."""
    pos = 0
    for seg in segs:
        lo, hi = max(start, pos), min(end, pos + seg.nbytes)
        if lo < hi:
            yield seg, lo - pos, hi - lo
        pos += seg.nbytes
        if pos >= end:
            break


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class NcclTransport(Transport):
    name, moves = "nccl", "cuda"

    def __init__(self, side):
        super().__init__(side)
        self._pg = None
        self._groups: dict = {}
        self._streams: dict = {}
        self.rounds = 0  # rounds this side took part in during the last sync (tests read it)

    def check_wire(self, wire) -> None:
        pass  # CUDA in production; host tensors run the same code over gloo (the CPU tests)

    def stats(self) -> dict:
        return {"rounds": self.rounds}

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

    @staticmethod
    def _round(pg, ops: list[tuple[str, torch.Tensor, int]]) -> None:
        """Post one round's ops (``("send" | "recv", tensor, group peer)``) and return once they are
        complete in stream order. A backend that coalesces (NCCL: ``supports_coalescing``) takes the
        c10d ``Backend`` binding's sequence: ``_start_coalescing()`` (no argument: the device form is
        ``ProcessGroup``'s), the ops (which then return no Work), and the one Work of the batch from
        ``_end_coalescing()``. A backend that does not (gloo) takes plain async ops, one Work each --
        the two branches of torch's own ``batch_isend_irecv``."""
        if pg.supports_coalescing:
            pg._start_coalescing()
            try:
                for op, t, peer in ops:
                    getattr(pg, op)([t], peer, 0)
            finally:
                work = pg._end_coalescing()
            works = [work]
        else:
            works = [getattr(pg, op)([t], peer, 0) for op, t, peer in ops]
        for w in works:
            w.wait()

    @staticmethod
    def _complete(device: torch.device) -> None:
        """Block until the rounds so far are done. ``Work.wait()`` on NCCL only makes the current stream
        wait for NCCL's (it returns before the bytes moved), so without this a sender's ``transfer_s``
        would time the enqueueing; host ops are complete when ``wait()`` returns."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def groups(self, d) -> list[list[str]]:
        if d not in self._groups:
            spec = self.spec
            layouts = vllm_param_layouts(spec.dims, spec.dst.tp, d.tp, spec.dst.vocab_padding)
            self._groups[d] = param_groups(layouts, engine_dtype(spec).itemsize, spec.bucket_bytes)
        return self._groups[d]

    def streams(self, s, d) -> list[list[Seg]]:
        if (s, d) not in self._streams:
            self._streams[(s, d)] = pair_streams(self.side.plan, self.spec, s, d, self.groups(d))
        return self._streams[(s, d)]

    @staticmethod
    def _chunks(segs: list[Seg], budget: int) -> int:
        return -(-sum(g.nbytes for g in segs) // budget)

    # -- sender ---------------------------------------------------------------------------------
    def send(self, version, wire, scales) -> int:
        side, budget = self.side, self.spec.bucket_bytes
        device = next(iter(wire.values())).device if wire else torch.device("cpu")
        pg = self.pg(device)
        src_bytes = {("data", n): _bytes(t) for n, t in wire.items()}
        src_bytes.update({("codes", n): _bytes(t) for n, t in wire.items()})
        src_bytes.update({("scales", n): _bytes(t) for n, t in scales.items()})
        dsts = [d for d in side.dst_ranks if side.plan.pairs.get((side.rank, d))]
        n_groups = max((len(self.groups(d)) for d in dsts), default=0)
        peak, self.rounds = 0, 0
        for g in range(n_groups):
            streams = {d: self.streams(side.rank, d)[g] for d in dsts if g < len(self.groups(d))}
            n_chunks = {d: self._chunks(segs, budget) for d, segs in streams.items()}
            for j in range(max(n_chunks.values(), default=0)):
                msgs = []
                for d, segs in streams.items():
                    if j < n_chunks[d]:
                        parts = [src_bytes[(seg.kind, seg.src)][seg.src_byte + a:seg.src_byte + a + n]
                                 for seg, a, n in chunk_segments(segs, j * budget, (j + 1) * budget)]
                        msgs.append((d, torch.cat(parts)))
                if not msgs:
                    continue
                self._round(pg, [("send", m, side.group_rank(d)) for d, m in msgs])
                self.rounds += 1
                peak = max(peak, sum(m.numel() for _, m in msgs))
        self._complete(device)  # the sync's transfer_s ends when the bytes have moved
        return peak

    # -- receiver -------------------------------------------------------------------------------
    def receive_params(self, version):
        side, spec, budget = self.side, self.spec, self.spec.bucket_bytes
        dtype, device = engine_dtype(spec), side.device
        pg = self.pg(device)
        srcs = [s for s in side.src_ranks if side.plan.pairs.get((s, side.rank))]
        self.rounds = 0
        for g, group in enumerate(self.groups(side.rank)):
            staging, elements = {}, {}
            for p in group:
                shape = side.layouts[p].local_shape
                elements[p] = sum(c.numel for _, cs in side.incoming[p] for c in cs)
                alloc = torch.zeros if elements[p] < math.prod(shape) else torch.empty  # vocab padding
                staging[p] = alloc(shape, dtype=dtype, device=device)
            held = sum(t.numel() * t.element_size() for t in staging.values())
            streams = {s: self.streams(s, side.rank)[g] for s in srcs}
            n_chunks = {s: self._chunks(segs, budget) for s, segs in streams.items()}
            # FP8: one message buffer per (sender, parameter), landed once all its bytes are in
            msg_size, left = collections.Counter(), collections.Counter()
            for s, segs in streams.items():
                for seg in segs:
                    if seg.kind != "data":
                        k = (s, seg.dparam)
                        msg_size[k] = max(msg_size[k], seg.dst_byte + seg.nbytes)
                        left[k] += seg.nbytes
            msg_buf = {k: torch.empty(n, dtype=torch.uint8, device=device) for k, n in msg_size.items()}
            held += sum(msg_size.values())
            peak_chunks = 0
            for j in range(max(n_chunks.values(), default=0)):
                bufs = []
                for s, segs in streams.items():
                    if j < n_chunks[s]:
                        total = sum(x.nbytes for x in segs)
                        bufs.append((s, torch.empty(min(budget, total - j * budget), dtype=torch.uint8, device=device)))
                if not bufs:
                    continue
                self._round(pg, [("recv", b, side.group_rank(s)) for s, b in bufs])
                self.rounds += 1
                peak_chunks = max(peak_chunks, sum(b.numel() for _, b in bufs))
                for s, buf in bufs:
                    pos = 0
                    for seg, a, n in chunk_segments(streams[s], j * budget, (j + 1) * budget):
                        if seg.kind == "data":
                            _bytes(staging[seg.dparam])[seg.dst_byte + a:seg.dst_byte + a + n].copy_(buf[pos:pos + n])
                        else:
                            k = (s, seg.dparam)
                            msg_buf[k][seg.dst_byte + a:seg.dst_byte + a + n].copy_(buf[pos:pos + n])
                            left[k] -= n
                            if left[k] == 0:
                                held += self._land_fp8(staging[seg.dparam], s, seg.dparam, msg_buf.pop(k))
                        pos += n
            held += peak_chunks
            self._complete(device)  # the group's bytes have landed (the receiver times the transfer)
            for p in group:
                yield p, staging.pop(p), held, elements[p]

    def _land_fp8(self, staging: torch.Tensor, s, dparam: str, msg: torch.Tensor) -> int:
        copies = next(cs for src, cs in self.side.incoming[dparam] if src == s)
        cols = self.side.plan.src_shapes[s][copies[0].src_param][1]
        n = sum(c.numel for c in copies)
        return land_fp8(staging.view(-1), copies, cols, msg[:n], msg[-(-n // 4) * 4:].view(torch.float32))


__all__ = ["NcclTransport", "HOST_GROUP", "Seg", "param_groups", "pair_streams", "chunk_segments"]
