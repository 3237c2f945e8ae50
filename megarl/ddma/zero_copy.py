"""Same-host zero-copy reads: copy byte runs straight out of another process's memory.

The C++ ``megarl._C.read_runs`` (csrc/ddma_transport.cpp, ``process_vm_readv``, GIL released) is
used when built; otherwise the same syscall through ctypes. :func:`zero_copy_available` probes
whether this host lets one process read another's memory (same uid; Yama ``ptrace_scope`` allows
it, or the sender called :func:`allow_readers`); where it does not, DDMA uses point-to-point sends.
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


def allow_readers() -> bool:
    """Let same-user processes read this process's memory (needed under Yama ptrace_scope=1)."""
    if _C is not None and hasattr(_C, "allow_zero_copy_readers"):
        return bool(_C.allow_zero_copy_readers())
    return _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) == 0


def zero_copy_available(pid: int) -> bool:
    """Whether this process can read process ``pid``'s memory (probes 8 bytes of a live buffer is
    not possible without its cooperation, so it reads its own ``/proc/pid/stat`` permission: a
    failed read of a known-mapped address of ``pid`` is the authoritative answer at sync time)."""
    try:
        with open(f"/proc/{pid}/mem", "rb"):
            return True
    except OSError:
        return False


__all__ = ["read_runs", "allow_readers", "zero_copy_available"]
