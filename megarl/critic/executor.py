"""The critic's executor: the value model's Megatron ranks, trained each step beside the policy (PPO).

``algorithm.advantage: gae`` or ``vtrace`` starts one (:func:`make_critic`). It is the trainer's
machinery by composition, as the distillation teacher's is: a ``TrainerExecutor`` given a
:class:`CriticRanksConfig` spawns, supervises and kills its ranks as the trainer's, and each rank
builds a :class:`megarl.critic.learner.CriticRank` (megarl/trainer/worker.py picks it by the config's
class) at the critic's own TP x PP x DP (``critic.tp/pp/dp``, 0 = the trainer's), with its own LR and
value clip. Its logs are ``<run>/critic/logs/trainer_rank<r>.log``; its checkpoints
``<trainer checkpoint folder>/<critic.checkpoint_subdir>/step_<N>``, saved at the trainer's checkpoint
steps and resumed with the trainer (the same step: :func:`critic_resume`).

Each step the controller calls :meth:`CriticExecutor.advantages` on the train batch (the critic's
values -> per-token advantages and targets, megarl/critic/targets.py), trains the policy on those
advantages, then :meth:`CriticExecutor.step` (its update towards the targets: critic/value_loss,
critic/explained_var, critic/clip_frac). Any failure of a critic rank stops the job with a
:class:`CriticFailed` naming the critic (its rank, pid and log).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from megarl.algorithms.config import AlgorithmConfig, needs_critic
from megarl.batch import RolloutBatch
from megarl.critic.config import CriticConfig
from megarl.critic.learner import CriticUpdate
from megarl.critic.targets import critic_targets
from megarl.executors.base import ExecutorBase, ExecutorError, ProcessDied
from megarl.trainer.config import TrainerConfig
from megarl.trainer.executor import TrainerExecutor, said_as
from megarl.utils.checkpoint_store import CheckpointError, list_checkpoints, step_dir_name, step_of

log = logging.getLogger(__name__)


class CriticFailed(ProcessDied):
    """A critic rank died, raised or went silent: the job stops, naming the critic."""


@dataclasses.dataclass
class CriticRanksConfig(TrainerConfig):
    """A ``TrainerConfig`` whose ranks build :class:`megarl.critic.learner.CriticRank`: the critic's layout and
    LR, the trainer's micro-batching, minibatches, epochs, schedule, dtype and timeouts."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    run_root: str = ""  # the job's run folder: its checkpoint folder holds the critic's (trainer.checkpoint_dir aside)

    @classmethod
    def of(cls, trainer: TrainerConfig, critic: CriticConfig, *, run_root: str, resume_from: str | None):
        values = {f.name: getattr(trainer, f.name) for f in dataclasses.fields(TrainerConfig)}
        tp, pp, dp = critic.layout(trainer)
        # The critic saves step N before the trainer does, so it keeps more: the trainer may resume at any step
        # it keeps, and its newest committed one lags the critic's by one save (the trainer's save of N cut) or
        # two (trainer.async_save: N-1's write still in flight). Pruned to the trainer's own count, a kill there
        # left a trainer step without its critic, and the run could not resume.
        keep = trainer.keep_checkpoints + (2 if trainer.async_save else 1)
        values.update(tp=tp, pp=pp, dp=dp, ep=1, lr=critic.lr, min_lr=min(trainer.min_lr, critic.lr),
                      lora_rank=0, async_save=False, resume_from=resume_from, keep_checkpoints=keep)
        return cls(**values, critic=critic, run_root=str(run_root))

    @staticmethod
    def rank_class():
        from megarl.critic.learner import CriticRank

        return CriticRank


