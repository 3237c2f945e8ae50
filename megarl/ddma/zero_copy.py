"""Same-host zero-copy reads: copy byte runs straight out of another process's memory.

Two ways, both one copy with no serialization:
- the sender's tensors live in shared memory (:func:`share` moves a storage there in place, once)
  and the receiver maps the sender's file (``/proc/<pid>/fd/<fd>``, :func:`map_shared`) and copies
  its runs with :func:`copy_runs` (plain memcpy);
- otherwise :func:`read_runs` copies them with ``process_vm_readv``.
Both need the receiver to be allowed to inspect the sender (same uid; under Yama ``ptrace_scope=1``
the sender calls :func:`allow_readers`). The C++ versions (csrc/ddma_transport.cpp, GIL released)
are used when built, ctypes otherwise. Where neither is allowed, use the p2p transport.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

try:
    from megarl import _C  # type: ignore[attr-defined]
except ImportError:
    _C = None

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


__all__ = ["read_runs", "copy_runs", "share", "map_shared", "allow_readers"]
