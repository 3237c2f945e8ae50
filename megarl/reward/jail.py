"""The code sandbox's confinement of one reply process: set up in the forked child, as root, before exec.

:func:`enter` runs as ``preexec_fn`` (megarl/reward/sandbox.py). In order:

1. ``cgroup``: the child joins its slot's cgroups (memory and pids limits of the whole run,
   megarl/reward/cgroups.py), so every process it makes is counted together;
2. ``netns`` (always): a new network namespace, only ``lo``;
3. ``ipc``: a new IPC namespace (SysV shm / semaphores / queues die with the run);
   ``uts`` goes with it (a hostname of its own);
4. ``mount``: a new mount namespace whose root is a fresh tmpfs holding only read-only binds of the
   Python runtime (the interpreter, its stdlib, the shared-library dirs it loads from, /dev/null,
   zero, random, urandom) and ``/work``, a size-capped tmpfs (the run's disk quota) owned by the
   slot uid holding ``reply.py``; ``pivot_root`` into it and the old root detached, so no host path
   (test files, gold answers, /proc, /tmp, home dirs) exists for the reply at all;
5. rlimits, then the slot uid (no groups, no capabilities, ``no_new_privs``);
6. ``seccomp``: a filter returning EPERM for the calls that reach other processes or the kernel's
   namespace and mount machinery (ptrace, process_vm_*, mount, unshare, setns, bpf, keyctl,
   io_uring, ... and clone with namespace flags), ENOSYS for clone3 (its flags cannot be read).

A step that fails writes ``<mechanism>: <error>`` to ``status_fd`` (close-on-exec: the reply never
holds it) and raises, so the parent knows the sandbox, not the reply, failed. A mechanism named in
``weaker`` is skipped (the caller decided, once, that this machine lacks it and the user accepted that).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import struct
from typing import Callable, Iterable, Optional

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
MECHANISMS = ("cgroup", "ipc", "mount", "seccomp")  # what reward.code_sandbox_allow_weaker may name
WORK = "/work"             # the reply's folder (cwd, HOME, TMPDIR) inside its mount namespace
WORK_TMPFS_MB = 16         # size of /work: the run's disk quota (MiB; also charged to its memory cgroup)
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class _StepFailed(OSError):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise _StepFailed(err, f"{what}: {os.strerror(err)}")


def _mount(src: Optional[str], dst: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src or fstype} on {dst}")


def _expose(root: str, path: str, depth: int = 0) -> None:
    """Make host ``path`` readable at the same path under ``root``: symlinks on the way are recreated
    (then followed), the file or dir itself is a read-only, nosuid bind (nodev but for DEV_NODES)."""
    if depth > 8:
        raise _StepFailed(0, f"too many symlinks under {path}")
    parts = [p for p in path.split("/") if p]
    cur = ""
    for i, part in enumerate(parts):
        cur += "/" + part
        if os.path.islink(cur):
            target = os.readlink(cur)
            if not os.path.lexists(root + cur):
                os.symlink(target, root + cur)
            resolved = os.path.normpath(os.path.join(os.path.dirname(cur), target, *parts[i + 1:]))
            return _expose(root, resolved, depth + 1)
        if i < len(parts) - 1:
            os.makedirs(root + cur, exist_ok=True)
    dst = root + cur
    if os.path.isdir(cur):
        os.makedirs(dst, exist_ok=True)
    elif not os.path.exists(dst):
        open(dst, "w").close()
    nodev = 0 if cur in DEV_NODES else MS_NODEV
    _mount(cur, dst, None, MS_BIND)
    _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | nodev)


def _pivot(root: str) -> None:
    """``pivot_root(root, root)`` then detach the old root: nothing of the host's tree stays reachable."""
    nr = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
    if nr is None:
        raise _StepFailed(0, f"pivot_root's syscall number on {platform.machine()} is unknown here")
    os.chdir(root)
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def build_view(root: str, runtime: Iterable[str], uid: int, files: dict) -> None:
    """In a new mount namespace: ``root`` (an empty host dir) becomes a tmpfs with the runtime's
    read-only binds and /work (the slot's tmpfs with ``files``), then the process's ``/``."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing here propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in runtime:
        _expose(root, path)
    os.mkdir(root + WORK)
    _mount("tmpfs", root + WORK, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={WORK_TMPFS_MB}m,mode=700,uid={uid},gid={uid}")
    for name, text in files.items():
        path = f"{root}{WORK}/{name}"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chown(path, uid, uid)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # no new files at /
    _pivot(root)


# --- seccomp: a deny list (x86_64 numbers; elsewhere the mechanism is missing and refused) ---
_DENY_X86_64 = {  # name: nr; each returns EPERM
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
    "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248,
    "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176, "reboot": 169,
    "swapon": 167, "swapoff": 168, "acct": 163, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}
_CLONE, _CLONE3 = 56, 435
_NS_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_program() -> bytes:
    """The BPF filter (struct sock_filter[]): wrong arch -> kill; x32 calls and the deny list -> EPERM;
    clone with a namespace flag -> EPERM; clone3 -> ENOSYS (libc falls back to clone); else allow."""
    if platform.machine() != "x86_64":
        raise _StepFailed(0, f"no syscall table for {platform.machine()} (x86_64 only)")
    body = [("ld", 4), ("jne", _AUDIT_ARCH_X86_64, "kill"), ("ld", 0), ("jge", _X32_BIT, "eperm")]
    body += [("jeq", nr, "eperm") for nr in sorted(_DENY_X86_64.values())]
    body += [("jeq", _CLONE3, "enosys"), ("jne", _CLONE, "allow"), ("ld", 16), ("jset", _NS_FLAGS, "eperm")]
    tail = {"allow": _RET_ALLOW, "eperm": _RET_ERRNO | 1, "enosys": _RET_ERRNO | 38, "kill": _RET_KILL}
    at = {name: len(body) + i for i, name in enumerate(tail)}
    out = b""
    for i, ins in enumerate(body):
        if ins[0] == "ld":
            out += struct.pack("HBBI", _LD_W_ABS, 0, 0, ins[1])
            continue
        op, k, target = ins
        off = at[target] - i - 1
        code = {"jeq": _JEQ, "jne": _JEQ, "jge": _JGE, "jset": _JSET}[op]
        jt, jf = (0, off) if op == "jne" else (off, 0)
        out += struct.pack("HBBI", code, jt, jf, k)
    for value in tail.values():
        out += struct.pack("HBBI", _RET, 0, 0, value)
    return out


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _seccomp(program: bytes) -> None:
    prog = _Fprog(len(program) // 8, program)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "prctl(PR_SET_SECCOMP)")


def enter(*, uid: int, limits: dict, cpu_s: int, status_fd: int, weaker: frozenset, root: str,
          runtime: tuple, files: dict, cgroup_procs: tuple, host_work: str, filter_program: bytes) -> None:
    """The child's confinement before exec (see the module doc); raises after writing the failing step."""
    def step(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: B036 - any failure is the sandbox's, reported on status_fd
            try:
                os.write(status_fd, f"{name}: {exc}".encode()[:500])
            finally:
                raise

    def join_cgroups() -> None:
        for procs in cgroup_procs:
            with open(procs, "w") as fh:
                fh.write(str(os.getpid()))

    step("pdeathsig", lambda: _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl"))
    if "cgroup" not in weaker:
        step("cgroup", join_cgroups)
    step("netns", lambda: _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)"))
    if "ipc" not in weaker:
        step("ipc", lambda: _check(_libc.unshare(CLONE_NEWIPC | CLONE_NEWUTS), "unshare(CLONE_NEWIPC|CLONE_NEWUTS)"))
    if "mount" not in weaker:
        step("mount", lambda: _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)"))
        step("mount", lambda: build_view(root, runtime, uid, files))
        step("mount", lambda: os.chdir(WORK))
    else:
        step("mount", lambda: os.chdir(host_work))  # the parent wrote the files there

    def drop() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, name), (value, value))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")

    step("uid", drop)
    if "seccomp" not in weaker:
        step("seccomp", lambda: _seccomp(filter_program))
