"""The trainer executor in the controller's own process (one rank: TP = PP = DP = 1).

It bundles what a training job needs around the Megatron model: process group, model from the HF
folder, DDP + optimizer + LR schedule, the training step, checkpoints, and the HF-named view of
its weights that the generator loads. Multi-rank trainers (TP x PP x DP worker processes) keep the
same interface; they arrive with the controller issue.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch

from megarl.algorithms.config import AlgorithmConfig, loss_params, needs_ref
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


class LocalTrainer:
    """Single-rank Megatron learner: ``step(batch)``, ``hf_weights()``, ``save()`` / resume."""

    def __init__(self, cfg: TrainerConfig, algo: AlgorithmConfig, model_dir: str | Path, *,
                 total_steps: int, run_dir: str | Path):
        from megarl.trainer.checkpoint import TrainProgress, checkpoint_root, load_checkpoint, resume_path
        from megarl.trainer.convert import load_pretrained
        from megarl.trainer.layouts import ModelDims
        from megarl.trainer.model import build_gpt_model, read_hf_config
        from megarl.trainer.optimizer import build_training, params_dtype
        from megarl.utils.dist import free_tcp_port, init_distributed, init_model_parallel

        if cfg.tp * cfg.pp * cfg.dp != 1:
            raise ValueError(f"LocalTrainer runs one rank; got trainer tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}")
        self.cfg, self.algo = cfg, algo
        self.run_dir = Path(run_dir)
        self.model_dir = Path(model_dir)  # its config.json + tokenizer go into checkpoints (export)
        init_distributed(0, 1, master_port=free_tcp_port())
        init_model_parallel(1, 1, seed=cfg.seed)
        dims = ModelDims.from_hf_config(read_hf_config(model_dir))
        # Every element comes from the checkpoint: skip the random init (minutes for big models on CPU).
        self.model = build_gpt_model(dims, params_dtype=params_dtype(cfg), init_weights=False)
        load_pretrained(self.model, model_dir)
        self.objs = build_training(cfg, self.model, total_steps)
        # The KL reference: the initial policy (from model_dir even on resume), frozen, built only if used.
        self.ref_model = None
        if needs_ref(algo):
            from megarl.trainer.train_step import build_reference_model

            self.ref_model = build_reference_model(model_dir, params_dtype(cfg))
        self.progress = TrainProgress(step=0, consumed_samples=0)
        self.checkpoint_dir = checkpoint_root(cfg, self.run_dir)
        resume = resume_path(cfg, self.run_dir)
        if resume is not None:
            log.info("trainer: resuming from %s", resume)
            self.progress = load_checkpoint(resume, model=self.objs.model, optimizer=self.objs.optimizer,
                                            scheduler=self.objs.scheduler)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (= the policy version the weights represent)."""
        return self.progress.step

    def step(self, batch: RolloutBatch) -> dict:
        """One optimizer step on ``batch`` (after the no-grad passes its loss needs: proximal and
        reference logprobs); returns the step's metrics."""
        from megarl.trainer.train_step import prepare_batch, train_step

        batch, prep = prepare_batch(self.objs, self.ref_model, batch, self.algo, self.cfg.micro_batch_size,
                                    self.cfg.logprob_temperature)
        metrics = train_step(self.objs, batch, loss_name=self.algo.loss, loss_params=loss_params(self.algo),
                             micro_batch_size=self.cfg.micro_batch_size,
                             temperature=self.cfg.logprob_temperature, current_version=self.progress.step)
        metrics.update(prep)
        self.progress.step += 1
        self.progress.consumed_samples += batch.batch_size
        return metrics

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight. One Megatron parameter at a time is assembled
        (a fused linear_qkv holds q, k and v interleaved per query group), so the extra memory is
        one parameter, not the model."""
        from itertools import groupby

        from megarl.trainer.shards import local_shard_specs, reassemble

        specs = [s for s in local_shard_specs(self.model) if not s.is_tied_copy]
        for _, pieces in groupby(specs, key=lambda s: s.mcore_name):
            yield from reassemble(pieces).items()

    def save(self) -> Path:
        """Atomic checkpoint of model, optimizer, scheduler, RNG and progress, plus the HF config and
        tokenizer files of ``model_dir`` so ``megarl convert mcore-to-hf`` can export it."""
        from megarl.trainer.checkpoint import save_checkpoint
        from megarl.trainer.model import read_hf_config

        return save_checkpoint(self.checkpoint_dir, model=self.objs.model, optimizer=self.objs.optimizer,
                               scheduler=self.objs.scheduler, progress=self.progress,
                               keep_last=self.cfg.checkpoint_keep_last,
                               hf_config=read_hf_config(self.model_dir), hf_extra_from=self.model_dir)

    def close(self) -> None:
        from megarl.utils.dist import destroy_distributed

        destroy_distributed()
