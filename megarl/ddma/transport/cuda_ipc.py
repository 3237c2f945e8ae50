"""The ``cuda_ipc`` transport (same host, CUDA): workers copy device-to-device out of the trainer's
exported CUDA buffers. No host memory on the path.

Designed against the failures peers hit with CUDA IPC weight sync:

- **A reused sender buffer raced the receiver's copy** (slime #929, #2220). The sender synchronizes
  its stream before publishing (its conversion kernels are done when a worker reads), and returns
  from :meth:`CudaIpcTransport.send` only after every worker acknowledged the version; a worker
  acknowledges only after synchronizing its own stream (its copies are done). The trainer steps, and
  the sender rewrites its buffers, only after that.
- **IPC handles pinned memory until ``torch.cuda.ipc_collect()``** (slime PR #1731, miles PR #3147):
  handles are exported **once per topology** and again only when a storage changes
  (:class:`ExportCache`), workers keep what they opened (:class:`OpenCache`), and both sides call
  ``ipc_collect`` after every sync. ``tools/gpu_ddma_ipc.py`` measures device memory flat over N syncs.
- **One export, one consumer.** Each ``reduce_tensor`` of a CUDA storage (``_share_cuda_``) gets a
  reference counter of its own in torch's shared counter file, which the one process that opens it
  decrements when it lets go (torch/csrc/CudaIPCTypes.cpp); the sender's memory is reusable once it
  reaches zero. One export opened by N workers would be released by the first of them while the
  others still read. So a storage is exported once **per worker that reads it** (the plan says which),
  and each worker opens its own handle.
- **The receiver's device.** ``reduce_tensor``'s arguments carry the *sender's* device index
  (argument 6, ``storage_device``: 0 in every process under per-rank ``CUDA_VISIBLE_DEVICES``);
  opened as is, a vLLM TP worker on its cuda:1 would map the memory on cuda:0, another worker's GPU.
  :meth:`CudaIpcOps.open` rewrites it to the worker's local device, as vLLM's RLHF example and verl do.
- **One handle per tensor was 4x slower than flattened buckets** (vime #175): one handle per
  storage. Converted wire tensors (another dtype, FP8 codes and scales) live in buckets of
  ``spec.bucket_bytes`` (:func:`megarl.ddma.transport.base.plan_buckets`); same-dtype wire tensors are
  views of the trainer's parameters and share their storages (one handle per storage).
- **Containers without ptrace permission cannot open IPC handles** (NeMo-RL #2293): a failed open is
  explained (:func:`explain_open_failure` probes ``pidfd_getfd`` on the sender, the permission
  torch's expandable-segment IPC needs, and reads Yama's ``ptrace_scope``) and names the fallback,
  ``sync.transport=nccl``. Under Yama ``ptrace_scope=1`` only a process's ancestors, or the processes
  it names with ``prctl(PR_SET_PTRACER)``, pass that check, and a generator worker is no ancestor of a
  trainer rank: the sender names any process, as zero_copy's does (:func:`allow_readers`).

The CUDA calls sit behind :class:`CudaIpcOps` (export, open, synchronize, collect); everything else
(bucketing, the handle caches, the acknowledgement protocol, run copies) is plain torch and runs in
the CPU test suite with a host-memory stand-in for those four calls (tests/e2e/test_ddma_cuda_ipc.py,
named there as the GPU-boundary double).
"""

from __future__ import annotations

import ctypes
import errno
import math
import os

import torch

from megarl.ddma.runs import copy_blocks, dequant_blocks, fp8_blocks, land_views, source_views
from megarl.ddma.transport.base import DdmaTransportError, Transport, is_fp8
from megarl.ddma.transport.zero_copy import allow_readers

_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438  # x86_64 and aarch64 share these numbers


class CudaIpcOps:
    """The four CUDA calls the transport makes (the GPU-only boundary). Its doubles in the tests take
    the same arguments (tests/e2e/test_cuda_api_drift.py checks the signatures)."""

    device_type = "cuda"  # the memory its handles share

    def export(self, storage_bytes: torch.Tensor):
        """A picklable handle of a CUDA uint8 tensor spanning one whole storage, for one consumer
        (each export has a reference count of its own: see the module docstring)."""
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(storage_bytes)

    def open(self, handle, device: torch.device) -> torch.Tensor:
        """The exported tensor, mapped on ``device`` (this worker's): ``reduce_tensor``'s argument 6 is
        the sender's device index, rewritten here (see :func:`on_device`)."""
        fn, args = on_device(handle, device)
        return fn(*args)

    def synchronize(self, device: torch.device) -> None:
        """Wait for all work on ``device`` (the wire's, on a sender; the staging's, on a worker), not
        the calling thread's current device, which need not be that one."""
        torch.cuda.synchronize(device)

    def collect(self) -> None:
        torch.cuda.ipc_collect()


