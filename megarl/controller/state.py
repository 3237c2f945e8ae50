"""The controller's part of a checkpoint: ``controller_state.json`` in the trainer's step folder.

Written right after the trainer's collective save of step ``s`` (atomically: temp file, fsync,
rename), read on ``trainer.resume_from`` before the first batch is admitted. It holds what the
trainer's weights do not: the policy version it belongs to, the data cursor and seed, and the
rollout queue (``RolloutQueue.state_dict``: admitted batches, their finished samples and partial
rollouts, the regeneration counter). A step folder without it (a kill between the two writes, or a
checkpoint of an older megarl) resumes with the data cursor alone: that step's admitted batches
are generated again, from the same prompts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("megarl")

FILE = "controller_state.json"


def save_controller_state(step_dir: Path, *, policy_version: int, data_seed: int, rollouts: dict) -> Path:
    from megarl.trainer.checkpoint import write_text_atomic

    path = Path(step_dir) / FILE
    write_text_atomic(path, json.dumps({"policy_version": policy_version, "data_seed": data_seed,
                                        "rollouts": rollouts}))
    return path


def load_controller_state(step_dir: Path | None, *, policy_version: int, data_seed: int) -> dict | None:
    """The rollout queue's state saved with ``step_dir``, or None (fresh run, or none was saved).
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
    return state["rollouts"]


__all__ = ["FILE", "load_controller_state", "save_controller_state"]
