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

Beside the lifecycle, each role has one interface (:class:`Trainer`, :class:`Generator`,
:class:`RewardScorer`): what the controller calls on it, and all it may call. The controller is
typed against these, never against an implementation, so a trainer in this process
(``LocalTrainer``) and one of many ranks (``TrainerExecutor``) are interchangeable, as NeMo-RL's
``PolicyInterface`` / ``GenerationInterface`` make theirs. tests/e2e/test_role_protocols.py calls
every method of each on every implementation.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

if TYPE_CHECKING:  # annotations only: at run time this module imports nothing of megarl
    import torch

    from megarl.batch import RolloutBatch
    from megarl.ddma.layouts import TrainerTopology
    from megarl.ddma.sync import SyncSpec
    from megarl.rollout import Sample


class ExecutorError(RuntimeError):
    """An executor cannot continue; the message names the process and why. Where it is raised, the
    executor also sets what the command's last line names (megarl.utils.errors): ``component`` (the
    process, with pid and node), ``log_path`` (its own log) and ``remote_error`` (the class it
    raised, from its traceback, when it raised one)."""

    component: str | None = None
    log_path: str | None = None
    remote_error: str | None = None


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


class Trainer(Protocol):
    """The learner, as the controller's loop and weight sync drive it. Calls are made one at a time;
    between :meth:`start_sync` and :meth:`finish_sync` (or :meth:`abandon_sync`) only
    :meth:`raise_if_dead` may be called."""

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (= the policy version of the weights); after a resume, the
        checkpoint's step."""

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on the whole global batch; the step's metrics (``train/*`` without
        the prefix)."""

    def logprobs(self, batch: RolloutBatch, temperature: float | None = None) -> torch.Tensor:
        """Per-token logprobs ``[b, s]`` under the current weights (``temperature``: default
        ``trainer.logprob_temperature``); the weight probe compares them with the engine's."""

    def save(self) -> Path:
        """Checkpoint everything a resume needs; the step folder it wrote (with
        ``trainer.async_save``: the one it is writing, complete after :meth:`wait_saves`)."""

    def wait_saves(self) -> None:
        """Wait for a background checkpoint write in flight (``trainer.async_save``) and commit it;
        nothing when none is."""

    def topology(self) -> TrainerTopology:
        """The layout (tp, pp, dp) the DDMA planner plans the trainer's side of a sync for."""

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight: gathered in the caller's process, so for checks
        and the full-tensor push only, never on the DDMA path."""

    def start_sync(self, spec: SyncSpec, version: int) -> None:
        """Start sending this trainer's shards of weights ``version`` for ``spec``; returns at once,
        so the generator can be told to receive meanwhile."""

    def finish_sync(self) -> list[dict]:
        """Wait for the send :meth:`start_sync` began; one stats dict per rank (rank, tp, pp, dp,
        bytes_sent, transfer_s, quantize_s, verify_s), in rank order."""

    def abandon_sync(self, why: str) -> None:
        """The receivers failed mid-sync: stop the send now instead of waiting out its timeout
        (which hides the cause). A trainer of several processes is unusable afterwards."""

    def raise_if_dead(self) -> None:
        """Raise :class:`ExecutorError` if the trainer cannot go on (:class:`ProcessDied`: one of
        its processes exited); cheap, reads no message, so it is safe while a sync is in flight
        (the generator's wait calls it)."""


class Generator(Protocol):
    """The rollout engines, as the controller's rollout queue, evaluation and weight sync drive
    them. Samples come back as :class:`megarl.rollout.Sample`; a weight update lands between decode
    steps, so a sample's tokens carry the versions that made them."""

    def submit(self, prompts: Sequence[Sequence[int]], n_samples: int | None = None,
               max_new_tokens: int | None = None, prompt_indices: Sequence[int] | None = None,
               sampling: dict | None = None, round_token_budget: int | None = None) -> list[int]:
        """Queue ``n_samples`` generations of each prompt (token ids); their group ids, one per
        prompt. ``sampling`` overrides the configured sampling for these prompts."""

    def collect(self, min_samples: int | None = None, timeout_s: float | None = None) -> list[Sample]:
        """Finished samples, waiting until ``min_samples`` are ready (default: all submitted)."""

    def poll(self) -> list[Sample]:
        """Finished samples so far, without waiting."""

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until no round is in flight (cut partial rollouts stay cached)."""

    def generate(self, prompts: Sequence[Sequence[int]], n_samples: int | None = None,
                 max_new_tokens: int | None = None, sampling: dict | None = None,
                 round_token_budget: int | None = None) -> list[Sample]:
        """Submit and wait for all samples of ``prompts``, ordered by prompt then sample index;
        samples of earlier submits stay collectable."""

    def snapshot(self, groups: set[int]) -> list[dict]:
        """The unfinished samples of ``groups`` as plain data, for the controller's checkpoint."""

    def restore(self, tracks: Sequence[dict], groups: Sequence[int] = ()) -> dict[int, int]:
        """Continue :meth:`snapshot`'s samples under the current weights; ``{old group id: new}``
        for every group of ``tracks`` and ``groups``."""

    def activity(self) -> dict[str, float]:
        """Seconds spent decoding (``busy_s``) and loading weights (``load_s``) since start, per
        replica on average: the controller's busy/idle accounting."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> float:
        """Load full HF tensors into every engine as policy ``version``; the seconds it took."""

    def update_weights_from_source(self, source: dict, version: int, *,
                                   peer_check: Callable[[], None] | None = None) -> float:
        """Load weights ``version`` from a prepared source (e.g. ``SyncSpec.weight_source``) into
        every engine; ``peer_check`` is called while waiting and raises if the sender died. The
        seconds it took."""


class RewardScorer(Protocol):
    """Scores samples in place: the training reward (``RewardPool``) and the strict held-out scorer
    (``controller.evaluation.StrictScorer``) take the same call, so a sample is one record from
    the generator to the metrics."""

    def score(self, samples: Sequence[Sample], answers: Sequence[str],
              decode: Callable[[Sequence[int]], str]) -> None:
        """Set ``reward``, ``correct`` and ``formatted`` of every sample. ``answers[i]``: the gold
        answer of prompt ``i`` (a sample's is ``answers[sample.prompt_index]``); ``decode``: token
        ids to text."""


@runtime_checkable
class Launchable(Protocol):
    """An executor whose start-up can overlap another's (:func:`start_together`); its ``start()`` is
    ``launch().await_ready()``. Each step leaves nothing running when it fails."""

    def launch(self) -> Self:
        """Spawn (or accept) the processes and return without waiting for them to be ready."""

    def await_ready(self, also_check: Callable[[], None] | None = None) -> Self:
        """Wait until every process is ready, within the start timeout counted from :meth:`launch`;
        ``also_check()`` runs at every look and raises to end the wait."""

    def has_exited(self) -> bool:
        """Whether a launched process has exited; reads no message (:meth:`await_ready` says why)."""

    def close(self) -> None: ...

    def __exit__(self, *exc) -> None: ...


class _Exited(Exception):
    def __init__(self, executor: Launchable):
        self.executor = executor


def start_together(stack: ExitStack, executors: dict[str, Launchable]) -> dict[str, float]:
    """Launch every executor, then wait for each: their start-ups overlap, so a job starts in the time
    of its slowest executor, not the sum (a trainer building Megatron while vLLM loads). Each is on
    ``stack`` (closed in reverse when the job ends) before it launches, so a failure closes them all.
    While one is awaited, a process of another that exits ends the wait at once, and the failed
    one's own wait raises its cause (its traceback, its log). Returns, per name, the seconds from the
    first launch until that executor was ready."""
    t0 = time.monotonic()
    for ex in executors.values():
        stack.push(ex)  # its __exit__ closes it; pushed first: a launch that fails half-way is closed too
        ex.launch()
    ready: dict[str, float] = {}
    for name, ex in executors.items():
        # those not yet ready: a ready one that dies is caught at its next use, naming the cause
        others = [o for n, o in executors.items() if o is not ex and n not in ready]

        def another_exited() -> None:
            for o in others:
                if o.has_exited():
                    raise _Exited(o)

        try:
            ex.await_ready(another_exited)
        except _Exited as e:
            e.executor.await_ready()  # raises its own failure, naming the process and why
            raise ProcessDied(f"{type(e.executor).__name__}: a process exited during start-up "
                              f"({type(ex).__name__} was starting)") from None
        ready[name] = time.monotonic() - t0
    return ready


def start_in_turn(stack: ExitStack, executors: dict[str, Launchable]) -> dict[str, float]:
    """Start each executor once the one before it is ready (for executors that share devices: vLLM
    sizes its KV cache from the memory free when it starts); as :func:`start_together` otherwise."""
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    for name, ex in executors.items():
        offset = time.monotonic() - t0
        ready[name] = offset + start_together(stack, {name: ex})[name]
    return ready


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