STORAGE_DEVICE_ARG = 6  # torch.multiprocessing.reductions.rebuild_cuda_tensor's storage_device


def on_device(handle, device: torch.device):
    """``reduce_tensor``'s ``(rebuild_cuda_tensor, args)`` with ``args[6]`` (``storage_device``, the
    sender's device index) replaced by ``device``'s index (the current device for a bare "cuda")."""
    fn, args = handle
    index = device.index if device.index is not None else torch.cuda.current_device()
    args = list(args)
    args[STORAGE_DEVICE_ARG] = index
    return fn, tuple(args)


IPC_OPS: CudaIpcOps = CudaIpcOps()  # the tests swap in their host-memory double


def storage_key(t: torch.Tensor) -> str:
    s = t.untyped_storage()
    return f"{t.device}:{s.data_ptr():x}:{s.nbytes()}"


class _Export:
    """One exported storage: a weak reference (a storage freed and reallocated at the same address is
    a new one), the key workers know it by, and one handle per worker that reads it."""

    def __init__(self, storage: torch.UntypedStorage, key: str):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref, self.key, self.handles = StorageWeakRef(storage), key, {}


class ExportCache:
    """Sender side: one exported handle per (storage, reading worker), exported once and again only
    when the storage behind a wire tensor changes (a new allocation, even at the same address) or a
    worker reads it for the first time. ``exports`` counts real exports."""

    def __init__(self, ops: CudaIpcOps):
        self.ops = ops
        self.entries: dict[str, _Export] = {}
        self.exports = 0
        self._serial = 0

    @property
    def handles(self) -> dict[str, dict]:
        return {e.key: e.handles for e in self.entries.values()}

    def table(self, tensors: dict, readers: dict | None = None) -> dict:
        """``{"buckets": {key: {worker: handle}}, "where": {name: (key, byte offset)}}``; ``readers``:
        the workers (group ranks) that read each tensor (None: worker 0 reads every tensor)."""
        where, live = {}, {}
        for name, t in tensors.items():
            k = storage_key(t)
            entry = self.entries.get(k)
            if entry is None or entry.ref.expired():
                self._serial += 1
                entry = _Export(t.untyped_storage(), f"{k}#{self._serial}")
            for r in (0,) if readers is None else readers.get(name, ()):
                if r not in entry.handles:
                    s = t.untyped_storage()
                    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))
                    entry.handles[r] = self.ops.export(whole)
                    self.exports += 1
            k = storage_key(t)  # the same key on CUDA; a host double may move the storage into shm
            self.entries[k] = live[k] = entry
            where[name] = (entry.key, t.data_ptr() - t.untyped_storage().data_ptr())
        for k in set(self.entries) - set(live):  # storages no wire tensor uses any more
            del self.entries[k]
        return {"buckets": {e.key: dict(e.handles) for e in live.values()}, "where": where}


class OpenCache:
    """Worker side: each sender storage opened once; reopened only when its key's handle changes."""

    def __init__(self, ops: CudaIpcOps):
        self.ops = ops
        self.opened: dict[tuple[int, str], torch.Tensor] = {}
        self.opens = 0

    def get(self, pid: int, k: str, handle, device: torch.device) -> torch.Tensor:
        if (pid, k) not in self.opened:
            try:
                self.opened[(pid, k)] = self.ops.open(handle, device)
            except Exception as e:  # noqa: BLE001 - CUDA raises RuntimeError with many causes
                raise DdmaTransportError(explain_open_failure(pid, e)) from e
            self.opens += 1
        return self.opened[(pid, k)]

    def keep_only(self, live: set[tuple[int, str]]) -> None:
        for k in set(self.opened) - live:
            del self.opened[k]


