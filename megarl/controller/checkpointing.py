"""The loop's checkpoints: a save on schedule, a save on preemption, and the controller's part of a resume.

A checkpoint is the trainer's save with the controller's state staged first (controller/state.py), so
the step folder's manifest covers both; with a critic (algorithm.advantage gae|vtrace) its save of the same
step comes first, in its own folder (megarl/critic/executor.py), so a step the trainer saved always has its critic. :func:`checkpoint_on_preemption` wraps the loop: a preempted
step is saved (unless it was just saved) before the job exits. :func:`resume_controller` puts back what
the controller saved with the step folder the job resumed from (config/job.py ``resume_dir``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from megarl.config import ConfigError
from megarl.config.schema import MegaRLConfig
from megarl.controller.dynamic_sampling import DynamicSampling
from megarl.controller.rollouts import RolloutQueue
from megarl.controller.run import RunFolder
from megarl.controller.state import load_controller_state, own_checkpoint, stage_controller_state
from megarl.executors.base import Trainer
from megarl.utils.procs import Preempted, Preemption

log = logging.getLogger("megarl")


def checkpoint(cfg: MegaRLConfig, trainer: Trainer, rollouts: RolloutQueue, critic=None,
               metrics_row: dict | None = None) -> float:
    """Save the trainer with the controller's part (data cursor, admitted rollouts, ``metrics_row``:
    the step's metrics, logged after the save) staged first, so the step folder's manifest covers both
    (controller/state.py), after the critic's save of the step (``critic``: a CriticExecutor or None);
    the seconds it took (with trainer.async_save: the snapshot's, the write goes on behind the next step)."""
    t0 = time.monotonic()
    if critic is not None:
        critic.save()
    stage_controller_state(cfg, policy_version=trainer.step_count, rollouts=rollouts.state_dict(),
                           metrics_row=metrics_row)
    trainer.save()
    return time.monotonic() - t0


@contextlib.contextmanager
def checkpoint_on_preemption(cfg: MegaRLConfig, trainer: Trainer, rollouts: RolloutQueue,
                             preempt: Preemption, saved: int = 0, critic=None) -> Iterator[None]:
    """Arms ``preempt`` (a plain run's signals checkpoint from here on). On :class:`Preempted`: save
    the trainer at its current step with the controller's state (the step being generated is in it,
    with its finished samples and partial rollouts), unless that step was just saved on schedule or
    is the one the run resumed from (``saved``), then let it propagate (the job exits with
    PREEMPTED_EXIT under a launcher, 128 + signum in a plain run). ``critic``: saved with the trainer."""
    from megarl.trainer.checkpoint_index import should_save

    preempt.armed = True
    try:
        yield
    except Preempted as exc:
        version = trainer.step_count
        with preempt.deferred():
            if version and version != saved and not should_save(cfg.trainer, version, cfg.controller.steps):
                checkpoint(cfg, trainer, rollouts, critic)
            trainer.wait_saves()  # trainer.async_save: the write in flight, within cluster.preempt_grace_s
        exc.set_step(version)
        if not version and not exc.requeue:
            exc.args = (f"{exc.args[0].split(';')[0]} before the first step was trained: nothing to checkpoint",)
            log.warning("interrupted before the first step was trained: no checkpoint")
        elif exc.requeue:
            log.warning("preempted: checkpoint of step %d in place %.1fs after the signal; exiting for a requeue "
                        "(the restarted job resumes there, losing no step)", version, time.monotonic() - preempt.at)
        else:
            log.warning("interrupted: checkpoint of step %d in place %.1fs after the signal; exiting (rerun the "
                        "same command to resume at step %d)", version, time.monotonic() - preempt.at, version)
        raise


def resume_controller(cfg: MegaRLConfig, run: RunFolder, version: int, resume_dir: Path | None,
                      rollouts: RolloutQueue, sampling: DynamicSampling | None = None) -> None:
    """After the trainer resumed at ``version`` from ``resume_dir``: drop what later steps of the killed
    run logged, put back step ``version``'s metrics row if the kill came between its save and its log,
    and the rollouts admitted ahead of it with the data cursor (controller/state.py)."""
    if sampling is not None:
        sampling.rewind(version)  # a fresh run (0) starts its dynamic_sampling.jsonl empty
    if version == 0:
        return
    run.rewind(version)
    try:
        state = load_controller_state(resume_dir, policy_version=version, data_seed=cfg.data.seed)
        if state is not None:
            if own_checkpoint(cfg, resume_dir):  # a checkpoint of another run (by path): its rows are that run's
                run.restore_row(version, state.get("metrics_row"))
            got = rollouts.load_state_dict(state["rollouts"])
            log.info("resume: %d admitted batch(es) back, %d finished sample(s) kept, %d partial rollout(s) "
                     "continue under weights v%d", got["batches"], got["finished"], got["unfinished"], version)
    except ValueError as e:
        raise ConfigError([f"trainer.resume_from={cfg.trainer.resume_from!r}: {e}"]) from None


__all__ = ["checkpoint", "checkpoint_on_preemption", "resume_controller"]
