"""The one executor protocol: a group of processes with its own parallelism, seen from the controller.

An executor is started, asked whether it is healthy, and closed; in between the controller calls
its own methods (train a step, generate, score). Everything an executor starts is supervised: a
process that dies or stops answering raises :class:`ProcessDied` / :class:`ExecutorTimeout`
naming it, and every process of the executor is ended (no orphans holding cores or devices).

    with SomeExecutor(cfg, ...) as ex:      # __enter__ calls start()
        ex.health()                         # one dict per process; raises if one is dead
        ...
    # __exit__ calls close(): processes asked to exit in order, leftovers killed

Implementations: ``megarl.trainer.executor.TrainerExecutor`` (TP x PP x DP Megatron ranks),
``megarl.generator.executor.GeneratorExecutor`` (vLLM replicas) and ``megarl.reward.RewardPool``
(the scoring processes). Their errors derive from the classes below, so a caller can catch any
executor's death or timeout alike.
"""

from __future__ import annotations

import os
import signal
from typing import Protocol, Self, runtime_checkable



class ExecutorError(RuntimeError):
    """An executor cannot continue; the message names the process and why."""


class ProcessDied(ExecutorError):
    """A process of the executor exited, was killed, or raised."""


class ExecutorTimeout(ExecutorError, TimeoutError):
    """A process of the executor did not answer within its configured timeout."""


@runtime_checkable
class Executor(Protocol):
    """What the controller may rely on for every executor."""

    def start(self) -> Self:
        """Spawn the processes and wait (bounded by the executor's start timeout) until every one
        is ready; on failure, nothing it started is left running. Returns self."""

    def health(self) -> list[dict]:
        """One dict per process (at least ``pid``); raises :class:`ExecutorError` if one is dead
        or does not answer."""

    def close(self) -> None:
        """Ask every process to exit, kill those that do not in time; idempotent."""

    @property
    def pids(self) -> list[int]:
        """The pids of the executor's processes (to check that none outlives it)."""


class ExecutorBase:
    """Context-manager plumbing for executors: ``with ex:`` starts it and always closes it."""

    def start(self) -> Self:  # pragma: no cover - implemented by subclasses
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - implemented by subclasses
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def exit_cause(exitcode: int | None) -> str:
    """How a process ended, from ``multiprocessing.Process.exitcode`` (negative = signal)."""
    if exitcode is None:
        return "closed its channel but is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"was killed by signal {-exitcode} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def kill_processes(processes: list, join_s: float = 5.0) -> None:
    """SIGKILL every process still running, and its process group when it leads one (children it
    started), then reap it. Safe to call repeatedly, also from a ``weakref.finalize``."""
    for p in processes:
        if p.pid is None or p.exitcode is not None:
            continue
        try:
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in processes:
        if p.pid is not None:
            p.join(join_s)
