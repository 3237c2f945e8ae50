"""One critic rank's learner: the value model, its optimizer, checkpoint and resume.

The critic's counterpart of the trainer's ``RankTrainer`` (megarl/trainer/local.py), for a rank
that already joined its process group and ``init_model_parallel`` (TP/PP/DP of the TrainerConfig it
is given: the critic's layout). Checkpoints go through the trainer's own ``save_checkpoint`` /
``load_checkpoint`` (megarl/trainer/checkpoint.py), so a critic checkpoint reshards to another
TP/PP/DP exactly as the trainer's does; they live in ``<trainer checkpoint folder>/<critic.checkpoint_subdir>``.

:class:`CriticRank` is the learner as a rank process of the critic's executor serves it (megarl/trainer/
worker.py builds it for a :class:`megarl.critic.executor.CriticRanksConfig`): ``values`` and ``step`` on a
:class:`CriticUpdate`, ``save``, ``step_count``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
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

    def step(self, batch: RolloutBatch, old_values: torch.Tensor, targets: torch.Tensor, *, minibatches: int = 1,
             epochs: int = 1) -> dict:
        """``epochs`` passes over ``batch`` split into ``minibatches`` along prompt groups (the policy's
        PPO schedule, trainer.minibatches x trainer.epochs), one critic update each towards ``targets``
        (GAE returns / V-trace targets), clipped around ``old_values`` (so the clip binds from the second
        update on); metrics ``critic/value_loss`` and ``critic/clip_frac`` (token-weighted over the
        updates), ``critic/explained_var`` (of ``old_values``), ``critic/grad_norm``, ``critic/lr`` (the last
        update's), ``critic/updates``."""
        from megarl.algorithms.value_targets import explained_variance
        from megarl.critic.model import critic_update

        clip = self.critic_cfg.value_clip or None
        # old values and targets ride along in the batch's spare per-token fields, so the split slices them alike
        full = dataclasses.replace(batch, prox_logprobs=old_values.float(), ref_logprobs=targets.float())
        sums = {"critic/value_loss": 0.0, "critic/clip_frac": 0.0}
        tokens = 0.0
        for _ in range(epochs):
            for part in full.minibatches(minibatches):
                metrics = critic_update(self.objs, part, part.prox_logprobs, part.ref_logprobs, value_clip=clip,
                                        micro_batch_size=self.micro_batch_size)
                n = max(float(part.loss_mask.sum()), 1.0)
                for key in sums:
                    sums[key] += metrics[key] * n
                tokens += n
        metrics.update({key: value / tokens for key, value in sums.items()})
        metrics["critic/updates"] = float(minibatches * epochs)
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


@dataclasses.dataclass
class CriticUpdate:
    """What one critic step trains on: the batch, the values its advantages used, the targets ``[B, S]``."""
    batch: RolloutBatch
    old_values: torch.Tensor
    targets: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.batch.batch_size


class CriticRank:
    """One rank of the critic's executor, in the shape the trainer's rank server drives (megarl/trainer/
    worker.py): ``values(batch)``, ``step(update)``, ``save()``, ``wait_saves()``, ``step_count``. ``cfg``:
    a :class:`megarl.critic.executor.CriticRanksConfig` (the critic's layout and LR, ``critic``, ``run_root``:
    the job's run folder, whose checkpoint folder holds the critic's; ``resume_from``: the critic's step folder)."""

    def __init__(self, cfg, algo, model_dir: str | Path, *, total_steps: int, run_dir: str | Path):
        base = TrainerConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainerConfig)})
        self.cfg = cfg
        # the LR schedule counts updates: trainer.minibatches x trainer.epochs a step, as the policy's
        self.learner = CriticLearner(base, cfg.critic, model_dir, total_steps=max(total_steps, 1) * cfg.minibatches
                                     * cfg.epochs, run_dir=cfg.run_root or run_dir, resume_from=cfg.resume_from or "")

    @property
    def step_count(self) -> int:
        return self.learner.progress.step

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        from megarl.utils.faults import injected

        if injected("critic_exit") is not None:  # fault tests: a critic rank dies as it is asked for values
            os._exit(9)
        return self.learner.values(batch)

    def step(self, update: CriticUpdate) -> dict:
        return self.learner.step(update.batch, update.old_values, update.targets, minibatches=self.cfg.minibatches,
                                 epochs=self.cfg.epochs)

    def save(self) -> Path:
        return self.learner.save()

    def wait_saves(self) -> None:
        """Saves are synchronous."""
