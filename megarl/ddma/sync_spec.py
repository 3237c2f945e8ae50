"""What both sides of a DDMA sync share (megarl/ddma/sync.py tells the whole sync): the picklable
:class:`SyncSpec` they build the same plan from, the plan less what a partial sync skips, the rendezvous
store, the store key of what a worker's verification found, and :class:`_Side`, the base of
:class:`~megarl.ddma.sender.DdmaSender` and :class:`~megarl.ddma.receiver.DdmaReceiver`."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES
from megarl.ddma.layouts import DstRank, GeneratorTopology, SrcRank, TrainerTopology, vllm_param_layouts
from megarl.ddma.plan import SyncPlan, plan_sync
from megarl.ddma.transport import TRANSPORTS
from megarl.ddma.transport.base import engine_dtype, key
from megarl.ddma.transport.choice import ALIASES
from megarl.models.layouts import ModelDims


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
