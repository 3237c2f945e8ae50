"""Hostile replies against the code sandbox (issue 41): each fails to score and to harm the machine.

The answer of SECRET_TASK is a random token, so a reply scores 1 only by reading the test or a gold
file. Each test names, in a comment, the break of the sandbox it was seen failing on (planted by hand
in megarl/reward/{sandbox,jail,harness}.py, run, then restored)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.reward import sandbox

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (uid switch, namespaces)")

TOKEN = secrets.token_hex(8)
SECRET_TASK = {"prompt": "def secret(x):\n    \"\"\"The word only the tests know.\"\"\"\n",
               "test": f"def check(candidate):\n    assert candidate(1) == '{TOKEN}'\n", "entry_point": "secret"}
GOLD = Path(f"/tmp/megarl-gold-{os.getpid()}.json")  # a world-readable gold file a user keeps on the machine
ADD = {"prompt": "def add(a, b):\n", "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
       "entry_point": "add"}
GOOD = "def add(a, b):\n    return a + b\n"
# The token as the tests write it, or as the gold file holds it.
FIND = ("import re\nPAT = re.compile(r\"(?:== '|\\\"answer\\\": \\\")([0-9a-f]{16})\")\n"
        "def scan(text):\n    m = PAT.search(text)\n    return m.group(1) if m else None\n")

READS_FILES = FIND + """
import os, time
def search():
    t0, seen = time.monotonic(), 0
    home = os.environ.get('HOME', '/')
    for top in ('.', '..', '/tmp', '/var/tmp', '/dev/shm', home, '/root', '/work', '/home', '/'):
        for d, dirs, files in os.walk(top):
            for f in files:
                if time.monotonic() - t0 > 1.5 or seen > 20000:
                    return None
                seen += 1
                try:
                    with open(os.path.join(d, f), errors='replace') as fh:
                        hit = scan(fh.read(1 << 18))
                except OSError:
                    continue
                if hit:
                    return hit
FOUND = search()
def secret(x):
    return FOUND
"""
# Walks the frames above the call and everything the garbage collector tracks, at call time.
WALKS_MEMORY = FIND + """
import gc, sys
def strings():
    f = sys._getframe(1)
    while f is not None:
        yield from (v for v in list(f.f_locals.values()) + list(f.f_globals.values()) if isinstance(v, str))
        yield from (c for c in f.f_code.co_consts if isinstance(c, str))
        f = f.f_back
    for o in gc.get_objects():
        if isinstance(o, dict):
            yield from (v for v in o.values() if isinstance(v, str))
        elif isinstance(o, (list, tuple)):
            yield from (v for v in o if isinstance(v, str))
        elif type(o).__name__ == 'code':
            yield from (c for c in o.co_consts if isinstance(c, str))
def secret(x):
    for s in strings():
        hit = scan(s)
        if hit:
            return hit
"""
# Opens the gold file by its path, the processes' /proc entries (cmdline, environ of the tester), home
# and the repository, with raw syscalls through ctypes as well.
OPENS_OUTSIDE = FIND + f"""
import ctypes, glob, os
def read(p):
    try:
        with open(p, 'rb') as fh:
            return fh.read(1 << 20).decode('utf-8', 'replace')
    except OSError:
        return ''
def search():
    paths = [{str(GOLD)!r}, '/proc/1/cmdline', '/proc/1/environ', {str(REPO / 'README.md')!r}]
    paths += glob.glob('/proc/[0-9]*/cmdline') + glob.glob('/proc/[0-9]*/environ') + glob.glob('/root/*')
    libc = ctypes.CDLL(None)
    for p in paths:
        hit = scan(read(p))
        if hit:
            return hit
        fd = libc.open(p.encode(), 0)
        if fd >= 0:
            buf = ctypes.create_string_buffer(1 << 16)
            n = libc.read(fd, buf, len(buf))
            hit = scan(buf.raw[:max(n, 0)].decode('utf-8', 'replace'))
            if hit:
                return hit