class _CriticRanks(TrainerExecutor):
    """The trainer's executor with the value model's own command; its waits are logged as the critic's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._group.role = "critic"

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        out = self._call("values", (batch,), self.cfg.step_timeout_s, "the critic's values")
        return next(o for o in out if o is not None)


class CriticExecutor(ExecutorBase):
    """The value model's Megatron ranks: ``values(batch)``, ``advantages(batch, rewards)``, ``step(...)``, ``save()``."""

    def __init__(self, trainer_cfg: TrainerConfig, critic_cfg: CriticConfig, algo: AlgorithmConfig,
                 policy_dir: str | os.PathLike, *, run_dir: str | os.PathLike, total_steps: int,
                 resume_step: int = 0, cpus: list[int] | None = None, devices: Sequence[int] | None = None,
                 launcher: str = "local"):
        if not needs_critic(algo):
            raise ValueError(f"CriticExecutor needs algorithm.advantage gae or vtrace, got {algo.advantage!r}")
        problems = critic_cfg.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.algo = algo
        self._stats: dict[str, float] = {}
        folder = critic_checkpoints(trainer_cfg, critic_cfg, run_dir)
        resume = critic_resume(folder, resume_step)
        self.cfg = CriticRanksConfig.of(trainer_cfg, critic_cfg, run_root=str(run_dir),
                                        resume_from=str(resume) if resume else None)
        self.source = critic_cfg.path or str(policy_dir)
        # kl_coef/needs_ref are the policy's business: the critic's ranks build no reference model
        self._ranks = _CriticRanks(self.cfg, dataclasses.replace(algo, kl_coef=0.0), policy_dir, total_steps=total_steps,
                                   run_dir=Path(run_dir) / "critic", cpus=cpus, devices=devices, launcher=launcher,
                                   role="critic")  # slurm: its pool's ranks attach

    def start(self) -> "CriticExecutor":
        return self.launch().await_ready()

    def launch(self) -> "CriticExecutor":
        """Spawn (or accept) the ranks without waiting for them (megarl/executors/base.py: Launchable)."""
        log.info("starting the critic (value model, Megatron tp=%d pp=%d dp=%d, lr %g, value clip %g) from %s%s",
                 self.cfg.tp, self.cfg.pp, self.cfg.dp, self.cfg.lr, self.cfg.critic.value_clip, self.source,
                 f"; resuming from {self.cfg.resume_from}" if self.cfg.resume_from else "")
        self._guarded(self._ranks.launch)
        return self

    def has_exited(self) -> bool:
        return self._ranks.has_exited()

    def await_ready(self, also_check=None) -> "CriticExecutor":
        """Wait for the ranks; their step must be the trainer's (advantages pair them)."""
        self._guarded(self._ranks.await_ready, also_check)
        want = step_of(Path(self.cfg.resume_from).name) if self.cfg.resume_from else 0
        if self._ranks.step_count != want:  # the critic's step is the policy's: advantages pair them
            self.close()
            raise CheckpointError(f"critic: its ranks started at step {self._ranks.step_count}, the trainer's is {want} "
                                  f"({self.cfg.resume_from or 'a fresh start'})")
        return self

    def close(self) -> None:
        self._ranks.close()

    @property
    def pids(self) -> list[int]:
        return self._ranks.pids

    @property
    def step_count(self) -> int:
        """Critic updates taken (one a policy step): the trainer's step count after a resume."""
        return self._ranks.step_count

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """V of every prefix ``[B, S]`` of ``batch`` (aligned like logprobs; 0 off the tokens)."""
        return self._guarded(self._ranks.values, batch)

    def advantages(self, batch: RolloutBatch, rewards: Sequence[float], policy=None) -> tuple[RolloutBatch, CriticUpdate]:
        """``batch`` with the per-token advantages of algorithm.advantage from the critic's values, and the
        update that trains the critic towards its targets after the policy's step. ``policy``: the
        trainer (vtrace asks it for log pi of the batch, before its update)."""
        values = self.values(batch)
        logprobs = policy.logprobs(batch) if self.algo.advantage == "vtrace" else None
        adv, targets = critic_targets(self.algo, batch, rewards, values, policy_logprobs=logprobs)
        mask = batch.loss_mask.bool()
        self._stats = {f"critic/{name}_mean": float(x[mask].mean()) if mask.any() else 0.0
                       for name, x in (("value", values), ("target", targets), ("advantage", adv),
                                       ("advantage_abs", adv.abs()))}
        return dataclasses.replace(batch, advantages=adv.float()), CriticUpdate(batch, values, targets)

    def step(self, update: CriticUpdate) -> dict[str, float]:
        """One critic step on ``update`` (trainer.minibatches x trainer.epochs updates): the ranks' metrics
        (critic/value_loss, critic/clip_frac, critic/explained_var, critic/grad_norm, critic/lr, critic/updates)
        and the means over the loss tokens of the values, targets and advantages :meth:`advantages` gave
        (critic/value_mean, critic/target_mean, critic/advantage_mean, critic/advantage_abs_mean)."""
        if update.batch_size % self.cfg.dp:
            raise ValueError(f"a batch of {update.batch_size} sequences does not split over critic.dp={self.cfg.dp}")
        return {**self._guarded(self._ranks.step, update), **self._stats}

    def save(self) -> Path:
        """Checkpoint at the critic's step (= the trainer's): ``<checkpoint folder>/critic/step_<N>``."""
        return self._guarded(self._ranks.save)

    def raise_if_dead(self) -> None:
        self._guarded(self._ranks.raise_if_dead)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except ExecutorError as e:
            raise said_as(e, "critic", CriticFailed) from e


