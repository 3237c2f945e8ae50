"""DDMA at run time: every trainer rank sends its shards straight to the generator workers that
need them, as :func:`megarl.ddma.plan.plan_sync` says; no rank gathers the model.

Both sides build the same plan from a small picklable :class:`SyncSpec` (model dims, the two
topologies, where the rendezvous store is), so no plan travels. Per sync (one ``version``):

- **Sender** (:class:`DdmaSender`, one per trainer rank): converts its shards to the wire dtype
  (the engine's dtype; or FP8 e4m3 with per-row scales for 2-D weights, halving bytes), computes
  the verification checksums of what each destination will land, and publishes them in the
  store; its transport (:mod:`megarl.ddma.transport`: ``zero_copy``, ``cuda_ipc``, ``gloo``,
  ``nccl``) then moves or exposes the bytes. Wire tensors stay where the parameters are (CUDA
  parameters give CUDA wire tensors; conversion buffers are allocated on that device, in buckets).
- **Receiver** (:class:`DdmaReceiver`, one per vLLM worker): :meth:`DdmaReceiver.stream` yields
  ``(vllm_param_name, staging)`` one parameter at a time in vLLM's local layout. Each staging tensor
  is its own: vLLM's layerwise reload keeps a layer's tensors until the whole layer has arrived
  (``online_process_loader`` in vllm/model_executor/model_loader/reload/layerwise.py buffers the
  loader's arguments), so a reused buffer would be overwritten before it is copied -- Qwen2's
  ``qkv_proj`` (weight, then bias, one layer) landed wrong that way. The engine reports each
  parameter as it landed (:meth:`DdmaReceiver.check_landed`, from inside the engine), and
  :meth:`DdmaReceiver.verify_landed` compares those checksums with the senders' and raises
  :class:`DdmaVerifyError` naming the tensor, the ranks and the byte range on a mismatch, or the
  parameters that never landed. :meth:`DdmaReceiver.receive` does all three for a receiver without
  an engine (the staging tensors are then what lands).

Rendezvous: a TCPStore (the controller hosts it: :func:`host_store`). The gloo and nccl groups are
built directly on that store, like vLLM's ``StatelessProcessGroup``, so neither the trainer's nor
vLLM's own world is touched. Group ranks: trainer ranks first (sorted ``SrcRank``), then generator
workers (sorted ``DstRank``). Checksums run where the data is (C++ on host tensors, torch ops on the
device for CUDA tensors).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import pickle
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch

from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES
from megarl.ddma.layouts import (DstRank, GeneratorTopology, SrcRank, TrainerTopology, source_rank_layouts,
                                 vllm_param_layouts)
from megarl.ddma.plan import Copy, SyncPlan, plan_sync
from megarl.ddma.transport import TRANSPORTS, get_transport
from megarl.ddma.transport.base import (FP8, DdmaTransportError, dequant, engine_dtype, gloo_group, is_fp8, key,
                                        outgoing_by_param, plan_buckets, wait_keys)
from megarl.ddma.transport.choice import ALIASES
from megarl.ddma.verify import DdmaVerifyError, DigestBatch, Segments, hf_segments
from megarl.models.layouts import ModelDims
from megarl.utils.faults import pause_point

log = logging.getLogger(__name__)

WIRES = ("engine", "fp8")


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """Everything both sides need to agree on a sync (picklable; goes to every vLLM worker)."""

    dims: ModelDims
    src: TrainerTopology
    dst: GeneratorTopology
    store_host: str
    store_port: int
    transport: str = "zero_copy"   # megarl.ddma.transport: zero_copy | cuda_ipc | gloo | nccl, concrete only:
                                   # "auto" / "p2p" are resolved before, where the device is known, by
                                   # megarl.ddma.transport.choose_transport (megarl train: loop.py resolved_sync)
    wire: str = "engine"           # "engine": send in engine_dtype | "fp8": e4m3 + per-row scales (2-D weights)
    engine_dtype: str = "bfloat16"  # the dtype the engine loads (its model dtype)
    verify_every: int = 1          # checksum every k-th sync (version % k == 0); 0 = never
    timeout_s: float = 300.0       # every wait of a sync (store keys, peers)
    zero_copy_via: str = "map"     # zero_copy: "map" the senders' shared memory (memcpy), falling back to
                                   # "read" (process_vm_readv, no shared memory needed) per sender
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # gloo / nccl: bytes in flight per pair (two rounds of half) and per
                                   # parameter group (transport/buckets.py); cuda_ipc and every sender: bucket
                                   # size of converted wire buffers (sync.bucket_mb)
    skip: frozenset = frozenset()  # HF tensor names this sync leaves out (a partial sync: :func:`without`); the
                                   # engine keeps what it holds for them. LoRA: the frozen tensors after the first
                                   # sync (megarl/trainer/ddma.py LoraMergedSender). A sender's table names its skip,
                                   # so a receiver built for the full spec lands a partial sync too.

    def __post_init__(self):
        if self.transport in ALIASES:
            raise ValueError(f"ddma transport {self.transport!r} is an alias: resolve it with "
                             f"megarl.ddma.transport.choose_transport({self.transport!r}, device=..., same_host=...) "
                             f"where the device is known; SyncSpec takes one of {TRANSPORTS}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ddma transport {self.transport!r}: choose one of {TRANSPORTS}")
        if self.wire not in WIRES:
            raise ValueError(f"ddma wire {self.wire!r}: choose one of {WIRES}")
        if self.zero_copy_via not in ("map", "read"):
            raise ValueError(f"ddma zero_copy_via {self.zero_copy_via!r}: choose 'map' or 'read'")
        if self.verify_every < 0 or self.timeout_s <= 0 or self.bucket_bytes < 1:
            raise ValueError("ddma verify_every must be >= 0, timeout_s > 0 and bucket_bytes >= 1")
        if not isinstance(self.skip, frozenset):
            raise ValueError(f"ddma skip must be a frozenset of HF tensor names, not {type(self.skip).__name__}")

    def weight_source(self, version: int) -> dict:
        """The generator's weight source for this sync (see megarl/generator/weights.py)."""
        return {"kind": "ddma", "spec": self, "version": int(version)}

    def verifies(self, version: int) -> bool:
        return self.verify_every > 0 and version % self.verify_every == 0


