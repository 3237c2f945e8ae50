"""The one small interface every DDMA transport implements, and what they share.

A transport is made per side (:class:`megarl.ddma.sync.DdmaSender` or ``DdmaReceiver``, reached as
``self.side``: its spec, plan, store, ranks) and moves one sync's bytes:

- sender: :meth:`Transport.publish` adds what receivers need to the sender's store table (addresses,
  handles), then :meth:`Transport.send` moves or exposes the bytes and returns only when no receiver
  will read the sender's buffers again for this version (so the trainer may step / reuse them);
- receiver: :meth:`Transport.receive_params` yields ``(param, staging, held_bytes, elements)`` one engine
  parameter at a time in vLLM's local layout (each staging tensor its own), and :meth:`Transport.ack`
  tells the senders this worker is done with their buffers.

The default :meth:`Transport.receive_params` allocates a parameter's staging tensor and lands each
sender's copies into it with :meth:`Transport.land`; a transport that moves several parameters at
once (nccl) overrides it.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterator
from datetime import timedelta

import torch

from megarl.ddma.plan import Copy
from megarl.ddma.runs import dequant_blocks, fp8_blocks
from megarl.ddma.verify import run_indices

log = logging.getLogger("megarl.ddma")

FP8 = torch.float8_e4m3fn
ALIGN = 256  # bytes: every tensor placed in a bucket starts on a 256-byte boundary (CUDA allocations do)


class DdmaTransportError(RuntimeError):
    """A transport cannot run here (permissions, devices); the message names the fallback to set."""


def key(version: int, what: str) -> str:
    return f"ddma/v{version}/{what}"


def engine_dtype(spec) -> torch.dtype:
    return getattr(torch, spec.engine_dtype)


def is_fp8(spec, shape: tuple[int, ...]) -> bool:
    return spec.wire == "fp8" and len(shape) == 2


def dequant(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one dequantization both sides use (so checksums agree): float32 product, then cast."""
    return (q.view(FP8).float() * scale).to(dtype)


def rows_of(c: Copy, cols: int) -> tuple[int, int]:
    """First and one-past-last source row an FP8 copy's elements come from."""
    return c.src_offset // cols, (c.src_offset + c.numel - 1) // cols + 1


def wait_keys(store, keys: list[str], what: str, timeout_s: float) -> None:
    log.info("ddma: waiting for %s (timeout %.0f s)", what, timeout_s)
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
        missing = [k for k in keys if not store.check([k])]
        raise TimeoutError(f"ddma: timed out after {timeout_s:.0f} s waiting for {what}; "
                           f"missing: {missing[:8]}") from e


def group_prefix(store, base: str, rank: int) -> str:
    """The store prefix of the group that group rank ``rank`` builds now under ``base``: ``base/<n>`` for
    its n-th build on this store. Each rank counts its own builds (``store.add`` on a key of its own), so
    the ranks that build a group together agree on ``n`` without a message, and a second group on the
    same store never reads the first one's keys (NCCL's unique id is stored under a per-group counter
    that starts at 0 again; gloo's rendezvous addresses likewise), which under one fixed prefix made a
    second group connect to a stale id."""
    return f"{base}/{store.add(f'{base}/builds/rank{rank}', 1)}"


def gloo_group(store, rank: int, size: int, timeout_s: float, prefix: str = "ddma/gloo"):
    """A gloo process group of its own, built directly on ``store`` (no global world touched), under a
    prefix of its own (:func:`group_prefix`). Gloo connects every pair of ranks here, in the constructor."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(torch.distributed.PrefixStore(group_prefix(store, prefix, rank), store), rank, size,
                            timedelta(seconds=timeout_s))


def packed_fp8_blocks(copies: list[Copy], cols: int) -> tuple[tuple[int, ...], ...]:
    """The landing blocks (:func:`megarl.ddma.runs.fp8_blocks`) of one sender's FP8 message for one
    parameter, laid out as :func:`land_fp8` takes it: the copies' codes concatenated, then each copy's
    source-row span of scales concatenated. O(copies); a transport computes it once per plan."""
    code_starts, scale_bases, pos, seg = [], [], 0, 0
    for c in copies:
        a, b = rows_of(c, cols)
        code_starts.append(pos)
        scale_bases.append(seg - a)  # scale of source row r: scale_seg[seg - a + r]
        pos += c.numel
        seg += b - a
    return fp8_blocks(code_starts, [c.src_offset for c in copies], [c.dst_offset for c in copies],
                      [c.numel for c in copies], scale_bases, cols)


def land_fp8(flat: torch.Tensor, copies: list[Copy], cols: int, codes: torch.Tensor, scale_seg: torch.Tensor,
             blocks=None) -> int:
    """Dequantize one sender's FP8 message for one parameter into ``flat``: ``codes`` uint8 (the
    copies' elements, concatenated), ``scale_seg`` float32 (each copy's source-row span of scales,
    concatenated), block by block (``blocks``: :func:`packed_fp8_blocks` of these copies, computed here
    when not given). No per-element index. Returns the scratch bytes used. Runs on ``flat``'s device."""
    if blocks is None:
        blocks = packed_fp8_blocks(copies, cols)
    dev = flat.device
    return dequant_blocks(flat, codes.to(dev), scale_seg.to(dev), blocks)