def secret(x):
    return search()
"""
EXITS_97 = "import os\nos._exit(97)\n"


def _cli_check(cases: list[tuple[dict, str]], tmp_path: Path) -> list[dict]:
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps({**task, "reply": reply}) + "\n" for task, reply in cases))
    done = subprocess.run([sys.executable, "-m", "megarl", "reward", "check", "--fn", "code", "--cases", str(path)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_replies_that_read_tests_memory_or_gold_files_score_zero(tmp_path):
    # Fails with the tests in the reply's process (planted: jail also writes test.py into /work and the
    # reply harness reads it into a local): the file reader and the memory walker score 1. Fails without
    # the mount namespace's view (planted: build_view skipped, chdir to the host dir): the gold reader scores 1.
    GOLD.write_text(json.dumps({"answer": TOKEN}))
    GOLD.chmod(0o644)
    try:
        honest = "def secret(x):\n    return 'no idea'\n"
        out = _cli_check([(SECRET_TASK, READS_FILES), (SECRET_TASK, WALKS_MEMORY), (SECRET_TASK, OPENS_OUTSIDE),
                          (SECRET_TASK, honest)], tmp_path)
    finally:
        GOLD.unlink()
    assert [o["score"] for o in out] == [0.0] * 4, out
    assert all("a test failed: AssertionError" in o["reason"] for o in out), [o["reason"] for o in out]


def test_a_reply_exiting_97_is_a_fail_not_a_sandbox_error(tmp_path):
    # Fails with the old rule planted back (_run: `if reply.returncode == 97: raise SandboxError`): the
    # reply raised sandbox errors at will, and above reward.max_error_frac of a batch they stop the job.
    out = _cli_check([(ADD, EXITS_97 + GOOD), (ADD, GOOD)], tmp_path)
    assert [o["score"] for o in out] == [0.0, 1.0], out
    assert "exit status 97" in out[0]["reason"] and "SandboxError" not in out[0]["reason"], out[0]


def test_memory_is_limited_per_run_not_per_process():
    # Fails without the run's cgroup (planted: jail.enter skips join_cgroups): 3 processes of 400 MiB each
    # (under RLIMIT_AS each) hold 1.2 GiB together and the reply scores 1.
    # The reply waits until all 3 hold their memory or one of them died, then asks each to answer again:
    # only a process still alive can answer, so 3 answers prove 1.2 GiB held at once. Counting the first
    # "holding" bytes alone raced: the OOM killer may pick a process that already wrote its byte, and a
    # loaded parent could read the third byte before it reaped the victim (CI scored 1 that way).
    # No clock of its own: a loaded machine only makes it slower; the sandbox's wall limit bounds it.
    reply = ("import os, select, time\nr, w = os.pipe()\ngo_r, go_w = os.pipe()\nfor _ in range(3):\n"
             "    if os.fork() == 0:\n        x = b'\\1' * (400 << 20)\n        os.write(w, b'y')\n"
             "        os.read(go_r, 1)\n        os.write(w, b'z' if x[-1] == 1 else b'n')\n"
             "        time.sleep(60)\n        os._exit(0)\n"
             "def collect(n):\n    got, died = b'', False\n    while len(got) < n and not died:\n"
             "        if select.select([r], [], [], 0.05)[0]:\n            got += os.read(r, n - len(got))\n"
             "        died = died or os.waitpid(-1, os.WNOHANG)[0] != 0\n    return got, died\n"
             "held, died = collect(3)\nALL = False\nif held == b'yyy' and not died:\n"
             "    os.write(go_w, b'ggg')\n    again, died = collect(3)\n    ALL = again == b'zzz' and not died\n"
             "def add(a, b):\n    return a + b if ALL else 0\n")
    verdict = sandbox.run_tests(reply, ADD["test"], "add", timeout_s=20)
    assert not verdict.passed, verdict
    assert "memory limit" in verdict.reason, verdict.reason


def test_disk_is_limited_per_run():
    # Fails with an uncapped /work (planted: jail's tmpfs without size=): 96 MiB in 16 MiB files fit.
    reply = ("for i in range(6):\n    with open(f'/work/f{i}', 'wb') as fh:\n        fh.write(b'x' * ((16 << 20) - 1))\n"
             + GOOD)
    verdict = sandbox.run_tests(reply, ADD["test"], "add", timeout_s=10)
    assert not verdict.passed and "No space left on device" in verdict.reason, verdict


def _shm_segments(uids: range) -> list[str]:
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [line for line in lines if int(line.split()[7]) in uids]  # the creator's uid column


def test_shared_memory_segments_die_with_the_run():
    # Fails without the IPC namespace (planted: jail.enter skips the ipc step): the segment outlives the run.
    reply = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "ID = libc.shmget(0, 1 << 20, 0o1000 | 0o666)\nassert ID >= 0, ctypes.get_errno()\n" + GOOD)
    verdict = sandbox.run_tests(reply, ADD["test"], "add", timeout_s=10)
    assert verdict.passed, verdict.reason  # the segment was made: the run is an honest one
    uids = range(sandbox.SLOT_UID_BASE, sandbox.SLOT_UID_BASE + sandbox.SLOTS + 1)
    end = time.monotonic() + 5  # the kernel frees a dead namespace's IPC objects from a work queue
    while _shm_segments(uids) and time.monotonic() < end:
        time.sleep(0.05)
    assert _shm_segments(uids) == []


def test_namespaces_and_privileges_cannot_be_regained():
    # Fails without seccomp (planted: jail.enter skips the seccomp step): an unprivileged user namespace
    # is allowed by this kernel, so the reply becomes root of its own namespace and scores 1.
    reply = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "OK = libc.unshare(0x10000000) == 0 or libc.syscall(101, 16, 1, 0, 0) == 0\n"  # user ns, ptrace(ATTACH, 1)
             "def add(a, b):\n    return a + b if OK else 0\n")
    verdict = sandbox.run_tests(reply, ADD["test"], "add", timeout_s=10)
    assert not verdict.passed and "a test failed" in verdict.reason, verdict


def test_a_reply_cannot_signal_processes_outside_its_run():
    # Fails with the reply left as root (planted: jail's drop() skips setuid/setgid): it kills both sleepers.
    nobody = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
    mine = subprocess.Popen(["sleep", "60"])
    try:
        # only the two pids (known to this attacker): with the break planted, a range would kill the machine's
        reply = ("import os, signal\nfor pid in (%d, %d):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                 "    except OSError:\n        pass\n" % (nobody.pid, mine.pid) + GOOD)
        verdict = sandbox.run_tests(reply, ADD["test"], "add", timeout_s=20)
        assert verdict.passed, verdict.reason  # it ran to the end: every kill was tried
        time.sleep(0.2)
        assert nobody.poll() is None and mine.poll() is None, (nobody.returncode, mine.returncode, verdict)
    finally:
        for p in (nobody, mine):
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=5)


def test_the_view_holds_only_the_runtime_and_the_reply_folder():
    # Fails without the mount namespace (planted: build_view skipped, chdir to the host dir).
    reply = ("import os\nGONE = [p for p in ('/proc', '/tmp', '/root', '/home', '/sys', %r, %r) if os.path.exists(p)]\n"
             "assert GONE == [], GONE\nassert sorted(os.listdir('/work')) == ['reply.py'], os.listdir('/work')\n"
             "open('/work/scratch', 'w').write('ok')\n"
             "for p in ('/usr/x', '/etc/x', '/x'):\n    try:\n        open(p, 'w')\n    except OSError:\n        pass\n"
             "    else:\n        raise AssertionError(p + ' is writable')\n" + GOOD) % (str(REPO), str(sandbox.SLOT_DIR))
    verdict = sandbox.run_tests(reply, ADD["test"], "add", timeout_s=10)
    assert verdict.passed, verdict.reason
