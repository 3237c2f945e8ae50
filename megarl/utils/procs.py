"""Process supervision: a job's processes end when the job ends, however it ends.

Two halves, one per side of a parent/child pair:

* **Child side** -- :func:`watch_parent`, called first thing in every process a job spawns (the
  generator's replica processes, the reward pool's workers). The child dies when its parent does:
  Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` kills it the moment the parent goes, and a daemon
  thread polling ``os.getppid()`` against the parent's pid (about once a second) covers what
  PDEATHSIG does not: it fires on the exit of the parent *thread* that spawned the child (so it is
  only armed when that thread is the parent's main thread, see :func:`spawned_from_main_thread`),
  and it does not exist off Linux. A child that leads its own process group (a generator replica:
  its vLLM TP workers are in that group) takes the whole group down with it.

* **Controller side** -- :func:`signals_raise`, a context manager that turns SIGTERM, SIGINT and
  SIGHUP into :class:`JobInterrupted` raised in the main thread, so ``run_job``'s ``ExitStack``
  unwinds and closes every executor (the generator's shutdown kills its replicas' process groups);
  ``megarl``'s command line then exits with ``128 + signum``. A second signal while unwinding
  exits at once (``os._exit``): the children's parent watch ends them within about a second.

A training job (``run_job``) asks for a checkpoint instead (:class:`Preemption`): under a launcher
SIGTERM / SIGUSR1 checkpoint for a requeue (exit :data:`PREEMPTED_EXIT`); a plain ``megarl train``
checkpoints on the first SIGTERM, SIGINT (Ctrl-C) or SIGUSR1, exits ``128 + signum`` once it is
written, and exits at once on a second signal or when ``cluster.preempt_grace_s`` ran out first.

Slurm: ``scancel`` (and a preemption or requeue) sends SIGTERM to the job step's processes, then
SIGKILL after ``KillWait`` (30 s by default). SIGTERM takes the graceful path above; the SIGKILL,
or any other death of the controller (OOM killer, ``kill -9``), is caught by the children's parent
watch. The exception is raised between Python bytecodes, so a long native call in the main thread
(one huge trainer step) delays the unwinding until it returns; KillWait bounds that, and the
parent watch covers the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
POLL_S = 1.0  # how often the watch thread re-checks its parent
DEFAULT_SIGNALS: tuple[int, ...] = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGINT", "SIGHUP")) if s is not None)
# Under a launcher both ask for a checkpoint: SIGTERM from Slurm (scancel, preemption, requeue) and
# SIGUSR1, the one srun passes on to its tasks unchanged (srun turns a SIGTERM it receives into
# SIGKILL for its tasks), which the launcher forwards and `#SBATCH --signal=B:USR1@s` sends.
PREEMPT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
# A plain `megarl train` (no launcher) checkpoints on these too, Ctrl-C included: the first one asks
# for a checkpoint, a second one exits at once.
PLAIN_CHECKPOINT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


# ---------------------------------------------------------------------------------- child side
def spawned_from_main_thread() -> bool:
    """Whether the calling thread is the main thread: pass it to the child as ``pdeathsig``.

    PDEATHSIG fires when the *thread* that forked the child exits, so a child started from a
    short-lived thread would be killed while its parent is healthy; the main thread lives as long
    as the process."""
    return threading.current_thread() is threading.main_thread()


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies. Returns
    whether it was armed (False off Linux or where prctl is unavailable)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent_pid: int | None = None, *, pdeathsig: bool = True,
                 poll_s: float = POLL_S) -> int:
    """Make this (child) process exit hard when its parent dies; returns the watched pid.

    ``parent_pid``: the parent's pid as the parent knew it (``os.getpid()`` there), which closes
    the race of a parent dying before the child gets here; default: multiprocessing's record of
    the parent, else ``os.getppid()``. ``pdeathsig``: also arm PR_SET_PDEATHSIG (pass
    :func:`spawned_from_main_thread` evaluated in the parent). Call it first thing in the child."""
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
    if pdeathsig:
        set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before PDEATHSIG was armed
        _die(parent_pid)
    threading.Thread(target=_poll_parent, args=(parent_pid, poll_s), daemon=True,
                     name="megarl-watch-parent").start()
    return parent_pid


def _poll_parent(parent_pid: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent_pid:  # reparented: to init or a subreaper
            _die(parent_pid)


def _die(parent_pid: int) -> None:
    """End this process now (no interpreter teardown: its other threads may be stuck in native
    code), and its process group with it when it leads one (its own children, e.g. TP workers)."""
    try:
        os.write(2, f"megarl: parent process {parent_pid} is gone; pid {os.getpid()} exits\n".encode())
    except OSError:
        pass
    if os.getpgrp() == os.getpid():
        try:
            os.killpg(os.getpid(), signal.SIGKILL)  # includes this process
        except OSError:
            pass
    os._exit(1)


# ---------------------------------------------------------------------------- controller side
class JobInterrupted(BaseException):
    """The job received a termination signal. A BaseException (like KeyboardInterrupt) so that
    ``except Exception`` blocks in the loop do not swallow it on its way to the ExitStack."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal_name(signum)}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def defer_sigterm_to_controller(who: str) -> None:
    """For a process a launcher started beside the controller (an attached trainer rank or
    generator replica): SIGTERM (scancel, a preemption or requeue signals every process of the
    job) no longer kills it. The controller checkpoints through it and then tells it to exit; if
    the controller is gone instead, its connection closes and it exits then. SIGKILL (KillWait)
    still ends it."""
    if not spawned_from_main_thread():
        return

    def handler(signum: int, frame) -> None:
        try:
            os.write(2, f"megarl: {who} received {signal_name(signum)}: waiting for the controller to checkpoint "
                        f"and end the job\n".encode())
        except OSError:
            pass

    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, handler)


PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the job checkpointed after SIGTERM and should be requeued


class Preempted(JobInterrupted):
    """SIGTERM / SIGUSR1 under a launcher (scancel, preemption, requeue, the time limit's signal):
    the job has checkpointed and exits with :data:`PREEMPTED_EXIT` so that the launcher requeues it.
    ``requeue=False`` (a plain ``megarl train``: SIGTERM, the first Ctrl-C, SIGUSR1): it exits with
    ``128 + signum`` like any command a signal ended, and rerunning the same command resumes."""

    def __init__(self, signum: int = signal.SIGTERM, requeue: bool = True):
        super().__init__(signum)
        self.requeue = requeue
        self.set_step(None)

    def set_step(self, step: int | None) -> None:
        """Name the step the checkpoint holds (the controller knows it once it has saved)."""
        at = "" if step is None else f" at step {step}"
        self.args = ((f"preempted by {signal_name(self.signum)}; checkpointed{at} for a requeue",) if self.requeue
                     else (f"interrupted by {signal_name(self.signum)}; checkpointed{at}: rerun the same command to "
                           f"resume",))

    @property
    def exit_code(self) -> int:
        return PREEMPTED_EXIT if self.requeue else 128 + self.signum


def rerun_note(checkpoints: str | os.PathLike | None) -> str:
    """What rerunning the same command does after a job stopped without a new checkpoint, from the
    checkpoint folder's ``latest`` (it moves only once a save is complete); ``checkpoints`` None: not
    known, both cases said."""
    if checkpoints is None:
        return ("a rerun resumes from the newest checkpoint; with none yet, rerun with --overwrite to start over "
                "in the run folder")
    from megarl.utils.checkpoint_store import LATEST, step_of

    try:
        step = step_of((Path(checkpoints) / LATEST).read_text().strip())
    except (OSError, UnicodeDecodeError):
        step = None
    if step is None:  # the run folder holds this run's files: a plain rerun is refused, --overwrite starts over
        return "no checkpoint yet: rerun with --overwrite to start over in the run folder"
    return f"a rerun resumes from step {step}"


class Preemption:
    """The controller's view of a preemption request. SIGTERM sets it (:func:`signals_raise` with
    ``preemption=``); it is acted on only where the job's state is whole: :meth:`check` raises
    :class:`Preempted` there, unless inside :meth:`deferred` (a train step, a weight sync, a
    checkpoint: they finish first). Waits that may be long and are safe to abandon (the generator
    waiting for rollouts) call :func:`raise_if_preempted` on every poll."""

    def __init__(self, *, requeue: bool = True, grace_s: float = 0.0,
                 checkpoints: str | os.PathLike | None = None) -> None:
        """``requeue``: under a launcher (SIGTERM / SIGUSR1 request it, every time; the launcher
        bounds the wait). ``requeue=False``: a plain run (SIGTERM, SIGINT, SIGUSR1 request it once
        the loop is :attr:`armed`, a second signal exits at once, and this process exits by itself,
        ``128 + signum``, when the checkpoint is not written ``grace_s`` seconds after the signal).
        ``checkpoints``: the job's checkpoint folder, read when the grace time runs out to say what a
        rerun does (None: not known, the message says both cases)."""
        self.signum = 0
        self.at = 0.0  # time.monotonic() of the request
        self.requeue = requeue
        self.grace_s = float(grace_s)
        self.checkpoints = checkpoints
        self.armed = requeue  # plain runs: only inside the loop (before it a signal just stops the job)
        self._defer = 0
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return bool(self.signum)

    @property
    def signals(self) -> tuple[int, ...]:
        return PREEMPT_SIGNALS if self.requeue else PLAIN_CHECKPOINT_SIGNALS

    def request(self, signum: int) -> None:
        if self.signum:
            return
        self.signum, self.at = int(signum), time.monotonic()
        if self.requeue:
            log.warning("received %s: checkpointing and exiting for a requeue (the generation in flight is "
                        "abandoned; a train step or sync in flight finishes first)", signal_name(signum))
            return
        log.warning("received %s: checkpointing, then exiting (the generation in flight is abandoned; a train step "
                    "or sync in flight finishes first; at most %gs, cluster.preempt_grace_s); a second signal "
                    "exits at once without a checkpoint", signal_name(signum), self.grace_s)
        if self.grace_s > 0:
            self._timer = threading.Timer(self.grace_s, self._grace_over)
            self._timer.daemon = True
            self._timer.start()

    def _grace_over(self) -> None:
        """The checkpoint was not written in time: exit hard (the children's parent watch ends them;
        a save cut here never counts as complete, ``latest`` stays on the previous checkpoint)."""
        try:
            note = rerun_note(self.checkpoints)
        except Exception:  # noqa: BLE001 - nothing may keep this thread from exiting the process
            note = rerun_note(None)
        try:
            os.write(2, f"megarl: no checkpoint within cluster.preempt_grace_s={self.grace_s:g}s of "
                        f"{signal_name(self.signum)}; exiting now ({note})\n".encode())
        except OSError:
            pass
        os._exit(128 + self.signum)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1

    def check(self) -> None:
        if self.signum and not self._defer:
            raise Preempted(self.signum, requeue=self.requeue)