def verified_key(version: int, rank: DstRank) -> str:
    """The store key a generator worker sets once its landing of ``version`` matched the senders'
    checksums (:meth:`DdmaReceiver.verify_landed`)."""
    return key(version, f"verified_r{rank.replica}_t{rank.tp}")


def verified_workers(store: torch.distributed.Store, spec: SyncSpec, version: int) -> int:
    """How many generator workers of ``spec.dst`` compared their landing of ``version`` with the
    senders' checksums and found them equal (0 when the sync was not checksummed)."""
    keys = [verified_key(version, r) for r in spec.dst.ranks()]
    return sum(store.check([k]) for k in keys)


def without(plan: SyncPlan, skip: frozenset) -> SyncPlan:
    """``plan`` less every copy of the HF tensors in ``skip`` (a partial sync: the same senders and
    offsets for what is left; pairs left with no copy are dropped)."""
    if not skip:
        return plan
    pairs = {k: kept for k, cs in plan.pairs.items() if (kept := tuple(c for c in cs if c.hf_name not in skip))}
    return dataclasses.replace(plan, pairs=pairs)


def skipped_params(spec: SyncSpec, d: DstRank) -> frozenset:
    """The engine parameters of worker ``d`` that a sync under ``spec`` leaves whole out (every HF tensor in
    them skipped). Raises ValueError where a parameter, or a vLLM layer (the parameters of one module, which
    vLLM's layerwise reload processes together: a layer half landed is rebuilt from uninitialised storage),
    would land in part."""
    if not spec.skip:
        return frozenset()
    layouts = vllm_param_layouts(spec.dims, spec.dst.tp, d.tp, spec.dst.vocab_padding)
    out, sent = set(), set()
    for name, layout in layouts.items():
        hf = {p.hf_name for p in layout.pieces}
        if hf <= spec.skip:
            out.add(name)
        elif hf & spec.skip:
            raise ValueError(f"ddma skip: engine parameter {name} would land in part (skipped {sorted(hf & spec.skip)}, "
                             f"sent {sorted(hf - spec.skip)}); skip all of its HF tensors or none")
        else:
            sent.add(name)
    layer = lambda n: n.rsplit(".", 1)[0]  # noqa: E731
    half = sorted({layer(n) for n in out} & {layer(n) for n in sent})
    if half:
        raise ValueError(f"ddma skip: vLLM layer {half[0]} would land in part (its parameters "
                         f"{sorted(n for n in layouts if layer(n) == half[0])}): skip all of a layer's tensors or none")
    return frozenset(out)


