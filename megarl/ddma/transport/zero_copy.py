"""The ``zero_copy`` transport (same host, host memory) and its primitives: copy byte runs straight
out of another process's memory.

Two ways, both one copy with no serialization:
- the sender's tensors live in shared memory (:func:`share` moves a storage there in place, once)
  and the receiver maps the sender's file (``/proc/<pid>/fd/<fd>``, :func:`map_shared`) and copies
  its runs with :func:`copy_runs` (plain memcpy);
- otherwise :func:`read_runs` copies them with ``process_vm_readv``.
Both need the receiver to be allowed to inspect the sender (same uid; under Yama ``ptrace_scope=1``
the sender calls :func:`allow_readers`). The C++ versions (csrc/ddma_transport.cpp, GIL released)
are used when built, ctypes otherwise. Where neither is allowed, use the gloo transport.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

from megarl.ddma.transport.base import Transport, is_fp8, land_fp8, log, packed_fp8_blocks, rows_of
from megarl.native import _C

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_IOV_MAX = 1024
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _as_long(t: torch.Tensor | list[int]) -> torch.Tensor:
    return torch.as_tensor(t, dtype=torch.int64)


def read_runs(pid: int, remote: torch.Tensor | list[int], local: torch.Tensor | list[int],
              nbytes: torch.Tensor | list[int]) -> int:
    """Copy ``nbytes[i]`` bytes from address ``remote[i]`` of process ``pid`` to ``local[i]`` here."""
    remote, local, nbytes = _as_long(remote), _as_long(local), _as_long(nbytes)
    if _C is not None and hasattr(_C, "read_runs"):
        return int(_C.read_runs(int(pid), remote, local, nbytes))
    return _read_runs_ctypes(int(pid), remote.tolist(), local.tolist(), nbytes.tolist())


def _read_runs_ctypes(pid: int, remote: list[int], local: list[int], nbytes: list[int]) -> int:
    total = 0
    for first in range(0, len(remote), _IOV_MAX):
        idx = [i for i in range(first, min(first + _IOV_MAX, len(remote))) if nbytes[i]]
        while idx:
            liov = (_Iovec * len(idx))(*[_Iovec(local[i], nbytes[i]) for i in idx])
            riov = (_Iovec * len(idx))(*[_Iovec(remote[i], nbytes[i]) for i in idx])
            want = sum(nbytes[i] for i in idx)
            got = _libc.process_vm_readv(pid, liov, len(idx), riov, len(idx), 0)
            if got <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv from pid {pid} failed: {os.strerror(err)}")
            total += got
            if got == want:
                break
            # partial: drop fully copied runs, shorten the first partially copied one
            for j, i in enumerate(idx):
                if got >= nbytes[i]:
                    got -= nbytes[i]
                    continue
                local[i] += got
                remote[i] += got
                nbytes[i] -= got
                idx = idx[j:]
                break
    return total


def copy_runs(src: torch.Tensor | list[int], dst: torch.Tensor | list[int], nbytes: torch.Tensor | list[int]) -> int:
    """``memcpy(dst[i], src[i], nbytes[i])`` for every i, addresses in this process."""
    src, dst, nbytes = _as_long(src), _as_long(dst), _as_long(nbytes)
    if _C is not None and hasattr(_C, "copy_runs"):
        return int(_C.copy_runs(src, dst, nbytes))
    for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist()):
        ctypes.memmove(d, s, n)
    return int(nbytes.sum())


def share(t: torch.Tensor) -> dict:
    """Put ``t``'s storage in shared memory (in place, once: views keep working) and describe it
    for :func:`map_shared`: the file descriptor, its size, and ``t``'s byte offset in it."""
    storage = t.untyped_storage()
    if not storage.is_shared():
        storage.share_memory_()
    fd, size = storage._share_fd_cpu_()
    return {"fd": int(fd), "size": int(size), "offset": t.data_ptr() - storage.data_ptr(),
            "key": (storage.data_ptr(), int(size)), "ptr": t.data_ptr()}


def map_shared(pid: int, fd: int, size: int) -> torch.Tensor | None:
    """Map another process's shared-memory file (``/proc/pid/fd/fd``) here, read-write shared;
    None when this host does not let us (then read with :func:`read_runs`)."""
    try:
        return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None


def allow_readers() -> bool:
    """Let same-user processes read this process's memory (needed under Yama ptrace_scope=1)."""
    if _C is not None and hasattr(_C, "allow_zero_copy_readers"):
        return bool(_C.allow_zero_copy_readers())
    return _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) == 0


