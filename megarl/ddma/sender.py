"""DDMA's sending side, one per trainer rank (megarl/ddma/sync.py tells the whole sync): converts its
shards to the wire dtype, publishes its transport's table and the digests of what each worker will land,
and returns once every worker has its bytes."""

from __future__ import annotations

import collections
import logging
import os
import pickle
import time
from collections.abc import Mapping

import torch

from megarl.ddma.layouts import DstRank, SrcRank, source_rank_layouts
from megarl.ddma.plan import Copy
from megarl.ddma.sync_spec import SyncSpec, _Side
from megarl.ddma.transport import get_transport
from megarl.ddma.transport.base import dequant, engine_dtype, is_fp8, key, plan_buckets
from megarl.ddma.verify import DigestBatch, Segments, hf_segments
from megarl.utils.faults import pause_point

log = logging.getLogger("megarl.ddma.sync")  # the name its lines had before the split


class DdmaSender(_Side):
    """One trainer rank's side. ``params``: Megatron local parameter name -> tensor (live views,
    host or CUDA: the wire stays on their device)."""

    def __init__(self, spec: SyncSpec, rank: SrcRank, params: Mapping[str, torch.Tensor]):
        super().__init__(spec)
        self.rank = rank
        shapes = self.plan.src_shapes[rank]
        for name, shape in shapes.items():
            if name not in params:
                raise ValueError(f"ddma: trainer rank {rank} has no parameter {name} (plan needs it)")
            if tuple(params[name].shape) != tuple(shape):
                raise ValueError(f"ddma: trainer rank {rank} {name} has shape {tuple(params[name].shape)}, "
                                 f"the layout says {tuple(shape)}")
        self.params = {n: params[n] for n in shapes}
        self.layouts = source_rank_layouts(spec.dims, spec.src, rank.tp, rank.pp, rank.dp % spec.src.ep)  # EP rank: its experts
        dst_order = {r: list(self.dst_layouts(r)) for r in self.dst_ranks}
        # Outgoing messages in one global order: destination rank, then its parameter order.
        self.outgoing: list[tuple[DstRank, str, list[Copy]]] = []
        for d in self.dst_ranks:
            copies = self.plan.pairs.get((rank, d), ())
            by_param: dict[str, list[Copy]] = collections.defaultdict(list)
            for c in copies:
                by_param[c.dst_param].append(c)
            self.outgoing += [(d, p, by_param[p]) for p in dst_order[d] if p in by_param]
        if spec.skip:  # a partial sync: only the parameters it sends get wire (conversion) buffers
            used = {c.src_param for _, _, cs in self.outgoing for c in cs}
            self.params = {n: t for n, t in self.params.items() if n in used}
        self.transport = get_transport(spec.transport)(self)
        self._bufs: dict[str, torch.Tensor] | None = None  # conversion buffers, allocated once, in buckets
        self._sent: int | None = None  # bytes a sync sends (from the plan, counted at the first)

    def sync(self, version: int) -> dict:
        """Send this rank's shards for weights ``version``; returns phase seconds and bytes."""
        spec, t0 = self.spec, time.perf_counter()
        wire, scales, extra = self._wire_tensors()
        self.transport.check_wire(wire)
        t1 = time.perf_counter()
        me, checks = self.group_rank(self.rank), spec.verifies(version)
        if self._sent is None:  # the plan's bytes at the wire's dtypes: the same every sync
            self._sent = sum(c.numel * wire[c.src_param].element_size() for _, _, cs in self.outgoing for c in cs)
        sent = self._sent
        # Both lines go to the rank's log: a death between them is a death mid-transfer, while the
        # generator's workers wait on this rank (tests/faults/test_fault_kill_matrix.py kills there).
        log.info("DDMA rank %d: sending weights v%d (%d bytes)", me, version, sent)
        pause_point("ddma_send")
        # The addresses first, the digests after (their own key, read at verification): zero_copy workers
        # copy while this rank sums the same bytes (both only read the wire).
        table: dict = {"pid": os.getpid(), **self.transport.publish(wire, scales), **({} if checks else {"sums": {}}),
                       "skip": spec.skip}
        self.store.set(key(version, f"src{me}"), pickle.dumps(table))
        t2 = time.perf_counter()
        if checks:
            self.store.set(key(version, f"sums{me}"), pickle.dumps(self._checksums(wire, scales)))
        t3 = time.perf_counter()
        extra += self.transport.send(version, wire, scales)
        t4 = time.perf_counter()
        log.info("DDMA rank %d: weights v%d sent in %.3fs", me, version, t4 - t1)
        self.peak_bytes = extra
        del wire, scales
        return {"quantize_s": t1 - t0, "verify_s": t3 - t2, "transfer_s": (t2 - t1) + (t4 - t3), "bytes_sent": sent,
                "peak_extra_bytes": extra, **self.transport.stats()}

    def _conversions(self) -> list[tuple[str, int, torch.dtype]]:
        """(buffer key, numel, dtype) of every conversion buffer this rank's wire needs."""
        dtype, out = engine_dtype(self.spec), []
        for name, p in self.params.items():
            if is_fp8(self.spec, tuple(p.shape)):
                out += [(name, p.numel(), torch.uint8), (name + "/scale", p.shape[0], torch.float32)]
            elif not (p.dtype == dtype and p.is_contiguous()):
                out.append((name, p.numel(), dtype))
        return out

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The conversion buffers, views into buckets of ``spec.bucket_bytes`` on the parameters' device
        (one storage per bucket: one shared-memory file or one CUDA IPC handle each), made once."""
        if self._bufs is None:
            convs = self._conversions()
            device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
            sizes = [n * dt.itemsize for _, n, dt in convs]
            self._bufs = {}
            for bucket in plan_buckets(sizes, self.spec.bucket_bytes):
                end = max(off + sizes[i] for i, off in bucket)
                store = torch.empty(end, dtype=torch.uint8, device=device)
                for i, off in bucket:
                    k, n, dt = convs[i]
                    self._bufs[k] = store[off:off + sizes[i]].view(dt)
        return self._bufs

    def _wire_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        """Flat wire tensors (views of the parameters when no conversion is needed), FP8 scales,
        and the bytes of the conversion buffers (kept across syncs, on the parameters' device)."""
        dtype, wire, scales, extra = engine_dtype(self.spec), {}, {}, 0
        bufs = self._buffers()
        for name, p in self.params.items():
            p = p.detach()
            if is_fp8(self.spec, tuple(p.shape)):
                from megarl.ddma.quantize import VLLM_FP8_MIN_SCALE, quantize_per_channel

                # vLLM's own scale floor: its re-quantization on arrival then reproduces our codes.
                # CUDA parameters go through the CUDA kernel (csrc/cuda/fp8_quant.cu) when built.
                q, sc = quantize_per_channel(p, min_scale=VLLM_FP8_MIN_SCALE)
                wire[name] = bufs[name].copy_(q.reshape(-1))
                scales[name] = bufs[name + "/scale"].copy_(sc.float().reshape(-1))
                extra += q.numel() + 4 * sc.numel()
            elif p.dtype == dtype and p.is_contiguous():
                wire[name] = p.view(-1)
            else:
                wire[name] = bufs[name].copy_(p.reshape(-1))
                extra += wire[name].numel() * wire[name].element_size()
        return wire, scales, extra

    def _landed(self, name: str, wire: torch.Tensor, scales: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The values a receiver lands for this parameter (FP8 dequantized as the receiver does)."""
        if name not in scales:
            return wire
        rows = self.params[name].shape[0]
        return dequant(wire.view(rows, -1), scales[name][:, None], engine_dtype(self.spec)).view(-1)

    def _segments(self) -> dict[tuple[int, str, str], Segments]:
        """Per (destination, HF tensor, source parameter): the HF-affine segments this rank sends
        (from the trainer layout; computed once)."""
        if getattr(self, "_segs", None) is None:
            groups: dict[tuple[int, str, str], list[Copy]] = collections.defaultdict(list)
            for d, _, copies in self.outgoing:
                for c in copies:
                    groups[(self.group_rank(d), c.hf_name, c.src_param)].append(c)
            self._segs = {k: hf_segments(self.layouts[k[2]], k[1], [c.src_offset for c in cs], [c.numel for c in cs])
                          for k, cs in groups.items()}
        return self._segs

    def _checksums(self, wire, scales) -> dict[tuple[int, str], int]:
        """Per (destination, HF tensor): the digest of what this rank sends there, queued on the device
        and read back once (:class:`DigestBatch`)."""
        batch = DigestBatch(self._digest_tables, self.digests_deferred)
        landed_cache: dict[str, torch.Tensor] = {}
        for (j, hf_name, sparam), segs in sorted(self._segments().items(), key=lambda kv: kv[0][2]):
            if sparam not in landed_cache:
                landed_cache.clear()  # one dequantized parameter at a time (freed in stream order)
                landed_cache[sparam] = self._landed(sparam, wire[sparam], scales)
            batch.add((j, hf_name), landed_cache[sparam], segs, table_key=(j, hf_name, sparam))
        sums = batch.values()
        self.digest_readbacks += batch.readbacks
        return sums


__all__ = ["DdmaSender"]