def host_store(host: str = "127.0.0.1", port: int = 0) -> torch.distributed.TCPStore:
    """The rendezvous store (the controller's; port 0 picks a free one: read ``store.port``)."""
    return torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False)


def _connect(spec: SyncSpec) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                      timeout=timedelta(seconds=spec.timeout_s))


class _Side:
    digests_deferred: bool | None = None  # DigestBatch(deferred=): None = on a device only; the tests force it

    def __init__(self, spec: SyncSpec):
        self.spec = spec
        self._digest_tables: dict = {}  # the digests' segment tables on the device, built once per plan
        self.digest_readbacks = 0  # device-to-host copies of digests, all syncs (one a side per checked sync)
        self.plan: SyncPlan = without(plan_sync(spec.dims, spec.src, spec.dst), spec.skip)
        self.src_ranks = sorted(self.plan.src_shapes)
        self.dst_ranks = sorted(self.plan.dst_shapes)
        self.store = _connect(spec)
        self.peak_bytes = 0  # the most extra bytes this side held at once during a sync

    def group_rank(self, rank: SrcRank | DstRank) -> int:
        if isinstance(rank, SrcRank):
            return self.src_ranks.index(rank)
        return len(self.src_ranks) + self.dst_ranks.index(rank)

    def dst_layouts(self, d: DstRank) -> dict:
        """Worker ``d``'s engine parameters this side's syncs land (all, less :func:`skipped_params`), in
        vLLM's order: the transports' parameter order and groups."""
        layouts = vllm_param_layouts(self.spec.dims, self.spec.dst.tp, d.tp, self.spec.dst.vocab_padding)
        skipped = skipped_params(self.spec, d)
        return {n: lay for n, lay in layouts.items() if n not in skipped}


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

    def sync(self, version: int) -> dict:
        """Send this rank's shards for weights ``version``; returns phase seconds and bytes."""
        spec, t0 = self.spec, time.perf_counter()
        wire, scales, extra = self._wire_tensors()
        self.transport.check_wire(wire)
        t1 = time.perf_counter()
        me, checks = self.group_rank(self.rank), spec.verifies(version)
        sent = sum(c.numel * wire[c.src_param].element_size() for _, _, cs in self.outgoing for c in cs)
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


