"""DDMA at run time: every trainer rank sends its shards straight to the generator workers that
need them, as :func:`megarl.ddma.plan.plan_sync` says; no rank gathers the model.

Both sides build the same plan from a small picklable :class:`SyncSpec` (model dims, the two
topologies, where the rendezvous store is), so no plan travels. Per sync (one ``version``):

- **Sender** (:class:`DdmaSender`, one per trainer rank): converts its shards to the wire dtype
  (the engine's dtype; or FP8 e4m3 with per-row scales for 2-D weights, halving bytes), computes
  the verification checksums of what each destination will land, and publishes them in the
  store. ``zero_copy``: it publishes its pid and the addresses of its wire tensors and waits until
  every worker has read; the receivers pull their runs straight out of its memory
  (process_vm_readv, :mod:`megarl.ddma.zero_copy`). ``p2p``: it sends one message per
  (destination, parameter) over a gloo group of its own (a bounded window of messages in flight).
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

Rendezvous: a TCPStore (the controller hosts it: :func:`host_store`). The p2p group is a
``ProcessGroupGloo`` built directly on that store, like vLLM's ``StatelessProcessGroup``, so
neither the trainer's nor vLLM's own world is touched. Group ranks: trainer ranks first (sorted
``SrcRank``), then generator workers (sorted ``DstRank``).
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

from megarl.ddma.layouts import (DstRank, GeneratorTopology, SrcRank, TrainerTopology, source_rank_layouts,
                                 vllm_param_layouts)
from megarl.ddma.plan import Copy, SyncPlan, plan_sync
from megarl.ddma.verify import DdmaVerifyError, Segments, checksum_segments, hf_segments, run_indices
from megarl.ddma.zero_copy import allow_readers, copy_runs, map_shared, read_runs, share
from megarl.models.layouts import ModelDims

log = logging.getLogger(__name__)

TRANSPORTS = ("zero_copy", "p2p")
WIRES = ("engine", "fp8")
FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """Everything both sides need to agree on a sync (picklable; goes to every vLLM worker)."""

    dims: ModelDims
    src: TrainerTopology
    dst: GeneratorTopology
    store_host: str
    store_port: int
    transport: str = "zero_copy"   # "zero_copy" (same host: receivers read the senders' memory) | "p2p"
    wire: str = "engine"           # "engine": send in engine_dtype | "fp8": e4m3 + per-row scales (2-D weights)
    engine_dtype: str = "bfloat16"  # the dtype the engine loads (its model dtype)
    verify_every: int = 1          # checksum every k-th sync (version % k == 0); 0 = never
    timeout_s: float = 300.0       # every wait of a sync (store keys, peers)
    window: int = 4                # p2p: messages in flight per sender (bounds its pack buffers)
    zero_copy_via: str = "map"     # zero_copy: "map" the senders' shared memory (memcpy), falling back to
                                   # "read" (process_vm_readv, no shared memory needed) per sender

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ddma transport {self.transport!r}: choose one of {TRANSPORTS}")
        if self.wire not in WIRES:
            raise ValueError(f"ddma wire {self.wire!r}: choose one of {WIRES}")
        if self.zero_copy_via not in ("map", "read"):
            raise ValueError(f"ddma zero_copy_via {self.zero_copy_via!r}: choose 'map' or 'read'")
        if self.verify_every < 0 or self.window < 1 or self.timeout_s <= 0:
            raise ValueError("ddma verify_every must be >= 0, window >= 1 and timeout_s > 0")

    def weight_source(self, version: int) -> dict:
        """The generator's weight source for this sync (see megarl/generator/weights.py)."""
        return {"kind": "ddma", "spec": self, "version": int(version)}

    def verifies(self, version: int) -> bool:
        return self.verify_every > 0 and version % self.verify_every == 0