def ptrace_permitted(pid: int) -> bool | None:
    """Whether this process may take file descriptors from ``pid`` (``pidfd_getfd``: the ptrace
    permission torch's CUDA IPC of expandable segments needs); None where the kernel lacks the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        return None if ctypes.get_errno() == errno.ENOSYS else False
    try:
        fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, 0, 0)  # the peer's fd 0 (always open)
        if fd < 0:
            err = ctypes.get_errno()
            return None if err == errno.ENOSYS else (False if err in (errno.EPERM, errno.EACCES) else None)
        os.close(fd)
        return True
    finally:
        os.close(pidfd)


def yama_ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope`` (0 classic, 1 restricted to ancestors and named tracers,
    2 CAP_SYS_PTRACE only, 3 none); None without Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


_DENIED = {
    1: "Yama ptrace_scope=1 lets a process take another's file descriptors (pidfd_getfd, which torch's CUDA "
       "IPC of expandable segments uses) only if it is that process's ancestor or was named by it with "
       "prctl(PR_SET_PTRACER); this generator worker is no ancestor of trainer pid {pid}, and that trainer did "
       "not name it (megarl's cuda_ipc sender names any process when it starts: a trainer that is not megarl's, "
       "or a seccomp profile that blocks prctl?). Set kernel.yama.ptrace_scope=0, or give the worker "
       "CAP_SYS_PTRACE",
    2: "Yama ptrace_scope=2 lets only processes with CAP_SYS_PTRACE take another's file descriptors "
       "(pidfd_getfd, which torch's CUDA IPC of expandable segments uses), and this generator worker lacks it. "
       "Give it CAP_SYS_PTRACE",
    3: "Yama ptrace_scope=3 forbids taking another process's file descriptors (pidfd_getfd, which torch's "
       "CUDA IPC of expandable segments uses) to every process until reboot. Turn off expandable segments in "
       "the trainer (PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True)",
}


def explain_open_failure(pid: int, error: BaseException) -> str:
    """The error a worker raises when it cannot open trainer ``pid``'s CUDA IPC handle: the cause the
    ptrace probe and Yama's scope point at, and the fallback."""
    allowed, scope = ptrace_permitted(pid), yama_ptrace_scope()
    if allowed is False and scope in _DENIED:
        why = _DENIED[scope]
    else:
        why = {False: "this process may not take trainer pid {pid}'s file descriptors (pidfd_getfd, which torch's "
                      "CUDA IPC of expandable segments needs): no CAP_SYS_PTRACE in this container, another user, "
                      "or a seccomp profile that forbids pidfd_getfd",
               None: "the kernel did not say whether ptrace is allowed; CUDA IPC also needs both processes to see "
                     "the same GPU and share the IPC namespace",
               True: "ptrace is allowed, so the cause is elsewhere: both processes must see the same GPU "
                     "(CUDA_VISIBLE_DEVICES) and share the IPC namespace (docker --ipc=host)"}[allowed]
    return (f"ddma cuda_ipc: cannot open trainer pid {pid}'s CUDA IPC handle ({type(error).__name__}: {error}); "
            f"{why.format(pid=pid)}. Fallback: set sync.transport=nccl (point-to-point, no IPC handles), or "
            f"grant ptrace (docker --cap-add=SYS_PTRACE --ipc=host)")