class DdmaReceiver(_Side):
    """One vLLM worker's side: :meth:`stream` yields its parameters, one staging tensor each, on
    ``device`` (the engine's: CUDA staging for cuda_ipc / nccl)."""

    def __init__(self, spec: SyncSpec, rank: DstRank, device: str | torch.device = "cpu"):
        super().__init__(spec)
        self.rank = rank
        self.device = torch.device(device)
        self.layouts = self.dst_layouts(rank)
        self.skipped = skipped_params(spec, rank)  # engine parameters a partial sync leaves as they are
        self._parts: dict[frozenset, DdmaReceiver] = {}  # receivers of the partial syncs senders chose
        self._active: DdmaReceiver = self
        self.incoming: dict[str, list[tuple[SrcRank, list[Copy]]]] = outgoing_by_param(self)
        self.tables: dict[SrcRank, dict] = {}
        self.transport = get_transport(spec.transport)(self)
        self.last_stats: dict = {}

    def _for(self, version: int) -> tuple[DdmaReceiver, dict[SrcRank, dict]]:
        """The receiver of sync ``version`` (this one, or the one of the partial sync the senders' tables
        name: their ``skip``) and the senders' tables. Every later call of this sync goes to it."""
        tables = self._published(version)
        skips = {frozenset(t.get("skip", frozenset())) for t in tables.values()}
        if len(skips) != 1:
            raise DdmaTransportError(f"ddma: the trainer ranks disagree on what weights v{version} leave out "
                                     f"({len(skips)} different skip sets)")
        skip = skips.pop()
        if skip == self.spec.skip:
            self._active = self
        else:
            if skip not in self._parts:
                self._parts[skip] = DdmaReceiver(dataclasses.replace(self.spec, skip=skip), self.rank, self.device)
            self._active = self._parts[skip]
        return self._active, tables

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`stream`, each staging tensor checked as what lands, then :meth:`verify_landed`
        (a receiver without an engine: tools and the transport tests)."""
        for name, staging in self.stream(version):
            if self.spec.verifies(version):
                self.check_landed(name, staging)
            yield name, staging
        self.verify_landed(version)

    def _published(self, version: int) -> dict[SrcRank, dict]:
        """Every trainer rank's table for weights ``version`` (waits for them in the store)."""
        keys = [key(version, f"src{self.group_rank(s)}") for s in self.src_ranks]
        wait_keys(self.store, keys, f"{len(keys)} trainer rank(s) to publish weights v{version}", self.spec.timeout_s)
        return {s: pickle.loads(self.store.get(k)) for s, k in zip(self.src_ranks, keys)}

    def receive_into(self, version: int, params: Mapping[str, torch.Tensor]) -> None:
        """Land weights ``version`` straight into ``params`` -- vLLM name -> the engine's own tensor (engine
        dtype, local layout shape, contiguous, on this receiver's device): an engine whose parameters are
        plain, not repacked -- with no staging tensor, then verify (raises :class:`DdmaVerifyError`).

        Where the transport may write there (``lands_in_place``: zero_copy) each sender's runs go
        straight into the tensor, and where the copy is ours (mapped shared memory) each run is
        digested in the same pass (csrc ``copy_checksum_runs``: the digest :meth:`check_landed` would
        compute over the same bytes, with HF positions from this worker's layout), so the bytes are read
        once. That digest covers only the copied runs, so it is used only where the plan's runs cover
        the parameter's HF elements exactly once (checked once per plan); otherwise, and for FP8 or
        process_vm_readv, the parameter is checksummed after it landed. Other transports land through
        :meth:`stream`'s staging tensors, copied in. A vLLM worker lands through :meth:`stream` and its
        loader (megarl/generator/ddma_source.py): its parameters are repacked after loading."""
        part, tables = self._for(version)
        if part is not self:
            part.receive_into(version, params)
            self.last_stats = part.last_stats
            return
        spec, t0 = self.spec, time.perf_counter()
        for name, layout in self.layouts.items():
            t = params.get(name)
            if t is None or t.dtype != engine_dtype(spec) or tuple(t.shape) != tuple(layout.local_shape) \
                    or not t.is_contiguous() or t.device != self.device:
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
                raise ValueError(f"ddma receive_into: engine tensor {name} is {got}; it must be a contiguous "
                                 f"{spec.engine_dtype} {tuple(layout.local_shape)} on {self.device}")
        checks = spec.verifies(version)
        if not self.transport.lands_in_place:
            for name, staging in self.stream(version):
                params[name].copy_(staging)
                if checks:
                    self.check_landed(name, params[name])
            self.verify_landed(version)
            return
        self.begin_landing(tables)
        t1 = time.perf_counter()
        scale_cache: dict = {}
        peak = 0
        for dparam in self.layouts:
            flat = params[dparam].view(-1)
            exact, gaps = self._coverage(dparam)
            for a, b in gaps:  # vocab padding rows: no sender writes them
                flat[a:b].zero_()
            sums: list[torch.Tensor] | None = [] if checks and exact else None
            for s, copies in self.incoming[dparam]:
                runs = self.digest_runs(dparam, s, copies) if sums is not None else None
                scratch, got = self.transport.land_digest(flat, s, copies, self.tables[s], scale_cache, runs)
                peak = max(peak, scratch)
                sums = None if got is None or sums is None else sums + [got]
            if sums is not None:
                for i, name in enumerate(self._hf_names(dparam)):
                    self._digests.reset((dparam, name))
                    self._digests.set((dparam, name), sum(int(g[i]) for g in sums) & 0xFFFFFFFFFFFFFFFF)
                self._landed.add(dparam)
            elif checks:
                self.check_landed(dparam, params[dparam])
        self.transport.ack(version)
        self.peak_bytes = peak
        self.last_stats = {"transfer_s": time.perf_counter() - t1, "verify_s": 0.0, "land_s": 0.0,
                           "total_s": 0.0, "elements_received": self._elements(), "peak_extra_bytes": peak,
                           "transport": spec.transport, **self.transport.stats()}
        self.verify_landed(version)
        self.last_stats["total_s"] = time.perf_counter() - t0

    def _elements(self) -> int:
        """Elements this worker receives per sync (from the plan; counted once)."""
        if "_n_elements" not in self.__dict__:
            self._n_elements = sum(c.numel for inc in self.incoming.values() for _, cs in inc for c in cs)
        return self._n_elements

    def _hf_names(self, dparam: str) -> list[str]:
        """The HF tensors of an engine parameter, in layout order (the digest groups of :meth:`digest_runs`)."""
        return list(dict.fromkeys(p.hf_name for p in self.layouts[dparam].pieces))

    def _coverage(self, dparam: str) -> tuple[bool, list[tuple[int, int]]]:
        """(whether the plan's runs into ``dparam`` are disjoint and cover exactly its HF elements, the
        element ranges no run writes), computed once per plan."""
        cache = self.__dict__.setdefault("_cover", {})
        if dparam not in cache:
            layout = self.layouts[dparam]
            numel = math.prod(layout.local_shape)
            hf_elements = sum(numel // layout.local_shape[p.dim] * p.length for p in layout.pieces)
            runs = sorted((c.dst_offset, c.dst_offset + c.numel) for _, cs in self.incoming[dparam] for c in cs)
            gaps, end, disjoint = [], 0, True
            for a, b in runs:
                disjoint &= a >= end
                if a > end:
                    gaps.append((end, a))
                end = max(end, b)
            if end < numel:
                gaps.append((end, numel))
            exact = disjoint and end <= numel and sum(b - a for a, b in runs) == hf_elements
            cache[dparam] = (exact, gaps)
        return cache[dparam]

    def digest_runs(self, dparam: str, s: SrcRank, copies: list[Copy]) -> tuple | None:
        """Sender ``s``'s copies into ``dparam`` as HF-affine runs for a fused copy + digest: (source byte
        offsets in its wire tensor, destination byte offsets in ``dparam``, element counts, HF start
        indices, digest group = index in :meth:`_hf_names`, number of groups); the HF positions come from
        this worker's layout at each run's destination (as :meth:`check_landed` takes them). Once per
        plan; None where a run falls outside its HF tensor's pieces (then the parameter is checked after)."""
        cache = self.__dict__.setdefault("_digest_runs", {})
        k = (dparam, s)
        if k not in cache:
            layout, es, names = self.layouts[dparam], engine_dtype(self.spec).itemsize, self._hf_names(dparam)
            cols: list[list[int]] = [[], [], [], [], []]
            try:
                for c in copies:
                    offs, lens, hfs = hf_segments(layout, c.hf_name, [c.dst_offset], [c.numel])
                    for o, n, h in zip(offs.tolist(), lens.tolist(), hfs.tolist()):
                        for col, v in zip(cols, ((c.src_offset + o - c.dst_offset) * es, o * es, n, h,
                                                 names.index(c.hf_name))):
                            col.append(v)
                cache[k] = (*(torch.tensor(col, dtype=torch.int64) for col in cols), len(names))
            except ValueError:
                cache[k] = None
        return cache[k]

    def stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this worker's parameters for weights ``version`` (vLLM names, local layout), one
        new staging tensor each; the caller lands them, reports each through :meth:`check_landed`
        and ends with :meth:`verify_landed`."""
        t0 = time.perf_counter()
        part, tables = self._for(version)
        if part is not self:
            yield from part.stream(version)
            self.last_stats = part.last_stats
            return
        spec = self.spec
        self.begin_landing(tables)
        transfer = land = 0.0
        received = peak = 0
        it = self.transport.receive_params(version)
        while True:
            ta = time.perf_counter()
            try:
                dparam, staging, held, elements = next(it)
            except StopIteration:
                break
            peak = max(peak, held)
            received += elements
            tb = time.perf_counter()
            transfer += tb - ta
            yield dparam, staging
            land += time.perf_counter() - tb
            del staging
        self.transport.ack(version)
        self.peak_bytes = peak
        self.last_stats = {"transfer_s": transfer, "verify_s": 0.0, "land_s": land,
                           "total_s": time.perf_counter() - t0, "elements_received": received,
                           "peak_extra_bytes": peak, "transport": spec.transport, **self.transport.stats()}

    def begin_landing(self, tables: Mapping[SrcRank, dict]) -> None:
        """Start checking one sync's landing against the senders' published ``tables``."""
        self.tables = dict(tables)
        self._landed: set[str] = set()  # engine parameters reported; their digests are in _digests
        self._digests = DigestBatch(self._digest_tables, self.digests_deferred)  # (param, HF tensor) -> sum
        self._unsent: set[str] = set()  # engine weights no layout covers
        self._verify_s = 0.0

    def check_landed(self, name: str, landed: torch.Tensor) -> None:
        """Checksum parameter ``name`` as the engine holds it after landing (its local layout)."""
        if self._active is not self:
            return self._active.check_landed(name, landed)
        layout = self.layouts.get(name)
        if layout is None and name in self.skipped:  # not in this (partial) sync: the engine keeps it
            return
        if layout is None:
            if name.endswith((".weight", ".bias")):  # a weight DDMA sends nothing for (quantization
                self._unsent.add(name)                 # scales are the engine's own): never right
            return
        t = time.perf_counter()
        flat = landed.detach().reshape(-1)
        if flat.dtype != engine_dtype(self.spec) or flat.numel() != math.prod(layout.local_shape):
            raise DdmaVerifyError(f"ddma: engine parameter {name} landed as {landed.dtype} {tuple(landed.shape)}; "
                                  f"the sync sent {self.spec.engine_dtype} {tuple(layout.local_shape)}")
        self._checksum(flat, name, layout)  # a parameter reported again replaces its earlier report
        self._landed.add(name)
        self._verify_s += time.perf_counter() - t

    def verify_landed(self, version: int) -> None:
        """After the engine landed weights ``version``: every parameter landed, and its checksums
        are the senders'. Raises :class:`DdmaVerifyError`."""
        if self._active is not self:
            self._active.verify_landed(version)
            self.last_stats = self._active.last_stats
            return
        if not self.spec.verifies(version):
            return
        t = time.perf_counter()
        self._fetch_sums(version)
        if self._unsent:
            raise DdmaVerifyError(
                f"ddma verification failed on generator replica {self.rank.replica} tp {self.rank.tp}: the engine "
                f"has {len(self._unsent)} weight(s) that no DDMA layout sends, so they keep stale or uninitialised "
                f"values: {sorted(self._unsent)[:4]} (a model variant outside megarl/models/families/?)")
        missing = [n for n in self.layouts if n not in self._landed]
        if missing:
            raise DdmaVerifyError(
                f"ddma verification failed on generator replica {self.rank.replica} tp {self.rank.tp}: "
                f"{len(missing)} parameter(s) never landed in the engine after weights v{version}: {missing[:4]}")
        sums: dict[str, int] = collections.defaultdict(int)
        for (_, hf_name), v in self._digests.values().items():  # the one readback of this sync's digests
            sums[hf_name] = (sums[hf_name] + v) & 0xFFFFFFFFFFFFFFFF
        self.digest_readbacks += self._digests.readbacks
        self._compare(sums, self.tables)
        # What verification found, for the controller (sync/verified): set only after the compare passed
        self.store.set(verified_key(version, self.rank), "1")
        self._verify_s += time.perf_counter() - t
        self.last_stats["verify_s"] = self._verify_s

    def _fetch_sums(self, version: int) -> None:
        """The senders' digests of ``version`` into their tables (published after their addresses)."""
        late = [s for s, t in self.tables.items() if "sums" not in t]
        keys = [key(version, f"sums{self.group_rank(s)}") for s in late]
        if keys:
            wait_keys(self.store, keys, f"{len(keys)} trainer rank(s) to publish the digests of weights v{version}",
                      self.spec.timeout_s)
        for s, k in zip(late, keys):
            self.tables[s]["sums"] = pickle.loads(self.store.get(k))

    def _checksum(self, flat: torch.Tensor, dparam: str, layout) -> None:
        """Queue the digests of engine parameter ``dparam`` as landed (``flat``, its local layout), one per
        HF tensor, replacing any earlier report of it."""
        cache = self.__dict__.setdefault("_segs", {})
        if dparam not in cache:  # every element each HF tensor has in this parameter (vLLM layout)
            shape, segs = layout.local_shape, {}
            for name in dict.fromkeys(p.hf_name for p in layout.pieces):
                runs = [((o * shape[p.dim] + p.local_start) * math.prod(shape[p.dim + 1:]),
                         p.length * math.prod(shape[p.dim + 1:]))
                        for p in layout.pieces if p.hf_name == name for o in range(math.prod(shape[:p.dim]))]
                segs[name] = hf_segments(layout, name, [a for a, _ in runs], [n for _, n in runs])
            cache[dparam] = segs
        for name, segs in cache[dparam].items():
            self._digests.reset((dparam, name))
            self._digests.add((dparam, name), flat, segs)

    def _compare(self, sums: Mapping[str, int], tables: Mapping[SrcRank, dict]) -> None:
        me = self.group_rank(self.rank)
        expected: dict[str, int] = collections.defaultdict(int)
        senders: dict[str, list[str]] = collections.defaultdict(list)
        for s, t in tables.items():
            for (j, hf_name), v in t["sums"].items():
                if j == me:
                    expected[hf_name] = (expected[hf_name] + v) & 0xFFFFFFFFFFFFFFFF
                    senders[hf_name].append(f"tp{s.tp}/pp{s.pp}/dp{s.dp}")
        bad = sorted(n for n in set(expected) | set(sums) if expected.get(n, 0) != sums.get(n, 0))
        if not bad:
            return
        name = bad[0]
        where = []
        for dparam, layout in self.layouts.items():
            itemsize = engine_dtype(self.spec).itemsize
            inner = math.prod(layout.local_shape[1:])
            for p in layout.pieces:
                if p.hf_name == name and p.dim == 0:
                    where.append(f"{dparam} bytes [{p.local_start * inner * itemsize}, "
                                 f"{(p.local_start + p.length) * inner * itemsize})")
                elif p.hf_name == name:
                    where.append(f"{dparam} (dim {p.dim} columns [{p.local_start}, {p.local_start + p.length}))")
        raise DdmaVerifyError(
            f"ddma verification failed on generator replica {self.rank.replica} tp {self.rank.tp}: {name} "
            f"checksum {sums.get(name, 0):#x} != {expected.get(name, 0):#x} sent by trainer rank(s) "
            f"{senders.get(name) or 'none'}; landed at {'; '.join(where) or '?'}"
            + (f" (and {len(bad) - 1} more tensor(s): {bad[1:4]})" if len(bad) > 1 else ""))


__all__ = ["SyncSpec", "DdmaSender", "DdmaReceiver", "DdmaVerifyError", "DdmaTransportError", "host_store",
           "gloo_group", "TRANSPORTS", "WIRES", "FP8"]
