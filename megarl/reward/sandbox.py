"""Run one reply's Python code against a task's tests in a sandbox, and say whether it passed.

Each run (:func:`run_tests`) gets:

- its own session and process group (``setsid``), killed as a whole (``SIGKILL``) at the wall-clock
  timeout and again when the run ends;
- a user id of its own (a *slot*: ``SLOT_UID_BASE + n``, held with an ``flock`` so no two runs share
  one), so ``RLIMIT_NPROC`` counts only its processes and, when the run ends, ``kill(-1, SIGKILL)``
  from that uid reaches every process it made, even one that left the group with ``setsid``;
- rlimits: CPU time, address space, file size, open files, processes (:data:`LIMITS`);
- a private temp dir (mode 0700, owned by the slot uid) as cwd and HOME, removed afterwards;
  files the slot uid left in the world-writable dirs (:data:`WRITABLE_ROOTS`) are removed and fail
  the run ("wrote outside its temp dir");
- no network: a new network namespace (``unshare(CLONE_NEWNET)``, which needs root or
  CAP_SYS_ADMIN). Where the kernel refuses it, :func:`check_sandbox` raises :class:`SandboxError`
  (the code reward then refuses to start), never runs code with the network on. Which was used is
  logged once per process.

How a pass is decided (the harness, megarl/reward/harness.py): the reply's program runs first, the
tests after it with clean builtins and a guarded candidate, and the pass is reported on a pipe as
a nonce the child receives only after the reply's top-level code ran. Nothing the reply prints,
its exit status, or an early ``os._exit`` can count as a pass.

The reply's code never runs in the scoring process: this module only forks and waits, so the pool
(megarl/reward/pool.py) survives any reply.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import logging
import math
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SLOT_UID_BASE = 61000      # slot n runs as uid/gid SLOT_UID_BASE + n (no such user needs to exist)
SLOTS = 256                # concurrent sandbox runs on one machine (slots)
SLOT_DIR = Path(tempfile.gettempdir()) / "megarl-sandbox"  # slot locks and the private dirs' parent
WRITABLE_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")  # where a non-root uid can create files here
# The run's limits: resource name -> soft = hard limit (units in the comment). CPU is set per run
# from the wall-clock timeout (s): see cpu_limit_s.
LIMITS = {
    "RLIMIT_AS": 1 << 30,        # address space: 1 GiB (bytes); a memory hog gets MemoryError
    "RLIMIT_FSIZE": 16 << 20,    # largest file written: 16 MiB (bytes)
    "RLIMIT_NOFILE": 64,         # open files (descriptors)
    "RLIMIT_NPROC": 32,          # processes of the slot uid (a fork bomb stops there)
    "RLIMIT_CORE": 0,            # no core dumps (bytes)
}
# The CPU-time limit is a backstop behind the wall clock, never ahead of it: one thread's CPU time never
# exceeds its wall time, but the scoring process may notice its deadline late on a loaded machine (its
# poll is 50 ms, its scheduling slot is not promised), and when the CPU limit equalled the timeout an
# infinite loop was sometimes killed by it first, reported as a bare SIGKILL. Soft limit (SIGXCPU) at
# timeout + margin, hard limit (SIGKILL) one second later (s).
CPU_LIMIT_MARGIN_S = 2
WALL_TIMEOUT_S = 4.0       # default wall-clock limit of one run (s); the pool sets it below reward.timeout_s
SWEEP_ROUNDS = 20          # kill(-1) rounds until the slot uid has no process left (each ~1 ms)
OUTPUT_TAIL = 400          # characters of the child's stdout/stderr kept for the reason
HARNESS = Path(__file__).with_name("harness.py")
# Interpreters the slot uid may be able to run (the venv's may live under a 0700 home): the first
# that starts as the slot uid is used (:func:`check_sandbox`).
PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")

_libc = ctypes.CDLL(None, use_errno=True)
_checked: Optional[str] = None  # the interpreter check_sandbox found, once per process


class SandboxError(RuntimeError):
    """The machine cannot give the sandbox what it needs (root for the uid switch, a network
    namespace, an interpreter the slot uid can run); the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    timed_out: bool = False
    seconds: float = 0.0


def cpu_limit_s(timeout_s: float) -> int:
    """The soft RLIMIT_CPU of a run whose wall-clock limit is ``timeout_s`` (s); the hard one is 1 s more."""
    return max(1, math.ceil(timeout_s)) + CPU_LIMIT_MARGIN_S