class ZeroCopyTransport(Transport):
    """Senders put their wire tensors in shared memory (in place, once) and publish where each lives;
    each worker copies exactly its runs out of the mapped file (or with process_vm_readv), then acks.
    The sender returns once every worker acked, so it never changes a buffer a worker still reads."""

    name, moves = "zero_copy", "cpu"
    lands_in_place = True

    def __init__(self, side):
        super().__init__(side)
        self._maps: dict = {}
        if hasattr(side, "outgoing"):  # a sender
            allow_readers()

    def publish(self, wire, scales) -> dict:
        return {"params": {n: share(t) for n, t in wire.items()}, "scales": {n: share(sc) for n, sc in scales.items()}}

    def send(self, version, wire, scales) -> int:
        self.wait_acks(version)
        return 0

    def _mapped(self, pid: int, entry: dict) -> torch.Tensor | None:
        """The sender's shared-memory file of ``entry`` mapped here (once), or None: read with
        process_vm_readv (``zero_copy_via=read``, or mapping not allowed)."""
        k = (pid, entry["fd"], entry["key"])
        if k not in self._maps:
            via = self.spec.zero_copy_via
            self._maps[k] = map_shared(pid, entry["fd"], entry["size"]) if via == "map" else None
            if self._maps[k] is None and via == "map":
                log.warning("ddma: cannot map trainer pid %d's shared memory; reading with process_vm_readv", pid)
        return self._maps[k]

    def _pull(self, pid: int, entry: dict, src_off: torch.Tensor, dst_addr: torch.Tensor, nbytes: torch.Tensor) -> None:
        """Copy runs (byte offsets in the sender's tensor ``entry``) to local addresses: memcpy out of
        the sender's shared memory mapped here, or process_vm_readv where mapping is not allowed."""
        mapped = self._mapped(pid, entry)
        if mapped is not None:
            copy_runs(src_off + (mapped.data_ptr() + entry["offset"]), dst_addr, nbytes)
        else:
            read_runs(pid, src_off + entry["ptr"], dst_addr, nbytes)

    def _byte_runs(self, s, copies, es: int) -> tuple[torch.Tensor, ...]:
        """(src byte offsets, dst byte offsets, byte counts) of these copies, computed once."""
        return self.table(("bytes", s, copies[0].dst_param, es),
                          lambda: tuple(torch.tensor([getattr(c, f) * es for c in copies], dtype=torch.int64)
                                        for f in ("src_offset", "dst_offset", "numel")))

    def land_digest(self, flat, s, copies, table, scale_cache, runs):
        """The copy is ours when the sender's memory is mapped here: one pass (csrc copy_checksum_runs)
        copies each run into ``flat`` and digests it. FP8 (dequantized on arrival) and process_vm_readv
        land first and are checksummed after."""
        src_shape = self.side.plan.src_shapes[s][copies[0].src_param]
        entry = table["params"][copies[0].src_param]
        mapped = self._mapped(table["pid"], entry)
        fused = _C is not None and hasattr(_C, "copy_checksum_runs")
        if runs is None or mapped is None or not fused or is_fp8(self.spec, tuple(src_shape)):
            return self.land(flat, s, copies, table, scale_cache), None
        src_b, dst_b, numel, hf, group, n_groups = runs
        sums = _C.copy_checksum_runs(src_b + (mapped.data_ptr() + entry["offset"]), dst_b + flat.data_ptr(), numel,
                                     hf, group, n_groups, flat.element_size())
        return 0, sums

    def land(self, flat, s, copies, table, scale_cache) -> int:
        src_shape = self.side.plan.src_shapes[s][copies[0].src_param]
        entry = table["params"][copies[0].src_param]
        if not is_fp8(self.spec, tuple(src_shape)):
            src_b, dst_b, n_b = self._byte_runs(s, copies, flat.element_size())
            self._pull(table["pid"], entry, src_b, dst_b + flat.data_ptr(), n_b)
            return 0
        n = sum(c.numel for c in copies)
        buf = torch.empty(n, dtype=torch.uint8)
        offs = torch.cumsum(torch.tensor([0] + [c.numel for c in copies[:-1]]), 0)
        self._pull(table["pid"], entry, torch.tensor([c.src_offset for c in copies]), offs + buf.data_ptr(),
                   torch.tensor([c.numel for c in copies]))
        k = (s, copies[0].src_param)
        if k not in scale_cache:  # the sender's whole scale vector, once per sync
            sc = torch.empty(src_shape[0], dtype=torch.float32)
            self._pull(table["pid"], table["scales"][k[1]], torch.zeros(1, dtype=torch.int64),
                       torch.tensor([sc.data_ptr()]), torch.tensor([4 * src_shape[0]]))
            scale_cache[k] = sc
        cols = src_shape[1]
        seg = torch.cat([scale_cache[k][slice(*rows_of(c, cols))] for c in copies])
        blocks = self.table(("fp8", s, copies[0].dst_param), lambda: packed_fp8_blocks(copies, cols))
        return land_fp8(flat, copies, cols, buf, seg, blocks) + 4 * seg.numel()


__all__ = ["read_runs", "copy_runs", "share", "map_shared", "allow_readers", "ZeroCopyTransport"]