def host_store(host: str = "127.0.0.1", port: int = 0) -> torch.distributed.TCPStore:
    """The rendezvous store (the controller's; port 0 picks a free one: read ``store.port``)."""
    return torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False)


def _connect(spec: SyncSpec) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                      timeout=timedelta(seconds=spec.timeout_s))


def _key(spec: SyncSpec, version: int, what: str) -> str:
    return f"ddma/v{version}/{what}"


def _engine_dtype(spec: SyncSpec) -> torch.dtype:
    return getattr(torch, spec.engine_dtype)


def _is_fp8(spec: SyncSpec, shape: tuple[int, ...]) -> bool:
    return spec.wire == "fp8" and len(shape) == 2


def _dequant(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one dequantization both sides use (so checksums agree): float32 product, then cast."""
    return (q.view(FP8).float() * scale).to(dtype)


def gloo_group(store, rank: int, size: int, timeout_s: float, prefix: str = "ddma/gloo"):
    """A gloo process group of its own, built directly on ``store`` (no global world touched)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(torch.distributed.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s))


def _wait_keys(store, keys: list[str], what: str, timeout_s: float) -> None:
    log.info("ddma: waiting for %s (timeout %.0f s)", what, timeout_s)
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
        missing = [k for k in keys if not store.check([k])]
        raise TimeoutError(f"ddma: timed out after {timeout_s:.0f} s waiting for {what}; "
                           f"missing: {missing[:8]}") from e


def _rows(c: Copy, cols: int) -> tuple[int, int]:
    """First and one-past-last source row an FP8 copy's elements come from."""
    return c.src_offset // cols, (c.src_offset + c.numel - 1) // cols + 1


class _Side:
    def __init__(self, spec: SyncSpec):
        self.spec = spec
        self.plan: SyncPlan = plan_sync(spec.dims, spec.src, spec.dst)
        self.src_ranks = sorted(self.plan.src_shapes)
        self.dst_ranks = sorted(self.plan.dst_shapes)
        self.store = _connect(spec)
        self._pg = None
        self.peak_bytes = 0  # the most extra bytes this side held at once during a sync

    def group_rank(self, rank: SrcRank | DstRank) -> int:
        if isinstance(rank, SrcRank):
            return self.src_ranks.index(rank)
        return len(self.src_ranks) + self.dst_ranks.index(rank)

    def pg(self, me: int):
        if self._pg is None:
            self._pg = gloo_group(self.store, me, len(self.src_ranks) + len(self.dst_ranks), self.spec.timeout_s)
        return self._pg


