"""A forward-only trainer rank: a frozen Megatron model that only answers ``logprobs``.

Roles that score the policy's samples without training (the distillation teacher, issue 43) run on
the trainer's machinery: ``TrainerExecutor`` given a :class:`ForwardOnlyConfig` spawns its ranks
as usual (TP x PP x DP, supervision, heartbeats), and each rank builds a :class:`ForwardOnlyRank`
instead of a ``RankTrainer`` (megarl/trainer/worker.py): the model at the rank's layout, loaded
from the HF folder, in eval mode without grads; no DDP, optimizer, scheduler, checkpoints or resume.
Its logprobs are ``RankTrainer.logprobs``'s code (``compute_logprobs`` with the same micro-batching
knobs), so a forward-only copy of the policy's weights gives bit-identical logprobs at fp32.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig


@dataclasses.dataclass
class ForwardOnlyConfig(TrainerConfig):
    """A ``TrainerConfig`` whose ranks build :class:`ForwardOnlyRank`: its parallel sizes, micro-batching,
    params_dtype, logprob_temperature and timeouts are used; the optimizer and checkpoint knobs are not."""

    @classmethod
    def of(cls, cfg: TrainerConfig, **changes) -> "ForwardOnlyConfig":
        """``cfg`` as a forward-only config (``changes``: knobs to replace, e.g. tp/pp/dp); never resumes."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainerConfig)}
        values.update(resume_from=None, async_save=False, **changes)
        return cls(**values)


class ForwardOnlyRank:
    """One rank's frozen model: ``logprobs(batch, temperature)`` (collective), ``step_count`` 0."""

    def __init__(self, cfg: ForwardOnlyConfig, algo, model_dir: str | Path, *, total_steps: int = 0,
                 run_dir: str | Path | None = None):
        from megarl.trainer.optimizer import params_dtype
        from megarl.trainer.train_step import build_reference_model

        self.cfg, self.algo = cfg, algo
        self.model_dir = Path(model_dir)
        self.model = build_reference_model(model_dir, params_dtype(cfg))  # eval mode, no grads
        self.step_count = 0

    def logprobs(self, batch: RolloutBatch, temperature: float | None = None) -> torch.Tensor:
        """Per-token logprobs ``[b, s]`` of ``batch`` (``RankTrainer.logprobs``'s computation)."""
        from megarl.trainer.logprobs import compute_logprobs
        from megarl.utils.faults import injected

        if injected("teacher_exit") is not None:  # fault tests: a forward-only rank dies as it is asked
            os._exit(9)
        t = self.cfg.logprob_temperature if temperature is None else float(temperature)
        with torch.no_grad():
            return compute_logprobs(self.model, batch, micro_batch_size=self.cfg.micro_batch_size, temperature=t,
                                    packing=self.cfg.packing,
                                    max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch).logprobs

    def wait_saves(self) -> None:
        """Nothing is ever written."""