def _preexec(uid: int, cpu_s: int) -> None:
    """In the forked child, before exec: no network, limits, then drop to the slot uid."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        os._exit(97)  # never run the reply with the network on
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the harness dies with its scoring process
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    for name, value in LIMITS.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def check_sandbox() -> str:
    """The interpreter runs use; :class:`SandboxError` when this machine cannot sandbox (not root,
    no network namespace, no interpreter the slot uid can run). Logs which isolation is used."""
    global _checked
    if _checked:
        return _checked
    # Orphans a run leaves (a daemonised child) become this process's children, so sweep() reaps them.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.geteuid() != 0:
        raise SandboxError("reward.fn=code needs root (or CAP_SETUID + CAP_SYS_ADMIN) to run replies as a slot "
                           "uid in a new network namespace; run the reward pool as root, or use another reward")
    tried = []
    for python in PYTHONS:
        if not os.access(python, os.X_OK):
            continue
        proc = subprocess.run([python, "-I", "-S", "-c", "import socket, sys; print(sys.version_info[:2])"],
                              preexec_fn=lambda: _preexec(SLOT_UID_BASE + SLOTS, 5), capture_output=True,
                              text=True, timeout=30, start_new_session=True, cwd="/")
        if proc.returncode == 97:
            raise SandboxError("reward.fn=code: the kernel refused a new network namespace (unshare(CLONE_NEWNET)); "
                               "replies are not run with the network on. Allow unprivileged netns or run as root "
                               "with CAP_SYS_ADMIN (in a container: --cap-add SYS_ADMIN), or use another reward")
        if proc.returncode == 0:
            _checked = python
            log.info("code sandbox: %s as slot uids %d+, new network namespace (no network), rlimits %s",
                     python, SLOT_UID_BASE, LIMITS)
            return python
        tried.append(f"{python}: exit {proc.returncode} {proc.stderr.strip()[-200:]}")
    raise SandboxError(f"reward.fn=code: no Python the sandbox uid can run ({'; '.join(tried) or 'none found'}); "
                       f"install python3 under /usr/bin (world-readable stdlib)")


class _Slot:
    """A slot uid held for one run (an flock on SLOT_DIR/slot-N.lock), swept clean on entry and exit."""

    def __enter__(self) -> "_Slot":
        SLOT_DIR.mkdir(mode=0o711, exist_ok=True)
        start = secrets.randbelow(SLOTS)
        for k in range(SLOTS):
            n = (start + k) % SLOTS
            fh = open(SLOT_DIR / f"slot-{n}.lock", "a")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.close()
                continue
            self.fh, self.uid = fh, SLOT_UID_BASE + n
            sweep(self.uid)  # a run whose scoring process was killed may have left some
            return self
        raise SandboxError(f"all {SLOTS} sandbox slots are busy ({SLOT_DIR}); fewer reward.workers")

    def __exit__(self, *exc) -> None:
        sweep(self.uid)
        self.fh.close()


def alive(uid: int, *, zombies: bool = False) -> list[int]:
    """Pids of the processes of ``uid`` (from /proc); ``zombies``: the exited, unreaped ones instead."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid != uid:
                    continue
                with open(f"/proc/{entry.name}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # gone meanwhile
            if (state == b"Z") == zombies:
                out.append(int(entry.name))
    return out


def sweep(uid: int) -> None:
    """Kill every process of ``uid``: a child that becomes ``uid`` and calls ``kill(-1, SIGKILL)``,
    which reaches all of that uid's processes but itself, until none is left."""
    for _ in range(SWEEP_ROUNDS):
        if not alive(uid):
            break
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.001)
    else:
        log.warning("code sandbox: uid %d still has processes after %d sweeps: %s", uid, SWEEP_ROUNDS, alive(uid)[:8])
    # Orphans of the run were reparented to this process (a child subreaper, check_sandbox): reap them.
    for pid in alive(uid, zombies=True):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # another process's child


def _outside(uid: int) -> list[str]:
    """Files ``uid`` owns in the world-writable dirs (the only places outside its temp dir it could
    write here), one level into world-writable subdirs; they are removed."""
    found = []
    for root in WRITABLE_ROOTS:
        dirs = [root]
        try:
            dirs += [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
                     and e.stat(follow_symlinks=False).st_mode & 0o002]
        except OSError:
            continue
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                try:
                    if e.stat(follow_symlinks=False).st_uid != uid:
                        continue
                except OSError:
                    continue
                found.append(e.path)
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
    return found


