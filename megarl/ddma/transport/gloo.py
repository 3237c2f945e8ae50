"""The ``gloo`` transport (any host, host memory): today's p2p path, unchanged.

A ``ProcessGroupGloo`` of DDMA's own, built on the rendezvous store (never the trainer's or vLLM's
world; group ranks: trainer ranks first, sorted ``SrcRank``, then generator workers, sorted
``DstRank``). Each sender sends one message per (destination, parameter) in one global order
(destination rank, then the parameter order), with at most ``spec.window`` messages in flight, so
its pack buffers stay bounded and no pair waits on another. FP8 travels as uint8 codes followed by
a second message with the float32 row scales the copies need.
"""

from __future__ import annotations

import collections

import torch

from megarl.ddma.transport.base import Transport, gloo_group, is_fp8, land_fp8, rows_of


class GlooTransport(Transport):
    name, moves = "gloo", "cpu"

    def __init__(self, side):
        super().__init__(side)
        self._pg = None

    def pg(self):
        if self._pg is None:
            side = self.side
            self._pg = gloo_group(side.store, side.group_rank(side.rank), len(side.src_ranks) + len(side.dst_ranks),
                                  self.spec.timeout_s)
        return self._pg

    def send(self, version, wire, scales) -> int:
        side, pg = self.side, self.pg()
        inflight: collections.deque = collections.deque()
        held = peak = 0
        for d, _, copies in side.outgoing:
            parts = [wire[c.src_param][c.src_offset:c.src_offset + c.numel] for c in copies]
            msg = [torch.cat(parts)]
            shape = tuple(side.params[copies[0].src_param].shape)
            if is_fp8(self.spec, shape):
                msg.append(torch.cat([scales[c.src_param][slice(*rows_of(c, shape[1]))] for c in copies]))
            nbytes = sum(m.numel() * m.element_size() for m in msg)
            works = [pg.send([m], side.group_rank(d), 0) for m in msg]
            inflight.append((works, msg, nbytes))
            held += nbytes
            peak = max(peak, held)
            while len(inflight) >= self.spec.window:
                held -= self._finish(inflight.popleft())
        while inflight:
            held -= self._finish(inflight.popleft())
        return peak

    @staticmethod
    def _finish(item) -> int:
        works, _, nbytes = item
        for w in works:
            w.wait()
        return nbytes

    def land(self, flat, s, copies, table, scale_cache) -> int:
        side, pg = self.side, self.pg()
        src_shape = side.plan.src_shapes[s][copies[0].src_param]
        fp8 = is_fp8(self.spec, tuple(src_shape))
        n = sum(c.numel for c in copies)
        buf = torch.empty(n, dtype=torch.uint8 if fp8 else flat.dtype)
        pg.recv([buf], side.group_rank(s), 0).wait()
        if not fp8:
            off = 0
            for c in copies:
                flat[c.dst_offset:c.dst_offset + c.numel].copy_(buf[off:off + c.numel])
                off += c.numel
            return buf.numel() * buf.element_size()
        cols = src_shape[1]
        seg = torch.empty(sum(b - a for a, b in (rows_of(c, cols) for c in copies)), dtype=torch.float32)
        pg.recv([seg], side.group_rank(s), 0).wait()
        return land_fp8(flat, copies, cols, buf, seg) + 4 * seg.numel()


__all__ = ["GlooTransport"]
