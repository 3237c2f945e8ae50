"""Which checkpoint, in the trainer's config terms: the checkpoint folder ``trainer.checkpoint_dir`` names,
the step folder ``trainer.resume_from`` asks for, and when a step is saved.

The folder itself (names, index, manifest check, staging, who deletes what) is
:mod:`megarl.utils.checkpoint_store`'s; its names are importable from here too. No torch here: the
controller picks the folder before any rank starts. Saving and loading: :mod:`megarl.trainer.checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from megarl.utils.checkpoint_store import (FORMAT, LATEST, META, STEP_PREFIX, CheckpointError,  # noqa: F401
                                           checkpoint_problem, file_crc32, latest_checkpoint, list_checkpoints,
                                           newest_complete, resolve_checkpoint, resume_folder, step_dir_name)
from megarl.utils.checkpoint_store import checkpoint_root as store_root
from megarl.utils.checkpoint_store import manifest as _manifest  # noqa: F401 (tests' name)
from megarl.utils.checkpoint_store import step_of as _step_of  # noqa: F401 (tests' name)

if TYPE_CHECKING:
    from megarl.trainer.config import TrainerConfig


def checkpoint_root(cfg: "TrainerConfig", run_dir: str | Path) -> Path:
    """trainer.checkpoint_dir, or <run dir>/checkpoints when it is ''."""
    return store_root(cfg.checkpoint_dir, run_dir)


def resume_path(cfg: "TrainerConfig", run_dir: str | Path, *, require: Sequence[str] = (),
                checksums: Optional[bool] = None) -> Optional[Path]:
    """The step folder trainer.resume_from asks for; None = start fresh (the store's :func:`resume_folder`
    under :func:`checkpoint_root`)."""
    return resume_folder(cfg.resume_from, checkpoint_root(cfg, run_dir), require=require, checksums=checksums)


def should_save(cfg: "TrainerConfig", step: int, last_step: int) -> bool:
    """Save after `step` (1-based count of finished steps)? Every checkpoint_interval steps (0 = off)
    and always after the last step."""
    every = cfg.checkpoint_interval
    return step == last_step or (every > 0 and step % every == 0)


__all__ = ["CheckpointError", "FORMAT", "LATEST", "META", "STEP_PREFIX", "checkpoint_problem", "checkpoint_root",
           "file_crc32", "latest_checkpoint", "list_checkpoints", "newest_complete", "resolve_checkpoint",
           "resume_path", "should_save", "step_dir_name"]
