"""One critic rank's learner: the value model, its optimizer, checkpoint and resume.

The critic's counterpart of the trainer's ``RankTrainer`` (megarl/trainer/local.py), for a rank
that already joined its process group and ``init_model_parallel`` (TP/PP/DP of the TrainerConfig it
is given: the critic's layout). Checkpoints go through the trainer's own ``save_checkpoint`` /
``load_checkpoint`` (megarl/trainer/checkpoint.py), so a critic checkpoint reshards to another
TP/PP/DP exactly as the trainer's does; they live in ``<trainer checkpoint folder>/<critic.checkpoint_subdir>``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from megarl.batch import RolloutBatch
from megarl.critic.config import CriticConfig
from megarl.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


class CriticLearner:
    """``values(batch)``, ``step(batch, old_values, targets)``, ``save()`` (collective over the critic's ranks)."""

    def __init__(self, trainer_cfg: TrainerConfig, critic_cfg: CriticConfig, policy_dir: str | Path, *,
                 total_steps: int, run_dir: str | Path, resume_from: str | None = None):
        from megarl.critic.model import build_value_model
        from megarl.trainer.checkpoint import TrainProgress, checkpoint_root, load_checkpoint
        from megarl.trainer.optimizer import build_training, params_dtype
        from megarl.utils.checkpoint_store import resume_folder

        problems = critic_cfg.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.critic_cfg = critic_cfg
        self.cfg = dataclasses.replace(trainer_cfg, lr=critic_cfg.lr)  # the critic's own LR
        self.source = Path(critic_cfg.path or policy_dir)
        self.micro_batch_size = critic_cfg.micro_batch_size or trainer_cfg.micro_batch_size
        self.model = build_value_model(self.source, params_dtype=params_dtype(self.cfg),
                                       head_init_std=critic_cfg.head_init_std, seed=trainer_cfg.seed)
        self.objs = build_training(self.cfg, self.model, total_steps)  # one critic update a step
        self.checkpoint_dir = checkpoint_root(trainer_cfg, run_dir) / critic_cfg.checkpoint_subdir
        self.progress = TrainProgress(step=0, consumed_samples=0)
        resume = resume_folder(resume_from if resume_from is not None else trainer_cfg.resume_from,
                               self.checkpoint_dir)
        if resume is not None:
            log.info("critic: resuming from %s", resume)
            self.progress = load_checkpoint(resume, model=self.objs.model, optimizer=self.objs.optimizer,
                                            scheduler=self.objs.scheduler, load_rng=False)

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """V of every prefix ``[B, S]`` (aligned like logprobs), on every rank."""
        from megarl.critic.model import compute_values

        return compute_values(self.objs.model[0], batch, micro_batch_size=self.micro_batch_size)

    def step(self, batch: RolloutBatch, old_values: torch.Tensor, targets: torch.Tensor) -> dict:
        """One critic update towards ``targets`` (GAE returns / V-trace targets), clipped around
        ``old_values``; metrics ``critic/value_loss``, ``critic/explained_var`` (of ``old_values``),
        ``critic/grad_norm``, ``critic/lr``."""
        from megarl.algorithms.value_targets import explained_variance
        from megarl.critic.model import critic_update

        clip = self.critic_cfg.value_clip or None
        metrics = critic_update(self.objs, batch, old_values, targets, value_clip=clip,
                                micro_batch_size=self.micro_batch_size)
        metrics["critic/explained_var"] = explained_variance(old_values, targets, batch.loss_mask)
        self.progress.step += 1
        self.progress.consumed_samples += batch.batch_size
        return metrics

    def save(self) -> Path:
        """Atomic checkpoint of the value model, its optimizer and scheduler, and progress."""
        from megarl.trainer.checkpoint import save_checkpoint

        return save_checkpoint(self.checkpoint_dir, model=self.objs.model, optimizer=self.objs.optimizer,
                               scheduler=self.objs.scheduler, progress=self.progress,
                               keep_last=self.cfg.keep_checkpoints)
