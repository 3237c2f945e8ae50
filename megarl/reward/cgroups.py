"""Per-run memory and process limits of the code sandbox: one cgroup per slot, memory + pids.

RLIMIT_AS and RLIMIT_NPROC bound one process and one uid; a run that forks 8 processes of 700 MiB
each still took 5 GiB of the machine. The slot's cgroup bounds the run as a whole: its memory (the
processes' pages, the tmpfs /work it writes, no swap) at :data:`MEMORY_BYTES` (past it the kernel's
OOM killer acts *inside* the cgroup: a reply process dies, never vLLM or the trainer) and its tasks at
:data:`PIDS_MAX`.

Both layouts are handled: cgroup v2 (a unified hierarchy whose root offers ``memory`` and ``pids``:
``<root>/megarl-sandbox/slot-N`` with ``memory.max``, ``memory.swap.max``, ``pids.max``) and cgroup v1
(``<root>/memory/megarl-sandbox/slot-N`` and ``<root>/pids/...``, ``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes`` where swap accounting is on, ``pids.max``). A hybrid machine whose v2
part has no memory controller (as here) uses v1. The slot's cgroups are made (and their limits
written) when a run takes the slot; they stay, empty, between runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup")  # where cgroupfs is mounted
GROUP = "megarl-sandbox"       # the parent cgroup of the slots' cgroups
MEMORY_BYTES = 1 << 30         # a run's memory, all its processes and its /work together: 1 GiB (bytes)
PIDS_MAX = 64                  # a run's tasks (processes and threads) together


class CgroupError(OSError):
    pass


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _controllers_v2(root: Path) -> set:
    try:
        return set((root / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def layout(root: Path) -> str:
    """'v2', 'v1', or raises :class:`CgroupError` naming what is missing."""
    if {"memory", "pids"} <= _controllers_v2(root):
        return "v2"
    if (root / "memory" / "memory.limit_in_bytes").exists() and (root / "pids").is_dir():
        return "v1"
    raise CgroupError(f"no cgroup memory and pids controllers under {root} (neither v2 nor v1)")


class SlotCgroups:
    """The cgroups of one slot: ``procs`` (the cgroup.procs files a run's first process writes its
    pid to) and :meth:`oom_kills` (how many times the kernel killed inside them)."""

    def __init__(self, n: int, root: Optional[Path] = None):
        root = ROOT if root is None else root
        self.kind = layout(root)
        name = f"slot-{n}"
        if self.kind == "v2":
            top = root / GROUP
            top.mkdir(exist_ok=True)
            for where in (root, top):  # delegate the controllers down to the slots
                if not {"memory", "pids"} <= set((where / "cgroup.subtree_control").read_text().split()):
                    _write(where / "cgroup.subtree_control", "+memory +pids")
            d = top / name
            d.mkdir(exist_ok=True)
            _write(d / "memory.max", str(MEMORY_BYTES))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(PIDS_MAX))
            self.dirs = (d,)
            self._events = d / "memory.events"
        else:
            mem, pids = root / "memory" / GROUP / name, root / "pids" / GROUP / name
            for d in (mem, pids):
                d.mkdir(parents=True, exist_ok=True)
            _write(mem / "memory.limit_in_bytes", str(MEMORY_BYTES))
            if (mem / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no swap either
                _write(mem / "memory.memsw.limit_in_bytes", str(MEMORY_BYTES))
            _write(pids / "pids.max", str(PIDS_MAX))
            self.dirs = (mem, pids)
            self._events = mem / "memory.oom_control"
        self.procs = tuple(str(d / "cgroup.procs") for d in self.dirs)

    def oom_kills(self) -> Optional[int]:
        """Processes the OOM killer ended in this slot's memory cgroup so far (None: the kernel does not say)."""
        try:
            for line in self._events.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def members(self) -> list[int]:
        out = []
        for procs in self.procs:
            try:
                out += [int(p) for p in Path(procs).read_text().split()]
            except OSError:
                pass
        return out


def probe(root: Optional[Path] = None) -> str:
    """What this machine offers ('cgroup v1: memory + pids'); raises :class:`CgroupError` when a slot's
    cgroup cannot be made or limited (a container without a writable cgroupfs)."""
    root = ROOT if root is None else root
    try:
        SlotCgroups(0, root)
    except OSError as exc:
        raise CgroupError(f"cannot make a limited cgroup under {root}: {exc}") from None
    return f"cgroup {layout(root)}: memory {MEMORY_BYTES >> 20} MiB, pids {PIDS_MAX} per run"
