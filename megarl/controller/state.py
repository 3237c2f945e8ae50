"""The controller's part of a checkpoint: ``controller_state.json`` in the trainer's step folder.

Staged right before the trainer's collective save of step ``s`` (:func:`stage_controller_state`:
temp file, fsync, rename into ``<checkpoint_dir>/.stage_step_<s>/``); the save moves it into the
step folder before it writes the manifest (``meta.json``, last), so a checkpoint is complete with
both parts or not at all: there is no moment at which ``latest`` names a step folder without it.
It holds what the trainer's weights do not: the policy version it belongs to, the data cursor and
seed, the rollout queue (``RolloutQueue.state_dict``: admitted batches, their finished samples
and partial rollouts, the regeneration counter), and the step's metrics row, which the loop logs after
the save (a kill in between would lose it; the resume writes it back).

At resume, :func:`pin_resume` picks the step folder once, in the controller, before any executor
starts: the newest one whose manifest verifies (sizes and CRC32) and lists ``controller_state.json``;
a damaged or partial newer one is reported in one WARNING naming the file and skipped. The trainer
ranks then load exactly that folder. A step folder given by path that lacks the file (a checkpoint
of an older megarl) resumes with the data cursor alone: that step's admitted batches are generated
again, from the same prompts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.utils.checkpoint_store import (CheckpointError, checkpoint_problem, checkpoint_root, list_checkpoints,
                                           resume_folder, stage_file)
from megarl.utils.metrics import scalar_metrics

if TYPE_CHECKING:
    from megarl.config.schema import MegaRLConfig

log = logging.getLogger("megarl")

FILE = "controller_state.json"


def run_checkpoint_root(cfg: MegaRLConfig) -> Path:
    """The job's checkpoint folder: trainer.checkpoint_dir, or <logging.out_dir>/<name>/checkpoints."""
    return checkpoint_root(cfg.trainer.checkpoint_dir, Path(cfg.logging.out_dir) / cfg.name)


# The keys whose change makes a checkpoint another run's: the trainer refuses another architecture
# by itself (the model signature in meta.json); these are checked before anything starts
# (megarl/controller/run.py claim_run_folder).
RESUME_KEYS = ("model.path", "data.train_path")


def own_checkpoint(cfg: MegaRLConfig, step_dir: Path) -> bool:
    """Whether ``step_dir`` is this run's own checkpoint (not one of another run named by path, whose
    metrics rows belong to that run's folder)."""
    return Path(step_dir).resolve().parent == run_checkpoint_root(cfg).resolve()


def resume_keys(cfg: MegaRLConfig) -> dict[str, str]:
    """The values of :data:`RESUME_KEYS` a checkpoint records (controller_state.json ``run``)."""
    return {"model.path": str(cfg.model.path), "data.train_path": str(cfg.data.train_path)}


def stage_controller_state(cfg: MegaRLConfig, *, policy_version: int, rollouts: dict,
                           metrics_row: dict | None = None) -> Path:
    """Stage the controller's state for the step-``policy_version`` checkpoint; call it right
    before ``trainer.save()``, which adopts it. ``metrics_row``: the step's metrics.jsonl row, which
    is written after the save (it holds the save's seconds), so a crash between the two has it back
    at resume. Raises ``CheckpointNoSpace`` on a full disk."""
    text = json.dumps({"policy_version": policy_version, "data_seed": cfg.data.seed, "rollouts": rollouts,
                       "run": resume_keys(cfg),  # a rerun refuses a checkpoint of another model or data
                       "metrics_row": None if metrics_row is None else scalar_metrics(metrics_row)})
    return stage_file(run_checkpoint_root(cfg), policy_version, FILE, text)


def pin_resume(cfg: MegaRLConfig, run_dir: Path) -> Path | None:
    """The one verified step folder trainer.resume_from names (None: start fresh), so the controller
    and every trainer rank load the same one (config/job.py ``ResolvedJob.resume_dir``; ``cfg`` is left
    as the user wrote it). 'auto' and a checkpoint dir take the newest complete checkpoint that holds
    the controller's state (a damaged newer one: one WARNING naming the file, then the previous one).
    Raises ConfigError when nothing usable is there."""
    from megarl.config import ConfigError

    if cfg.trainer.resume_from in (None, ""):
        return None
    root = checkpoint_root(cfg.trainer.checkpoint_dir, run_dir)
    try:
        path = resume_folder(cfg.trainer.resume_from, root, require=(FILE,), checksums=True,
                             also=_critic_of(cfg, root))
    except CheckpointError as e:
        raise ConfigError([f"trainer.resume_from={cfg.trainer.resume_from!r}: {e}"]) from None
    if path is not None:
        log.info("resume: step folder %s (trainer.resume_from=%s)", path, cfg.trainer.resume_from)
    return path


def _critic_of(cfg: MegaRLConfig, root: Path):
    """With a critic (gae/vtrace): a step is complete only with the critic's verified checkpoint of it
    (``<root>/<critic.checkpoint_subdir>/step_N``, megarl/critic/executor.py), so a damaged critic step
    falls back to an older common step as a damaged trainer step does. A critic folder with no checkpoint
    at all is no problem: the run had no critic, and it starts fresh (critic_resume says so)."""
    from megarl.algorithms.config import needs_critic

    if not needs_critic(cfg.algorithm):
        return None
    folder = root / cfg.critic.checkpoint_subdir

    def problem(step_dir: Path) -> str | None:
        if not list_checkpoints(folder):
            return None
        if not (folder / step_dir.name).is_dir():
            return f"the critic has no checkpoint of {step_dir.name} in {folder}"
        why = checkpoint_problem(folder / step_dir.name, checksums=True)
        return f"its critic checkpoint: {why}" if why else None

    return problem


def load_controller_state(step_dir: Path | None, *, policy_version: int, data_seed: int) -> dict | None:
    """The controller's state saved with ``step_dir`` (``rollouts``: the rollout queue's state;
    ``metrics_row``: the step's metrics row, or None), or None (fresh run, or none was saved).
    Raises ValueError when it belongs to another version or data seed than the resumed run."""
    if step_dir is None:
        return None
    path = Path(step_dir) / FILE
    if not path.is_file():
        log.warning("resume: %s has no %s; the batches admitted ahead of step %d are generated again "
                    "(same prompts)", step_dir, FILE, policy_version + 1)
        return None
    state = json.loads(path.read_text())
    if state["policy_version"] != policy_version:
        raise ValueError(f"{path} is for policy version {state['policy_version']} but the trainer resumed at "
                         f"{policy_version}; the checkpoint folder is inconsistent")
    if state["data_seed"] != data_seed:
        raise ValueError(f"{path} was written with data.seed={state['data_seed']}, this run has "
                         f"data.seed={data_seed}; resume with the same seed or start a new run")
    return state


__all__ = ["FILE", "load_controller_state", "own_checkpoint", "pin_resume", "run_checkpoint_root", "stage_controller_state"]
