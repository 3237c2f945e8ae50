"""The distillation teacher's executor: a forward-only Megatron model scoring the policy's samples.

``algorithm.teacher`` (an HF folder) with ``algorithm.distill_coef`` > 0 starts one. It is the
trainer's machinery by composition: a ``TrainerExecutor`` given a ``ForwardOnlyConfig``
(megarl/trainer/forward_only.py), so its ranks are spawned, supervised and killed as the trainer's
are, at the trainer's TP x PP x DP (its micro-batching, params_dtype and logprob_temperature too),
but each holds only the frozen teacher (no optimizer, gradients, checkpoints or resume). Its logs
are ``<run>/teacher/logs/trainer_rank<r>.log``.

Each step the controller calls :meth:`TeacherExecutor.fill` on the train batch: the teacher's
logprobs of the sampled tokens go into ``teacher_logprobs``, which the loss turns into the
per-token reverse-KL term of the advantage (megarl/algorithms/distill.py). Any failure of a teacher
rank stops the job with a :class:`TeacherFailed` naming the teacher (its rank, pid and log).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Sequence

from megarl.algorithms.config import AlgorithmConfig, needs_teacher
from megarl.batch import RolloutBatch
from megarl.config.teacher import teacher_dir, tokenizer_mismatch
from megarl.executors.base import ExecutorBase, ExecutorError, ProcessDied
from megarl.trainer.config import TrainerConfig

log = logging.getLogger(__name__)

METRIC = "distill/reverse_kl"  # mean over reply tokens of log pi - log teacher (nats)


class TeacherFailed(ProcessDied):
    """A teacher rank died, raised or went silent: the job stops, naming the teacher."""


class TeacherExecutor(ExecutorBase):
    """Forward-only Megatron ranks of ``algo.teacher``: ``fill(batch)`` adds ``teacher_logprobs``."""

    def __init__(self, trainer_cfg: TrainerConfig, algo: AlgorithmConfig, policy_dir: str | os.PathLike, *,
                 run_dir: str | os.PathLike, cpus: list[int] | None = None, devices: Sequence[int] | None = None,
                 launcher: str = "local"):
        from megarl.trainer.executor import TrainerExecutor
        from megarl.trainer.forward_only import ForwardOnlyConfig

        if not needs_teacher(algo):
            raise ValueError("TeacherExecutor needs algorithm.teacher and algorithm.distill_coef > 0")
        self.teacher_dir = teacher_dir(algo.teacher)  # a folder, or an HF id in the local HF cache
        why = tokenizer_mismatch(Path(policy_dir), self.teacher_dir)  # also checked by `megarl check` (validate)
        if why:
            raise ValueError(f"algorithm.teacher={algo.teacher!r}: its tokenizer is not model.path's ({why})")
        self.cfg = ForwardOnlyConfig.of(trainer_cfg)
        # kl_coef/needs_ref are the policy's business: the teacher's ranks build no reference model
        self._ranks = TrainerExecutor(self.cfg, dataclasses.replace(algo, kl_coef=0.0), self.teacher_dir,
                                      total_steps=0, run_dir=Path(run_dir) / "teacher", cpus=cpus, devices=devices,
                                      launcher=launcher, role="teacher")  # slurm: its pool's ranks attach

    def start(self) -> "TeacherExecutor":
        return self.launch().await_ready()

    def launch(self) -> "TeacherExecutor":
        """Spawn (or accept) the ranks without waiting for them (megarl/executors/base.py: Launchable)."""
        log.info("starting the teacher (forward-only Megatron, tp=%d pp=%d dp=%d) from %s", self.cfg.tp, self.cfg.pp,
                 self.cfg.dp, self.teacher_dir)
        self._guarded(self._ranks.launch)
        return self

    def await_ready(self, also_check=None) -> "TeacherExecutor":
        self._guarded(self._ranks.await_ready, also_check)
        return self

    def has_exited(self) -> bool:
        return self._ranks.has_exited()

    def close(self) -> None:
        self._ranks.close()

    @property
    def pids(self) -> list[int]:
        return self._ranks.pids

    def logprobs(self, batch: RolloutBatch):
        """The teacher's per-token logprobs ``[b, s]`` of ``batch`` (trainer.logprob_temperature)."""
        return self._guarded(self._ranks.logprobs, batch)

    def fill(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with ``teacher_logprobs`` filled in."""
        return dataclasses.replace(batch, teacher_logprobs=self.logprobs(batch))

    def raise_if_dead(self) -> None:
        self._guarded(self._ranks.raise_if_dead)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except ExecutorError as e:
            from megarl.trainer.executor import said_as

            raise said_as(e, "teacher", TeacherFailed) from e


def distill_metrics(train_metrics: dict) -> dict:
    """``distill/reverse_kl`` from the trainer's step metrics (its loss metric ``loss/distill/reverse_kl``:
    the token-weighted mean over the step's updates); empty when distillation is off."""
    value = train_metrics.get(f"loss/{METRIC}")
    return {} if value is None else {METRIC: value}


def make_teacher(cfg, job, run) -> TeacherExecutor | None:
    """The job's teacher, not started (megarl/controller/startup.py starts it with the others), or None
    without algorithm.teacher. Its ranks take the trainer's devices (cluster.share_devices) unless placed."""
    if not needs_teacher(cfg.algorithm):
        return None
    from megarl.utils.procs import parse_cpu_list

    devices = getattr(job.devices, "teacher", None)  # None under slurm: its pool's ranks take their node's GPUs
    return TeacherExecutor(cfg.trainer, cfg.algorithm, job.model_dir, run_dir=run.path,
                           cpus=parse_cpu_list(cfg.cluster.trainer_cpus) or None, devices=devices,
                           launcher=cfg.cluster.launcher)