def critic_checkpoints(trainer_cfg: TrainerConfig, critic_cfg: CriticConfig, run_dir: str | os.PathLike) -> Path:
    """The critic's checkpoint folder: ``<trainer's checkpoint folder>/<critic.checkpoint_subdir>``."""
    from megarl.trainer.checkpoint_index import checkpoint_root

    return checkpoint_root(trainer_cfg, run_dir) / critic_cfg.checkpoint_subdir


def critic_resume(folder: Path, step: int) -> Path | None:
    """The critic's step folder for a trainer resuming at ``step`` (0: a fresh start, None). A run that
    never had a critic (its folder holds no checkpoint) starts the critic fresh, said in the log; a
    critic checkpoint folder without that step is refused, naming what it holds."""
    if not step:
        return None
    want = folder / step_dir_name(step)
    if want in list_checkpoints(folder):
        return want
    held = [step_of(p.name) for p in list_checkpoints(folder)]
    if not held:
        log.warning("critic: the trainer resumes at step %d but %s holds no critic checkpoint (the run had no "
                    "critic?); the critic starts from its initial weights", step, folder)
        return None
    raise CheckpointError(f"critic: the trainer resumes at step {step} but {folder} has no complete critic checkpoint "
                          f"of that step (it holds steps {held}); resume the trainer from one of those steps "
                          f"(trainer.resume_from=<its step folder>) or move {folder} away to start the critic afresh")


def make_critic(cfg, job, run) -> CriticExecutor | None:
    """The job's critic, not started (megarl/controller/startup.py starts it with the others), or None
    unless algorithm.advantage is gae or vtrace. It resumes at the trainer's step (``job.resume_dir``); its ranks take
    ``job.devices.critic`` (None: the CPU, or the trainer's devices' visibility)."""
    if not needs_critic(cfg.algorithm):
        return None
    from megarl.utils.procs import parse_cpu_list

    resume_step = (step_of(Path(job.resume_dir).name) or 0) if job.resume_dir else 0
    return CriticExecutor(cfg.trainer, cfg.critic, cfg.algorithm, job.model_dir, run_dir=run.path,
                          total_steps=cfg.controller.steps, resume_step=resume_step,
                          cpus=parse_cpu_list(cfg.cluster.trainer_cpus) or None,
                          devices=getattr(job.devices, "critic", None), launcher=cfg.cluster.launcher)


__all__ = ["CriticExecutor", "CriticFailed", "CriticRanksConfig", "critic_checkpoints", "critic_resume", "make_critic"]
