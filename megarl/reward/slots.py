"""The code sandbox's slots: a uid per concurrent run, held by an flock, and its process sweep.

A slot is ``uid_base + n`` for n < ``slots``; :class:`Slot` holds ``<dir>/slot-N.lock`` with an flock so
no two runs (in any process) share a uid, and sweeps the uid on entry (a run whose scoring process was
killed may have left processes) and exit. The uids must be no user of this machine: the sandbox checks
that before use (sandbox.check_sandbox), since :func:`sweep` kills every process of the uid.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import signal
import time
from pathlib import Path

log = logging.getLogger("megarl.reward.sandbox")

SWEEP_ROUNDS = 20          # kill(-1) rounds until the slot uid has no process left (each ~1 ms)
WRITABLE_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")  # where a non-root uid can create files (without the jail)


class SlotsBusy(RuntimeError):
    pass


class Slot:
    """A slot uid held for one run; ``n`` and ``uid`` once entered."""

    def __init__(self, directory: Path, uid_base: int, slots: int):
        self.dir, self.base, self.slots = directory, uid_base, slots

    def __enter__(self) -> "Slot":
        self.dir.mkdir(mode=0o711, exist_ok=True)
        start = secrets.randbelow(self.slots)
        for k in range(self.slots):
            n = (start + k) % self.slots
            fh = open(self.dir / f"slot-{n}.lock", "a")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.close()
                continue
            self.fh, self.n, self.uid = fh, n, self.base + n
            sweep(self.uid)  # a run whose scoring process was killed may have left some
            return self
        raise SlotsBusy(f"all {self.slots} sandbox slots are busy ({self.dir}); fewer reward.workers")

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


def outside(uid: int) -> list[str]:
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