_PREEMPTION: Preemption | None = None  # the one installed by signals_raise(preemption=...)


def raise_if_preempted() -> None:
    """Raise :class:`Preempted` when a preemption was requested and nothing defers it."""
    if _PREEMPTION is not None:
        _PREEMPTION.check()


def preemption_requested() -> bool:
    """Whether the job's preemption (installed by :func:`signals_raise`) was requested: it is being served."""
    return _PREEMPTION is not None and _PREEMPTION.requested


@contextlib.contextmanager
def signals_raise(signals: Sequence[int] = DEFAULT_SIGNALS,
                  preemption: Preemption | None = None) -> Iterator[None]:
    """While inside, each of ``signals`` raises :class:`JobInterrupted` in the main thread; a
    second one (while the first unwinds) exits the process at once with ``128 + signum``. The
    previous handlers are restored on exit. Off the main thread (where Python cannot install
    handlers) it does nothing and says so. With ``preemption`` (a job under a launcher), SIGTERM and
    SIGUSR1 (:data:`PREEMPT_SIGNALS`) only request it (every later one too: Slurm may signal twice);
    SIGINT / SIGHUP as above. With a plain run's ``preemption`` (``requeue=False``), once it is armed
    the first SIGTERM / SIGINT / SIGUSR1 requests it and any second signal exits at once."""
    global _PREEMPTION
    if not spawned_from_main_thread():
        log.warning("signal handlers can only be installed from the main thread; %s keep their "
                    "current handlers", ", ".join(signal_name(s) for s in signals))
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame) -> None:
        plain_requested = preemption is not None and not preemption.requeue and preemption.requested
        if (preemption is not None and preemption.armed and signum in preemption.signals and not fired
                and not plain_requested):
            preemption.request(signum)  # under a launcher every later one too: Slurm may signal twice
            return
        if fired or plain_requested:  # already unwinding: do not interrupt the cleanup with a second exception
            try:
                os.write(2, f"megarl: second signal ({signal_name(signum)}) while shutting down; "
                            f"exiting now\n".encode())
            except OSError:
                pass
            os._exit(128 + signum)
        fired.append(signum)
        log.warning("received %s: stopping the job (closing every executor)", signal_name(signum))
        raise JobInterrupted(signum)

    previous = {}
    if preemption is not None:
        signals = tuple(dict.fromkeys([*signals, *preemption.signals]))
    try:
        for s in signals:
            previous[s] = signal.signal(s, handler)
        _PREEMPTION = preemption
        yield
    finally:
        _PREEMPTION = None
        if preemption is not None:
            preemption.cancel_timer()
        for s, old in previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (Linux cpu-list syntax); ``""`` -> ``[]``. Raises ValueError
    naming the bad part."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"{part!r} is not a core number or range like 0-3")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def cpu_list_problem(text: str, setting: str) -> str | None:
    """Why the core list ``text`` (Linux cpu-list syntax) cannot bind here, as ``'<setting>: ...'``: not a
    core list, or cores this process may not run on (its affinity: the machine's, or what Slurm or taskset
    gave it); None when every core is there. cluster.trainer_cpus and generator.threads_bind use it."""
    try:
        cores = parse_cpu_list(text)
    except ValueError as e:
        return f"{setting}: {e}"
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    if set(cores) - set(allowed):
        return f"{setting}: cores {sorted(set(cores) - set(allowed))} are not available here (allowed: {allowed})"
    return None
