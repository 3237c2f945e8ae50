"""The bucket schedule both point-to-point transports run (``gloo`` on host memory, ``nccl`` on CUDA and,
for the CPU tests, over gloo): buckets of planned runs, not one message per parameter.

Schedule, computed alike on every rank from the plan (nothing travels but the bytes):

- each worker's parameters (vLLM order) are cut into **groups** of at most ``spec.bucket_bytes`` of
  engine-dtype staging (a larger parameter is a group of its own);
- for one (sender, worker) pair and one group, the **stream** is the concatenation, parameter by
  parameter, of the pair's copies (raw wire bytes; FP8: the e4m3 codes, then the float32 row scales
  those copies need);
- the stream moves in **chunks** of at most ``bucket_bytes / IN_FLIGHT`` bytes: round ``(group, chunk)``
  posts one send (sender) or recv (worker) per pair that has that chunk, all at once (one NCCL group
  where the backend coalesces), every rank in the same order, so the schedule cannot deadlock.
- **Overlap**: a rank keeps up to :data:`IN_FLIGHT` rounds posted. A sender packs round r+1 while round r
  moves; a worker posts round r+1's receives before it lands round r. On host memory packing and
  landing are one C++ memcpy per planned run (``copy_runs``, GIL released, so they overlap the backend's
  own threads), from run tables computed once per topology. On CUDA they are one strided copy per block
  (``_Runs.blocks``: runs of one length at constant strides fold into one, so a dim-1 shard's rows, one run
  each, take one launch per chunk, not one per row), in the widest word the block allows.

Memory budget (``sync.bucket_mb``): a sender holds at most ``bucket_bytes`` of packed chunks per worker
it feeds (:data:`IN_FLIGHT` chunks of half that); a worker holds one group's staging tensors (at most
``bucket_bytes`` unless one parameter is larger), ``bucket_bytes`` of chunks per sender, and for FP8 one
parameter's codes and scales per sender. The worker yields a group's parameters after its last round.

Messages: one per (pair, round), ``ceil(stream bytes / chunk)`` per pair and group -- what
``megarl plan-sync`` reports (:func:`pair_messages`) and the simulator charges per-message latency for.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from megarl.ddma.bucket_model import IN_FLIGHT, chunk_bytes
from megarl.ddma.layouts import vllm_param_layouts
from megarl.ddma.runs import copy_blocks, copy_byte_blocks
from megarl.ddma.transport.base import Transport, engine_dtype, is_fp8, land_fp8, packed_fp8_blocks, rows_of
from megarl.ddma.transport.zero_copy import copy_runs


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


def pair_messages(plan, spec) -> dict:
    """``{(src, dst): (messages, bytes)}`` of one sync under this schedule (every pair with copies)."""
    out = {}
    chunk = chunk_bytes(spec.bucket_bytes)
    es = engine_dtype(spec).itemsize
    groups = {d: param_groups(vllm_param_layouts(spec.dims, spec.dst.tp, d.tp, spec.dst.vocab_padding), es,
                              spec.bucket_bytes) for d in {d for _, d in plan.pairs}}
    for (s, d), copies in plan.pairs.items():
        if not copies:
            continue
        sizes = [sum(g.nbytes for g in segs) for segs in pair_streams(plan, spec, s, d, groups[d])]
        out[(s, d)] = (sum(-(-n // chunk) for n in sizes), sum(sizes))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Runs:
    """One chunk of one pair as memcpy runs, computed once: per run its tensor (an index into ``keys``),
    byte offset there, offset in the chunk buffer, and length; ``other`` keeps the FP8 parts a worker
    gathers per parameter (``(engine param, byte offset in its message, offset in chunk, n)``, consecutive
    contiguous parts merged: a dim-1 shard's codes come one run per row)."""

    def __init__(self, parts, key_of, sender: bool):
        self.sender, self._blocks = sender, None
        self.keys: list = []
        index: dict = {}
        kid, off, pos_l, n_l, self.other = [], [], [], [], []
        pos = 0
        for seg, a, n in parts:
            k = key_of(seg)
            if k is None:  # consecutive parts of one parameter's message, contiguous on both sides: one copy
                dst = seg.dst_byte + a
                last = self.other[-1] if self.other else None
                if last and last[0] == seg.dparam and last[1] + last[3] == dst and last[2] + last[3] == pos:
                    self.other[-1] = (seg.dparam, last[1], last[2], last[3] + n)
                else:
                    self.other.append((seg.dparam, dst, pos, n))
            else:
                kid.append(index.setdefault(k, len(index)))
                off.append((seg.src_byte if sender else seg.dst_byte) + a)
                pos_l.append(pos)
                n_l.append(n)
            pos += n
        self.keys = list(index)
        self.total = pos
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        self.kid, self.off, self.pos, self.n = as_t(kid), as_t(off), as_t(pos_l), as_t(n_l)

    def blocks(self) -> list[tuple[int, tuple]]:
        """The runs folded into strided blocks (:func:`megarl.ddma.runs.copy_blocks`, in bytes), per tensor:
        ``[(key index, blocks)]``, computed once. Source side: the tensor (sender) or the chunk buffer
        (worker). A dim-1 shard's rows, one run each, fold into one block per (tensor, chunk)."""
        if self._blocks is None:
            by_key: dict[int, list] = collections.defaultdict(lambda: ([], [], []))
            for k, o, p, n in zip(self.kid.tolist(), self.off.tolist(), self.pos.tolist(), self.n.tolist()):
                src, dst, lens = by_key[k]
                src.append(o if self.sender else p)
                dst.append(p if self.sender else o)
                lens.append(n)
            self._blocks = [(k, copy_blocks(*cols)) for k, cols in by_key.items()]
        return self._blocks

    def addresses(self, ptr_of) -> torch.Tensor:
        """Absolute addresses of every run (its tensor's address now + its offset)."""
        ptrs = torch.tensor([ptr_of(k) for k in self.keys], dtype=torch.int64)
        return ptrs[self.kid] + self.off if self.keys else self.off


class BucketedTransport(Transport):
    """The schedule of the module docstring; a subclass gives the group (:meth:`pg`)."""

    host_memcpy = True  # host memory: pack and land with one C++ memcpy per run (copy_runs). False: the
                        # device path (strided copies of folded blocks) on host tensors too: the CPU tests

    def __init__(self, side):
        super().__init__(side)
        self._pg = None
        self._groups: dict = {}
        self._streams: dict = {}
        self._runs: dict = {}
        self._pool: dict = {}  # (peer, slot) -> a message buffer, reused by every round and sync (host)
        self.copies = 0  # torch copies of the last sync: the device path's blocks, and FP8 message parts
        self.rounds = 0  # rounds this side took part in during the last sync (tests read it)
        self.messages = 0  # messages it sent or received then
        self.message_bytes = 0

    def pg(self, device: torch.device):
        raise NotImplementedError

    def stats(self) -> dict:
        return {**super().stats(), "rounds": self.rounds, "messages": self.messages, "copies": self.copies,
                "bytes_per_message": self.message_bytes // max(1, self.messages)}

    @staticmethod
    def _post(pg, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """Post one round's ops (``("send" | "recv", tensor, group peer)``); returns its Works. A backend
        that coalesces (NCCL: ``supports_coalescing``) takes the c10d ``Backend`` binding's sequence:
        ``_start_coalescing()`` (no argument: the device form is ``ProcessGroup``'s), the ops (which then
        return no Work), and the one Work of the batch from ``_end_coalescing()``. A backend that does not
        (gloo) takes plain async ops, one Work each -- the two branches of torch's ``batch_isend_irecv``."""
        if pg.supports_coalescing:
            pg._start_coalescing()
            try:
                for op, t, peer in ops:
                    getattr(pg, op)([t], peer, 0)
            finally:
                work = pg._end_coalescing()
            return [work]
        return [getattr(pg, op)([t], peer, 0) for op, t, peer in ops]

    @classmethod
    def _round(cls, pg, ops: list[tuple[str, torch.Tensor, int]]) -> None:
        """Post one round and return once it is complete."""
        for w in cls._post(pg, ops):
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
            layouts = self.side.dst_layouts(d)  # a partial sync (spec.skip): the parameters it lands
            self._groups[d] = param_groups(layouts, engine_dtype(spec).itemsize, spec.bucket_bytes)
        return self._groups[d]

    def streams(self, s, d) -> list[list[Seg]]:
        if (s, d) not in self._streams:
            self._streams[(s, d)] = pair_streams(self.side.plan, self.spec, s, d, self.groups(d))
        return self._streams[(s, d)]

    def _chunk_runs(self, s, d, g: int, j: int, side: str) -> _Runs:
        k = (s, d, g, j, side)
        if k not in self._runs:
            chunk = chunk_bytes(self.spec.bucket_bytes)
            parts = chunk_segments(self.streams(s, d)[g], j * chunk, (j + 1) * chunk)
            if side == "src":  # from a wire tensor (data, FP8 codes) or its scales
                self._runs[k] = _Runs(parts, lambda seg: ("scales" if seg.kind == "scales" else "wire", seg.src), True)
            else:  # into a staging tensor; FP8 parts go to their parameter's message buffer
                self._runs[k] = _Runs(parts, lambda seg: seg.dparam if seg.kind == "data" else None, False)
        return self._runs[k]

    @staticmethod
    def _n_chunks(segs: list[Seg], chunk: int) -> int:
        return -(-sum(g.nbytes for g in segs) // chunk)

    def _buffer(self, peer, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A message buffer for ``peer``'s round slot (round % IN_FLIGHT): on host memory one kept buffer per
        (peer, slot), so rounds and syncs do not fault in fresh pages (at most ``bucket_bytes`` per peer,
        held between syncs); on CUDA a new tensor (the caching allocator keeps its own)."""
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        buf = self._pool.get((peer, slot))
        if buf is None or buf.numel() < nbytes:
            buf = self._pool[(peer, slot)] = torch.empty(max(nbytes, chunk_bytes(self.spec.bucket_bytes)),
                                                         dtype=torch.uint8)
        return buf[:nbytes]

    # -- sender ---------------------------------------------------------------------------------
    def _pack(self, runs: _Runs, src_bytes: dict, device: torch.device, peer, slot: int) -> torch.Tensor:
        buf = self._buffer(peer, slot, runs.total, device)
        if device.type == "cpu" and self.host_memcpy:
            copy_runs(runs.addresses(lambda k: src_bytes[k].data_ptr()), runs.pos + buf.data_ptr(), runs.n)
            return buf
        for i, blocks in runs.blocks():  # one launch per block, not per run (a dim-1 shard: one per row)
            self.copies += copy_byte_blocks(buf, src_bytes[runs.keys[i]], blocks)
        return buf

    def send(self, version, wire, scales) -> int:
        side, chunk = self.side, chunk_bytes(self.spec.bucket_bytes)
        device = next(iter(wire.values())).device if wire else torch.device("cpu")
        pg = self.pg(device)
        src_bytes = {("wire", n): _bytes(t) for n, t in wire.items()}
        src_bytes.update({("scales", n): _bytes(t) for n, t in scales.items()})
        dsts = [d for d in side.dst_ranks if side.plan.pairs.get((side.rank, d))]
        n_groups = max((len(self.groups(d)) for d in dsts), default=0)
        peak = held = 0
        self.rounds = self.messages = self.message_bytes = self.copies = 0
        inflight: collections.deque = collections.deque()
        for g in range(n_groups):
            streams = {d: self.streams(side.rank, d)[g] for d in dsts if g < len(self.groups(d))}
            n_chunks = {d: self._n_chunks(segs, chunk) for d, segs in streams.items()}
            for j in range(max(n_chunks.values(), default=0)):
                while len(inflight) >= IN_FLIGHT:  # its buffers are free again once a round is done
                    held -= self._finish(inflight.popleft())
                slot = self.rounds % IN_FLIGHT  # the round this one replaces in flight has completed
                msgs = [(d, self._pack(self._chunk_runs(side.rank, d, g, j, "src"), src_bytes, device, d, slot))
                        for d in streams if j < n_chunks[d]]
                if not msgs:
                    continue
                nbytes = sum(m.numel() for _, m in msgs)
                inflight.append((self._post(pg, [("send", m, side.group_rank(d)) for d, m in msgs]), msgs, nbytes))
                held += nbytes
                peak = max(peak, held)
                self.rounds += 1
                self.messages += len(msgs)
                self.message_bytes += nbytes
        while inflight:
            held -= self._finish(inflight.popleft())
        self._complete(device)  # the sync's transfer_s ends when the bytes have moved
        return peak

    @staticmethod
    def _finish(item) -> int:
        works, _, nbytes = item
        for w in works:
            w.wait()
        return nbytes

    # -- receiver -------------------------------------------------------------------------------
    def receive_params(self, version):
        side, spec, chunk = self.side, self.spec, chunk_bytes(self.spec.bucket_bytes)
        dtype, device = engine_dtype(spec), side.device
        pg = self.pg(device)
        srcs = [s for s in side.src_ranks if side.plan.pairs.get((s, side.rank))]
        order = {p: (shape, alloc, n) for p, shape, alloc, n, _ in self._receive_order()}
        self.rounds = self.messages = self.message_bytes = self.copies = 0
        for g, group in enumerate(self.groups(side.rank)):
            staging, elements = {}, {}
            for p in group:  # shape, allocator (zeros where vocab padding gets no bytes), count: once per plan
                shape, alloc, elements[p] = order[p]
                staging[p] = alloc(shape, dtype=dtype, device=device)
            held = sum(t.numel() * t.element_size() for t in staging.values())
            streams = {s: self.streams(s, side.rank)[g] for s in srcs}
            n_chunks = {s: self._n_chunks(segs, chunk) for s, segs in streams.items()}
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
            rounds = max(n_chunks.values(), default=0)
            pending: collections.deque = collections.deque()
            posted = chunk_held = peak_chunks = 0
            for _ in range(rounds):
                while posted < rounds and len(pending) < IN_FLIGHT:  # post ahead, then land the oldest
                    slot = (self.rounds + len(pending)) % IN_FLIGHT  # not the slot of a round still pending
                    bufs = [(s, self._buffer(s, slot, self._chunk_runs(s, side.rank, g, posted, "dst").total, device))
                            for s in streams if posted < n_chunks[s]]
                    pending.append((posted, self._post(pg, [("recv", b, side.group_rank(s)) for s, b in bufs]), bufs))
                    chunk_held += sum(b.numel() for _, b in bufs)
                    peak_chunks = max(peak_chunks, chunk_held)
                    posted += 1
                j, works, bufs = pending.popleft()
                for w in works:
                    w.wait()
                self.rounds += 1
                self.messages += len(bufs)
                for s, buf in bufs:
                    self.message_bytes += buf.numel()
                    held += self._land_chunk(self._chunk_runs(s, side.rank, g, j, "dst"), buf, staging, s, msg_buf, left)
                    chunk_held -= buf.numel()
                del bufs
            held += peak_chunks
            self._complete(device)  # the group's bytes have landed (the receiver times the transfer)
            for p in group:
                yield p, staging.pop(p), held, elements[p]

    def _land_chunk(self, runs: _Runs, buf: torch.Tensor, staging: dict, s, msg_buf: dict, left) -> int:
        """Copy one received chunk's runs into the staging tensors (and FP8 message buffers); returns
        scratch bytes of any FP8 parameter it completed."""
        if runs.keys:
            if buf.device.type == "cpu" and self.host_memcpy:
                copy_runs(runs.pos + buf.data_ptr(), runs.addresses(lambda p: staging[p].data_ptr()), runs.n)
            else:
                for i, blocks in runs.blocks():
                    self.copies += copy_byte_blocks(_bytes(staging[runs.keys[i]]), buf, blocks)
        extra = 0
        for dparam, dst, pos, n in runs.other:
            k = (s, dparam)
            msg_buf[k][dst:dst + n].copy_(buf[pos:pos + n])
            self.copies += 1
            left[k] -= n
            if left[k] == 0:
                extra += self._land_fp8(staging[dparam], s, dparam, msg_buf.pop(k))
        return extra

    def _land_fp8(self, staging: torch.Tensor, s, dparam: str, msg: torch.Tensor) -> int:
        copies = next(cs for src, cs in self.side.incoming[dparam] if src == s)
        cols = self.side.plan.src_shapes[s][copies[0].src_param][1]
        n = sum(c.numel for c in copies)
        blocks = self.table(("fp8", s, dparam), lambda: packed_fp8_blocks(copies, cols))
        return land_fp8(staging.view(-1), copies, cols, msg[:n], msg[-(-n // 4) * 4:].view(torch.float32), blocks)


__all__ = ["BucketedTransport", "IN_FLIGHT", "Seg", "chunk_bytes", "param_groups", "pair_streams", "chunk_segments",
           "pair_messages"]