def land_fp8_per_element(flat: torch.Tensor, copies: list[Copy], cols: int, codes: torch.Tensor,
                         scale_seg: torch.Tensor) -> int:
    """The FP8 landing before issue 46: two int64 indices and a float32 scale per element, rebuilt on
    the CPU at every call (16+ B/element). Kept only as the reference the tests compare
    :func:`land_fp8` with and the "before" of ``megarl bench sync``'s landing figure; nothing lands with it."""
    dev = flat.device
    spans = [rows_of(c, cols) for c in copies]
    seg_start = torch.cumsum(torch.tensor([0] + [b - a for a, b in spans[:-1]]), 0)
    lens = torch.tensor([c.numel for c in copies])
    src_idx = run_indices([c.src_offset for c in copies], [c.numel for c in copies])
    first_row = torch.repeat_interleave(torch.tensor([a for a, _ in spans]), lens)
    scale = scale_seg[(src_idx // cols - first_row + torch.repeat_interleave(seg_start, lens)).to(dev)]
    dst_idx = run_indices([c.dst_offset for c in copies], [c.numel for c in copies]).to(dev)
    flat[dst_idx] = dequant(codes, scale, flat.dtype)
    return codes.numel() + 4 * scale.numel() + 8 * dst_idx.numel()


def plan_buckets(sizes: list[int], budget: int, align: int = ALIGN) -> list[list[tuple[int, int]]]:
    """Pack tensors of ``sizes`` bytes, in order, into buckets of at most ``budget`` bytes (a tensor
    larger than the budget gets a bucket of its own). Returns, per bucket, ``(index, byte offset)`` of
    each tensor it holds; offsets are multiples of ``align``."""
    if budget < 1:
        raise ValueError(f"bucket budget must be >= 1 byte, got {budget}")
    buckets: list[list[tuple[int, int]]] = []
    used = budget + 1  # forces a first bucket
    for i, n in enumerate(sizes):
        start = -(-used // align) * align
        if not buckets or start + n > budget:
            buckets.append([])
            start = 0
        buckets[-1].append((i, start))
        used = start + n
    return buckets


class Transport:
    """One side's transport for one :class:`~megarl.ddma.sync.SyncSpec` (see the module docstring)."""

    name = "base"
    moves = "cpu"  # the device whose memory it moves: "cpu" or "cuda"
    lands_in_place = False  # whether :meth:`land` may write straight into an engine's own tensors
                            # (DdmaReceiver.receive_into); False: they get staging tensors' copies

    def __init__(self, side):
        self.side = side
        self.spec = side.spec
        self._tables: dict = {}  # landing tables (blocks of runs), built once per plan: see :meth:`table`
        self._order: list | None = None  # receiver: :meth:`_receive_order`, built once per plan
        self._index_bytes = 0  # what the tables hold (:meth:`index_bytes`)

    # -- sender ---------------------------------------------------------------------------------
    def check_wire(self, wire: dict[str, torch.Tensor]) -> None:
        """Refuse wire tensors on a device this transport cannot move (names the transport to set)."""
        for name, t in wire.items():
            if t.device.type != self.moves:
                if t.device.type not in ("cpu", "cuda"):
                    raise DdmaTransportError(f"ddma: {name} is on {t.device}; DDMA moves host or CUDA memory")
                fit = {"cpu": "zero_copy (same host) or gloo", "cuda": "cuda_ipc (same host) or nccl"}[t.device.type]
                raise DdmaTransportError(f"ddma transport {self.name} moves {self.moves} memory but {name} is on "
                                         f"{t.device}: use sync.transport=auto or {fit}")

    def publish(self, wire: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> dict:
        return {}

    def stats(self) -> dict:
        """Transport-specific counters of the last sync (merged into the side's stats); ``index_bytes``:
        what this side's landing tables hold (:meth:`index_bytes`)."""
        return {"index_bytes": self.index_bytes()}

    def table(self, key, make):
        """The landing table under ``key`` (blocks of runs, :mod:`megarl.ddma.runs`), made by ``make()``
        the first time and kept: computed once per plan, O(runs) memory, on the host."""
        if key not in self._tables:
            t = self._tables[key] = make()
            for part in (t if isinstance(t, tuple) else (t,)):  # counted once, as made: tables never change
                self._index_bytes += part.numel() * part.element_size() if isinstance(part, torch.Tensor) \
                    else 8 * len(part)
        return self._tables[key]

    def index_bytes(self) -> int:
        """Bytes held by this side's run tables (int64 per integer; index tensors by their size)."""
        return self._index_bytes

    def send(self, version: int, wire: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> int:
        """Move this sender's bytes for ``version``; returns the most scratch bytes held at once."""
        raise NotImplementedError

    def wait_acks(self, version: int) -> None:
        """Return once every generator worker acknowledged ``version`` (its reads of our buffers are done)."""
        side = self.side
        done = [key(version, f"done{side.group_rank(d)}") for d in side.dst_ranks]
        wait_keys(side.store, done, f"{len(done)} generator worker(s) to read weights v{version} from trainer "
                  f"rank {side.rank}", self.spec.timeout_s)

    # -- receiver -------------------------------------------------------------------------------
    def receive_params(self, version: int) -> Iterator[tuple[str, torch.Tensor, int, int]]:
        side = self.side
        dtype, device, tables, scale_cache = engine_dtype(self.spec), side.device, side.tables, {}
        for dparam, shape, alloc, elements, incoming in self._receive_order():
            staging = alloc(shape, dtype=dtype, device=device)
            flat = staging.view(-1)
            held = flat.numel() * flat.element_size()
            for s, copies in incoming:
                held += self.land(flat, s, copies, tables[s], scale_cache)
            yield dparam, staging, held, elements

    def _receive_order(self) -> list[tuple]:
        """The worker's parameters in landing order, each ``(name, local shape, allocator, elements
        received, [(sender, copies)])``, from the plan once (not counted again at every sync)."""
        if self._order is None:
            side, order = self.side, []
            for dparam, layout in side.layouts.items():
                incoming = side.incoming[dparam]
                elements = sum(c.numel for _, cs in incoming for c in cs)
                # vocab padding rows: no sender writes them
                alloc = torch.zeros if elements < math.prod(layout.local_shape) else torch.empty
                order.append((dparam, tuple(layout.local_shape), alloc, elements, incoming))
            self._order = order
        return self._order

    def land(self, flat: torch.Tensor, s, copies: list[Copy], table: dict, scale_cache: dict) -> int:
        """Copy ``copies`` from trainer rank ``s`` into ``flat``; returns scratch bytes."""
        raise NotImplementedError

    def land_digest(self, flat: torch.Tensor, s, copies: list[Copy], table: dict, scale_cache: dict,
                    runs) -> tuple[int, torch.Tensor | None]:
        """:meth:`land`, and where this transport's copy is ours, the verification digests of what it
        wrote, computed in the same pass (``runs``: the copies as HF-affine runs, DdmaReceiver.digest_runs).
        Returns (scratch bytes, one int64 digest per group of ``runs``, or None: checksum ``flat`` after)."""
        return self.land(flat, s, copies, table, scale_cache), None

    def ack(self, version: int) -> None:
        """This worker is done reading the senders' buffers for ``version``."""
        side = self.side
        side.store.set(key(version, f"done{side.group_rank(side.rank)}"), b"1")


def outgoing_by_param(side) -> dict:
    """Receiver side: ``{dst_param: [(src_rank, copies)]}`` in sender order (from the plan)."""
    incoming: dict[str, list] = {p: [] for p in side.layouts}
    for s in side.src_ranks:
        by_param: dict[str, list[Copy]] = collections.defaultdict(list)
        for c in side.plan.pairs.get((s, side.rank), ()):
            by_param[c.dst_param].append(c)
        for p, cs in by_param.items():
            incoming[p].append((s, cs))
    return incoming


__all__ = ["Transport", "DdmaTransportError", "FP8", "key", "engine_dtype", "is_fp8", "dequant", "rows_of",
           "wait_keys", "group_prefix", "gloo_group", "land_fp8", "land_fp8_per_element", "packed_fp8_blocks",
           "plan_buckets"]