def run_tests(program: str, tests: str, entry_point: str, *, timeout_s: Optional[float] = None) -> Verdict:
    """Run ``program`` then ``tests`` (defining ``check(candidate)``) on ``entry_point`` in a sandbox;
    passed only when every test ran and the harness reported its nonce. Never raises for anything
    the program does; :class:`SandboxError` when the machine cannot sandbox."""
    python = check_sandbox()
    timeout_s = WALL_TIMEOUT_S if timeout_s is None else timeout_s
    start = time.monotonic()
    with _Slot() as slot:
        work = Path(tempfile.mkdtemp(prefix="run-", dir=SLOT_DIR))
        try:
            verdict = _run(python, slot.uid, work, program, tests, entry_point, timeout_s)
        finally:
            sweep(slot.uid)
            shutil.rmtree(work, ignore_errors=True)
        outside = _outside(slot.uid)
    if outside:
        verdict = Verdict(False, f"wrote outside its temp dir: {', '.join(outside[:3])} (removed)")
    return dataclasses.replace(verdict, seconds=time.monotonic() - start)


def _run(python: str, uid: int, work: Path, program: str, tests: str, entry: str, timeout_s: float) -> Verdict:
    for name, text in (("reply.py", program), ("test.py", tests), ("entry_point", entry)):
        (work / name).write_text(text, encoding="utf-8")
    shutil.copy(HARNESS, work / "harness.py")
    for p in [work, *work.iterdir()]:
        os.chown(p, uid, uid)
    os.chmod(work, 0o700)
    out = open(work / "output", "w+b")
    report_r, report_w = os.pipe()
    nonce = secrets.token_hex(16).encode()
    cpu_s = cpu_limit_s(timeout_s)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.Popen([python, "-I", "-S", "harness.py", str(report_w)], cwd=work, env=env,
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(report_w,),
                                start_new_session=True, preexec_fn=lambda: _preexec(uid, cpu_s))
    finally:
        os.close(report_w)
    buf, sent, timed_out = b"", False, False
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([report_r], [], [], min(left, 0.05))
            if ready:
                chunk = os.read(report_r, 4096)
                if not chunk:
                    break  # every writer closed: the harness (and all it started) ended
                buf += chunk
                if not sent and buf.startswith(b"R"):
                    sent = True
                    try:
                        proc.stdin.write(nonce + b"\n")
                        proc.stdin.close()
                    except OSError:
                        pass
                if len(buf) > 4096:
                    break
            elif proc.poll() is not None:
                break
    finally:
        _kill_group(proc)
        os.close(report_r)
        out.seek(0)
        tail = out.read()[-OUTPUT_TAIL:].decode("utf-8", "replace").strip()
        out.close()
    if proc.returncode == 97:
        raise SandboxError("reward.fn=code: the kernel refused a new network namespace for this run")
    if timed_out:
        return Verdict(False, f"timed out after {timeout_s:.1f}s (the process group was killed)", timed_out=True)
    if proc.returncode == -signal.SIGXCPU:
        # the CPU-time backstop ended it before this process saw its deadline (a loaded machine can delay
        # the poll past CPU_LIMIT_MARGIN_S); either limit is a time-out
        return Verdict(False, f"timed out: {_exit_text(proc.returncode, cpu_s)}", timed_out=True)
    if buf == b"R" + b"P" + nonce:
        return Verdict(True, "all tests passed")
    if buf.startswith(b"RF") or buf.startswith(b"F"):
        return Verdict(False, buf.split(b"F", 1)[1].decode("utf-8", "replace"))
    how = _exit_text(proc.returncode, cpu_s)
    return Verdict(False, f"no pass report ({how}; output: {tail[-160:]!r})" if tail else f"no pass report ({how})")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.warning("code sandbox: pid %d not reaped 5s after SIGKILL", proc.pid)


def _exit_text(code: Optional[int], cpu_s: int) -> str:
    if code is None:
        return "still running"
    if code == -signal.SIGXCPU:  # several threads can spend CPU time faster than the wall clock runs
        return f"killed by SIGXCPU: over its CPU-time limit of {cpu_s}s"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
