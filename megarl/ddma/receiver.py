"""DDMA's receiving side, one per vLLM worker (megarl/ddma/sync.py tells the whole sync): the worker's
parameters one staging tensor at a time (or landed in place), the digests of what landed, and the
verification against the senders' digests."""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
import time
from collections.abc import Iterator, Mapping

import torch

from megarl.ddma.layouts import DstRank, SrcRank
from megarl.ddma.plan import Copy
from megarl.ddma.sync_spec import SyncSpec, _Side, skipped_params, verified_key
from megarl.ddma.transport import get_transport
from megarl.ddma.transport.base import DdmaTransportError, engine_dtype, key, outgoing_by_param, wait_keys
from megarl.ddma.verify import DdmaVerifyError, DigestBatch, hf_segments


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
                self.check_landed(name, params[name])
            self.verify_landed(version)
            return
        self.begin_landing(tables, checks)
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
        self.last_stats["digests"] = self._digests.digests

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
        self.begin_landing(tables, spec.verifies(version))
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
                           "peak_extra_bytes": peak, "transport": spec.transport,
                           "digests": self._digests.digests,  # made while the caller landed (check_landed)
                           **self.transport.stats()}

    def begin_landing(self, tables: Mapping[SrcRank, dict], checks: bool = True) -> None:
        """Start one sync's landing from the senders' published ``tables``; ``checks``: whether it is
        verified (``sync.verify_every``). An unverified sync's :meth:`check_landed` digests nothing: on a
        GPU each digest reads the whole parameter, a second pass over the bytes the sync moved."""
        self.tables = dict(tables)
        self._checks = checks
        self._landed: set[str] = set()  # engine parameters reported; their digests are in _digests
        self._digests = DigestBatch(self._digest_tables, self.digests_deferred)  # (param, HF tensor) -> sum
        self._unsent: set[str] = set()  # engine weights no layout covers
        self._verify_s = 0.0

    def check_landed(self, name: str, landed: torch.Tensor) -> None:
        """Checksum parameter ``name`` as the engine holds it after landing (its local layout); nothing
        on a sync that is not verified."""
        if self._active is not self:
            return self._active.check_landed(name, landed)
        if not self._checks:
            return
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


__all__ = ["DdmaReceiver"]