class DdmaSender(_Side):
    """One trainer rank's side. ``params``: Megatron local parameter name -> tensor (live views)."""

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
        self.layouts = source_rank_layouts(spec.dims, spec.src, rank.tp, rank.pp)
        dst_order = {r: list(vllm_param_layouts(spec.dims, spec.dst.tp, r.tp, spec.dst.vocab_padding))
                     for r in self.dst_ranks}
        # Outgoing messages in one global order: destination rank, then its parameter order.
        self.outgoing: list[tuple[DstRank, str, list[Copy]]] = []
        for d in self.dst_ranks:
            copies = self.plan.pairs.get((rank, d), ())
            by_param: dict[str, list[Copy]] = collections.defaultdict(list)
            for c in copies:
                by_param[c.dst_param].append(c)
            self.outgoing += [(d, p, by_param[p]) for p in dst_order[d] if p in by_param]
        if spec.transport == "zero_copy":
            allow_readers()

    def sync(self, version: int) -> dict:
        """Send this rank's shards for weights ``version``; returns phase seconds and bytes."""
        spec, t0 = self.spec, time.perf_counter()
        wire, scales, extra = self._wire_tensors()
        t1 = time.perf_counter()
        sums = self._checksums(wire, scales) if spec.verifies(version) else {}
        t2 = time.perf_counter()
        table: dict = {"sums": sums, "pid": os.getpid()}
        if spec.transport == "zero_copy":  # where each wire tensor lives (shared memory + address)
            table["params"] = {n: share(t) for n, t in wire.items()}
            table["scales"] = {n: share(sc) for n, sc in scales.items()}
        self.store.set(_key(spec, version, f"src{self.group_rank(self.rank)}"), pickle.dumps(table))
        sent = sum(c.numel * wire[c.src_param].element_size() for _, _, cs in self.outgoing for c in cs)
        if spec.transport == "zero_copy":
            done = [_key(spec, version, f"done{self.group_rank(d)}") for d in self.dst_ranks]
            _wait_keys(self.store, done, f"{len(done)} generator worker(s) to read weights v{version} "
                       f"from trainer rank {self.rank}", spec.timeout_s)
        else:
            extra = max(extra, extra + self._send_p2p(wire, scales))
        t3 = time.perf_counter()
        self.peak_bytes = extra
        del wire, scales
        return {"quantize_s": t1 - t0, "verify_s": t2 - t1, "transfer_s": t3 - t2, "bytes_sent": sent,
                "peak_extra_bytes": extra}

    def _wire_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        """Flat wire tensors (views of the parameters when no conversion is needed), FP8 scales,
        and the bytes of the conversion buffers (kept across syncs: with zero-copy they sit in
        shared memory, set up once)."""
        dtype, wire, scales, extra = _engine_dtype(self.spec), {}, {}, 0
        bufs = self.__dict__.setdefault("_wire_bufs", {})
        for name, p in self.params.items():
            p = p.detach()
            if _is_fp8(self.spec, tuple(p.shape)):
                from megarl.ddma.quantize import VLLM_FP8_MIN_SCALE, quantize_per_channel

                # vLLM's own scale floor: its re-quantization on arrival then reproduces our codes
                q, sc = quantize_per_channel(p, min_scale=VLLM_FP8_MIN_SCALE)
                wire[name] = self._buffer(bufs, name, q.reshape(-1))
                scales[name] = self._buffer(bufs, name + "/scale", sc.float().reshape(-1))
                extra += q.numel() + 4 * sc.numel()
            elif p.dtype == dtype and p.is_contiguous():
                wire[name] = p.view(-1)
            else:
                wire[name] = self._buffer(bufs, name, p.reshape(-1), dtype)
                extra += wire[name].numel() * wire[name].element_size()
        return wire, scales, extra

    @staticmethod
    def _buffer(bufs: dict, key: str, values: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or values.dtype
        buf = bufs.get(key)
        if buf is None or buf.numel() != values.numel() or buf.dtype != dtype:
            buf = bufs[key] = torch.empty(values.numel(), dtype=dtype)
        return buf.copy_(values)

    def _landed(self, name: str, wire: torch.Tensor, scales: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The values a receiver lands for this parameter (FP8 dequantized as the receiver does)."""
        if name not in scales:
            return wire
        rows = self.params[name].shape[0]
        return _dequant(wire.view(rows, -1), scales[name][:, None], _engine_dtype(self.spec)).view(-1)

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
        sums: dict[tuple[int, str], int] = collections.defaultdict(int)
        landed_cache: dict[str, torch.Tensor] = {}
        for (j, hf_name, sparam), segs in sorted(self._segments().items(), key=lambda kv: kv[0][2]):
            if sparam not in landed_cache:
                landed_cache.clear()  # one dequantized parameter at a time
                landed_cache[sparam] = self._landed(sparam, wire[sparam], scales)
            s = checksum_segments(landed_cache[sparam], segs)
            sums[(j, hf_name)] = (sums[(j, hf_name)] + s) & 0xFFFFFFFFFFFFFFFF
        return dict(sums)

    def _send_p2p(self, wire, scales) -> int:
        pg = self.pg(self.group_rank(self.rank))
        inflight: collections.deque = collections.deque()
        held = peak = 0
        for d, _, copies in self.outgoing:
            parts = [wire[c.src_param][c.src_offset:c.src_offset + c.numel] for c in copies]
            msg = [torch.cat(parts)]
            if _is_fp8(self.spec, tuple(self.params[copies[0].src_param].shape)):
                cols = self.params[copies[0].src_param].shape[1]
                msg.append(torch.cat([scales[c.src_param][slice(*_rows(c, cols))] for c in copies]))
            nbytes = sum(m.numel() * m.element_size() for m in msg)
            works = [pg.send([m], self.group_rank(d), 0) for m in msg]
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


class DdmaReceiver(_Side):
    """One vLLM worker's side: :meth:`stream` yields its parameters, one staging tensor each."""

    def __init__(self, spec: SyncSpec, rank: DstRank):
        super().__init__(spec)
        self.rank = rank
        self.layouts = vllm_param_layouts(spec.dims, spec.dst.tp, rank.tp, spec.dst.vocab_padding)
        self.incoming: dict[str, list[tuple[SrcRank, list[Copy]]]] = {p: [] for p in self.layouts}
        for s in self.src_ranks:
            by_param: dict[str, list[Copy]] = collections.defaultdict(list)
            for c in self.plan.pairs.get((s, rank), ()):
                by_param[c.dst_param].append(c)
            for p, cs in by_param.items():
                self.incoming[p].append((s, cs))
        self.last_stats: dict = {}

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`stream`, each staging tensor checked as what lands, then :meth:`verify_landed`
        (a receiver without an engine: tools and the transport tests)."""
        for name, staging in self.stream(version):
            if self.spec.verifies(version):
                self.check_landed(name, staging)
            yield name, staging
        self.verify_landed(version)

    def stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this worker's parameters for weights ``version`` (vLLM names, local layout), one
        new staging tensor each; the caller lands them, reports each through :meth:`check_landed`
        and ends with :meth:`verify_landed`."""
        spec, me = self.spec, self.group_rank(self.rank)
        t0 = time.perf_counter()
        keys = [_key(spec, version, f"src{self.group_rank(s)}") for s in self.src_ranks]
        _wait_keys(self.store, keys, f"{len(keys)} trainer rank(s) to publish weights v{version}", spec.timeout_s)
        self.begin_landing({s: pickle.loads(self.store.get(k)) for s, k in zip(self.src_ranks, keys)})
        dtype = _engine_dtype(spec)
        transfer = land = 0.0
        received = peak = 0
        scale_cache: dict[tuple[SrcRank, str], torch.Tensor] = {}
        for dparam, layout in self.layouts.items():
            ta = time.perf_counter()
            shape = layout.local_shape
            numel = math.prod(shape)
            padded = sum(c.numel for _, cs in self.incoming[dparam] for c in cs) < numel
            # vocab padding rows: no sender writes them
            staging = torch.zeros(shape, dtype=dtype) if padded else torch.empty(shape, dtype=dtype)
            held = staging.numel() * staging.element_size()
            for s, copies in self.incoming[dparam]:
                held += self._land(staging.view(-1), s, copies, self._tables[s], scale_cache)
                received += sum(c.numel for c in copies)
            peak = max(peak, held)
            tb = time.perf_counter()
            transfer += tb - ta
            yield dparam, staging
            land += time.perf_counter() - tb
            del staging
        self.store.set(_key(spec, version, f"done{me}"), b"1")
        self.peak_bytes = peak
        self.last_stats = {"transfer_s": transfer, "verify_s": 0.0, "land_s": land,
                           "total_s": time.perf_counter() - t0, "elements_received": received,
                           "peak_extra_bytes": peak}

    def begin_landing(self, tables: Mapping[SrcRank, dict]) -> None:
        """Start checking one sync's landing against the senders' published ``tables``."""
        self._tables = dict(tables)
        self._landed: dict[str, dict[str, int]] = {}  # engine parameter -> its HF tensors' checksums
        self._unsent: set[str] = set()  # engine weights no layout covers
        self._verify_s = 0.0

    def check_landed(self, name: str, landed: torch.Tensor) -> None:
        """Checksum parameter ``name`` as the engine holds it after landing (its local layout)."""
        layout = self.layouts.get(name)
        if layout is None:
            if name.endswith((".weight", ".bias")):  # a weight DDMA sends nothing for (quantization
                self._unsent.add(name)                 # scales are the engine's own): never right
            return
        t = time.perf_counter()
        flat = landed.detach().reshape(-1)
        if flat.dtype != _engine_dtype(self.spec) or flat.numel() != math.prod(layout.local_shape):
            raise DdmaVerifyError(f"ddma: engine parameter {name} landed as {landed.dtype} {tuple(landed.shape)}; "
                                  f"the sync sent {self.spec.engine_dtype} {tuple(layout.local_shape)}")
        sums: dict[str, int] = collections.defaultdict(int)
        self._checksum(flat, name, layout, sums)
        self._landed[name] = sums  # a parameter reported again replaces its earlier report
        self._verify_s += time.perf_counter() - t

    def verify_landed(self, version: int) -> None:
        """After the engine landed weights ``version``: every parameter landed, and its checksums
        are the senders'. Raises :class:`DdmaVerifyError`."""
        if not self.spec.verifies(version):
            return
        t = time.perf_counter()
        if self._unsent:
            raise DdmaVerifyError(
                f"ddma verification failed on generator replica {self.rank.replica} tp {self.rank.tp}: the engine "
                f"has {len(self._unsent)} weight(s) that no DDMA layout sends, so they keep stale or uninitialised "
                f"values: {sorted(self._unsent)[:4]} (a model variant outside megarl/models/families.py?)")
        missing = [n for n in self.layouts if n not in self._landed]
        if missing:
            raise DdmaVerifyError(
                f"ddma verification failed on generator replica {self.rank.replica} tp {self.rank.tp}: "
                f"{len(missing)} parameter(s) never landed in the engine after weights v{version}: {missing[:4]}")
        sums: dict[str, int] = collections.defaultdict(int)
        for per_param in self._landed.values():
            for hf_name, v in per_param.items():
                sums[hf_name] = (sums[hf_name] + v) & 0xFFFFFFFFFFFFFFFF
        self._compare(sums, self._tables)
        self._verify_s += time.perf_counter() - t
        self.last_stats["verify_s"] = self._verify_s

    def _pull(self, pid: int, entry: dict, src_off: torch.Tensor, dst_addr: torch.Tensor, nbytes: torch.Tensor) -> None:
        """Copy runs (byte offsets in the sender's tensor ``entry``) to local addresses: memcpy out of
        the sender's shared memory mapped here, or process_vm_readv where mapping is not allowed."""
        maps = self.__dict__.setdefault("_maps", {})
        key = (pid, entry["fd"], entry["key"])
        if key not in maps:
            maps[key] = map_shared(pid, entry["fd"], entry["size"]) if self.spec.zero_copy_via == "map" else None
            if maps[key] is None and self.spec.zero_copy_via == "map":
                log.warning("ddma: cannot map trainer pid %d's shared memory; reading with process_vm_readv", pid)
        mapped = maps[key]
        if mapped is not None:
            copy_runs(src_off + (mapped.data_ptr() + entry["offset"]), dst_addr, nbytes)
        else:
            read_runs(pid, src_off + entry["ptr"], dst_addr, nbytes)

    def _byte_runs(self, s: SrcRank, copies: list[Copy], es: int) -> tuple[torch.Tensor, ...]:
        """(src byte offsets, dst byte offsets, byte counts) of these copies, computed once."""
        cache = self.__dict__.setdefault("_byte_runs_cache", {})
        key = (s, copies[0].dst_param, es)
        if key not in cache:
            cache[key] = tuple(torch.tensor([getattr(c, f) * es for c in copies], dtype=torch.int64)
                               for f in ("src_offset", "dst_offset", "numel"))
        return cache[key]

    def _land(self, flat: torch.Tensor, s: SrcRank, copies: list[Copy], table: dict,
              scale_cache: dict) -> int:
        """Copy ``copies`` from trainer rank ``s`` into the staging tensor; returns scratch bytes."""
        spec = self.spec
        src_shape = self.plan.src_shapes[s][copies[0].src_param]
        fp8 = _is_fp8(spec, tuple(src_shape))
        es = 1 if fp8 else flat.element_size()
        n = sum(c.numel for c in copies)
        if spec.transport == "zero_copy":
            entry = table["params"][copies[0].src_param]
            if not fp8:
                src_b, dst_b, n_b = self._byte_runs(s, copies, es)
                self._pull(table["pid"], entry, src_b, dst_b + flat.data_ptr(), n_b)
                return 0
            buf = torch.empty(n, dtype=torch.uint8)
            offs = torch.cumsum(torch.tensor([0] + [c.numel for c in copies[:-1]]), 0)
            self._pull(table["pid"], entry, torch.tensor([c.src_offset for c in copies]), offs + buf.data_ptr(),
                       torch.tensor([c.numel for c in copies]))
            key = (s, copies[0].src_param)
            if key not in scale_cache:
                rows = src_shape[0]
                sc = torch.empty(rows, dtype=torch.float32)
                self._pull(table["pid"], table["scales"][key[1]], torch.zeros(1, dtype=torch.int64),
                           torch.tensor([sc.data_ptr()]), torch.tensor([4 * rows]))
                scale_cache[key] = sc
            src_idx = run_indices([c.src_offset for c in copies], [c.numel for c in copies])
            scale = scale_cache[key][src_idx // src_shape[1]]
        else:
            pg = self.pg(self.group_rank(self.rank))
            buf = torch.empty(n, dtype=torch.uint8 if fp8 else flat.dtype)
            pg.recv([buf], self.group_rank(s), 0).wait()
            if not fp8:
                off = 0
                for c in copies:
                    flat[c.dst_offset:c.dst_offset + c.numel].copy_(buf[off:off + c.numel])
                    off += c.numel
                return buf.numel() * es
            cols = src_shape[1]
            spans = [_rows(c, cols) for c in copies]
            seg = torch.empty(sum(b - a for a, b in spans), dtype=torch.float32)
            pg.recv([seg], self.group_rank(s), 0).wait()
            # element -> index into seg: its source row, relative to its copy's first row, plus the
            # copy's segment start
            seg_start = torch.cumsum(torch.tensor([0] + [b - a for a, b in spans[:-1]]), 0)
            lens = torch.tensor([c.numel for c in copies])
            src_idx = run_indices([c.src_offset for c in copies], [c.numel for c in copies])
            first_row = torch.repeat_interleave(torch.tensor([a for a, _ in spans]), lens)
            scale = seg[src_idx // cols - first_row + torch.repeat_interleave(seg_start, lens)]
        dst_idx = run_indices([c.dst_offset for c in copies], [c.numel for c in copies])
        flat[dst_idx] = _dequant(buf, scale, flat.dtype)
        return buf.numel() + 4 * scale.numel() + 8 * dst_idx.numel()

    def _checksum(self, flat: torch.Tensor, dparam: str, layout, sums: dict[str, int]) -> None:
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
            sums[name] = (sums[name] + checksum_segments(flat, segs)) & 0xFFFFFFFFFFFFFFFF

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
            itemsize = _engine_dtype(self.spec).itemsize
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


__all__ = ["SyncSpec", "DdmaSender", "DdmaReceiver", "DdmaVerifyError", "host_store", "gloo_group", "TRANSPORTS", "WIRES"]