class CudaIpcTransport(Transport):
    name, moves = "cuda_ipc", "cuda"

    def __init__(self, side, ops: CudaIpcOps | None = None):
        super().__init__(side)
        self.ops = ops or IPC_OPS
        self.exports = ExportCache(self.ops)
        self.opens = OpenCache(self.ops)
        self._readers: dict | None = None
        # worker: (sender, engine param) -> ((pid, storage key, byte offset), source_views of its blocks):
        # a sync whose sender exported the same storage lands with the views of the last one
        self._views: dict = {}
        if hasattr(side, "outgoing"):  # a sender: let its workers take its fds under Yama ptrace_scope=1
            allow_readers()

    def check_wire(self, wire) -> None:
        self.moves = self.ops.device_type
        super().check_wire(wire)

    def stats(self) -> dict:
        return {**super().stats(), "ipc_exports": self.exports.exports, "ipc_opens": self.opens.opens}

    # -- sender ---------------------------------------------------------------------------------
    def readers(self) -> dict:
        """``{("w" | "s", source param): [group ranks of the workers that read it]}`` (from the plan)."""
        if self._readers is None:
            side, readers = self.side, {}
            for d, _, copies in side.outgoing:
                for c in copies:
                    kinds = ("w", "s") if is_fp8(self.spec, tuple(side.params[c.src_param].shape)) else ("w",)
                    for kind in kinds:
                        readers.setdefault((kind, c.src_param), set()).add(side.group_rank(d))
            self._readers = {k: sorted(v) for k, v in readers.items()}
        return self._readers

    def publish(self, wire, scales) -> dict:
        if wire:  # conversions done before any worker reads (no stream order across processes)
            self.ops.synchronize(next(iter(wire.values())).device)
        table = self.exports.table({**{("w", n): t for n, t in wire.items()},
                                    **{("s", n): t for n, t in scales.items()}}, self.readers())
        return {"ipc": table, "dtypes": {n: str(t.dtype).removeprefix("torch.") for n, t in wire.items()}}

    def send(self, version, wire, scales) -> int:
        self.wait_acks(version)  # nobody reads our buffers any more: the trainer may step
        self.ops.collect()
        return 0

    # -- receiver -------------------------------------------------------------------------------
    def _source(self, table: dict, kind: str, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        k, off = table["ipc"]["where"][(kind, name)]
        mine = table["ipc"]["buckets"][k][self.side.group_rank(self.side.rank)]  # this worker's own export
        whole = self.opens.get(table["pid"], k, mine, self.side.device)
        return whole[off:off + numel * dtype.itemsize].view(dtype)

    def _blocks(self, s, copies, fp8_cols: int | None) -> tuple[tuple[int, ...], ...]:
        """This (sender, parameter)'s landing blocks, built once per plan (O(runs) host ints, no device
        memory): engine dtype, strided copies out of the sender's wire tensor; FP8, dequantization
        blocks over its codes (source layout) and its whole scale vector (row r: scale r)."""
        k = (s, copies[0].dst_param)
        if fp8_cols is None:
            return self.table(k, lambda: copy_blocks([c.src_offset for c in copies], [c.dst_offset for c in copies],
                                                     [c.numel for c in copies]))
        return self.table(k, lambda: fp8_blocks([c.src_offset for c in copies], [c.src_offset for c in copies],
                                                [c.dst_offset for c in copies], [c.numel for c in copies],
                                                [0] * len(copies), fp8_cols))

    def land(self, flat, s, copies, table, scale_cache) -> int:
        name = copies[0].src_param
        where = (table["pid"], *table["ipc"]["where"][("w", name)])  # the sender's storage and offset
        hit = self._views.get((s, copies[0].dst_param))
        if hit is not None and hit[0] == where:  # the same export as the last sync: only dst views to make
            land_views(flat, hit[1])
            return 0
        src_shape = tuple(self.side.plan.src_shapes[s][name])
        numel = math.prod(src_shape)
        if not is_fp8(self.spec, src_shape):
            src = self._source(table, "w", name, flat.dtype, numel)
            views = self._views[(s, copies[0].dst_param)] = (where, source_views(src, self._blocks(s, copies, None)))
            land_views(flat, views[1])
            return 0
        codes = self._source(table, "w", name, torch.uint8, numel).to(flat.device)
        scales = self._source(table, "s", name, torch.float32, src_shape[0]).to(flat.device)
        return dequant_blocks(flat, codes, scales, self._blocks(s, copies, src_shape[1]))

    def ack(self, version: int) -> None:
        self.ops.synchronize(self.side.device)  # our copies out of the senders' buffers are done
        # Let go of storages the senders no longer export *before* acknowledging: the sender's
        # ipc_collect right after the last ack then finds their reference counts at zero and frees them
        # (after the ack, it could run first, and a freed bucket stayed held until the next sync).
        live = {(t["pid"], k) for t in self.side.tables.values() for k in t["ipc"]["buckets"]}
        self.opens.keep_only(live)
        self._views = {k: v for k, v in self._views.items() if v[0][:2] in live}  # their views hold them too
        self.ops.collect()
        super().ack(version)


__all__ = ["CudaIpcTransport", "CudaIpcOps", "ExportCache", "OpenCache", "IPC_OPS", "ptrace_permitted",
           "explain_open_failure", "storage_key", "on_device", "yama_ptrace_scope", "STORAGE_DEVICE_ARG"]
