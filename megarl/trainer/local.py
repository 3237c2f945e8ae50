"""The trainer's rank-local learner, and the single-rank trainer in the controller's own process.

:class:`RankTrainer` bundles what one trainer rank holds around the Megatron model, at any TP x PP
x DP layout: the model from the HF folder, DDP + optimizer + LR schedule, the reference model when
the loss needs one, the training step, checkpoints and resume. It is built inside an initialised
process group (``megarl.utils.dist``); every rank of a group calls the same methods with the same
arguments (they are collective).

:class:`LocalTrainer` is that learner at TP = PP = DP = 1 in the caller's process (it creates the
one-rank process group itself). Multi-rank trainers run one :class:`RankTrainer` per rank process
(``megarl.trainer.worker``), driven by ``megarl.trainer.executor.TrainerExecutor``, which offers
the same interface as ``LocalTrainer``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch

from megarl.algorithms.config import AlgorithmConfig, needs_ref
from megarl.algorithms.policy_loss import loss_params
from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig, run_updates

log = logging.getLogger(__name__)


def set_tp_attributes(model) -> int:
    """Mark the TP-sharded weights of a model built with ``init_weights=False``; returns how many.

    megatron (0.16.1) sets ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` on a
    weight only inside its random init, so with ``perform_initialization=False`` every weight looks
    TP-replicated: the grad norm then counts the shards of tp rank 0 only (measured: TP2 grad_norm
    36.3 vs 48.3 at TP1 on the tiny model) and clipping scales by the wrong norm. Values as that
    init sets them (tests/e2e/test_trainer_executor.py compares them). TODO: move into build_gpt_model.
    """
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    glu = bool(getattr(getattr(model, "config", None), "gated_linear_unit", False))
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            dim, stride = 0, 1
        elif isinstance(module, ColumnParallelLinear):  # fc1 of a GLU holds [gate_r; up_r]: stride 2
            dim, stride = 0, 2 if glu and name.endswith("linear_fc1") else 1
        elif isinstance(module, RowParallelLinear):
            dim, stride = 1, 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, stride)
            n += 1
    return n


class RankTrainer:
    """One trainer rank's Megatron learner: ``step(batch)``, ``save()`` / resume (collective)."""

    def __init__(self, cfg: TrainerConfig, algo: AlgorithmConfig, model_dir: str | Path, *,
                 total_steps: int, run_dir: str | Path):
        from megarl.trainer.checkpoint import TrainProgress, checkpoint_root, load_checkpoint, resume_path
        from megarl.trainer.convert import load_pretrained
        from megarl.models.layouts import ModelDims
        from megarl.trainer.model import build_gpt_model, read_hf_config
        from megarl.trainer.optimizer import build_training, params_dtype

        self.cfg, self.algo = cfg, algo
        self.run_dir = Path(run_dir)
        self.model_dir = Path(model_dir)  # its config.json + tokenizer go into checkpoints (export)
        dims = ModelDims.from_hf_config(read_hf_config(model_dir))
        # Every element comes from the checkpoint: skip the random init (minutes for big models on CPU).
        self.model = build_gpt_model(dims, params_dtype=params_dtype(cfg), init_weights=False,
                                     moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, recompute=cfg.recompute)
        set_tp_attributes(self.model)
        load_pretrained(self.model, model_dir)
        from megarl.trainer.router_stats import RouterStats

        self.router_stats = RouterStats(self.model, replay=cfg.router_replay)  # MoE: tokens per expert, routing mismatch (R3)
        # the LR schedule counts optimizer updates: trainer.minibatches x trainer.epochs a step
        self.objs = build_training(cfg, self.model, run_updates(cfg, total_steps))
        # The KL reference: the initial policy (from model_dir even on resume), frozen, built only if used.
        self.ref_model = None
        if needs_ref(algo):
            from megarl.trainer.train_step import build_reference_model

            self.ref_model = build_reference_model(model_dir, params_dtype(cfg))
        self.progress = TrainProgress(step=0, consumed_samples=0)
        self.checkpoint_dir = checkpoint_root(cfg, self.run_dir)
        self.writer = None  # trainer.async_save: the background checkpoint writer
        if cfg.async_save:
            from megarl.trainer.async_save import AsyncWriter

            self.writer = AsyncWriter(cfg.save_timeout_s)
        resume = resume_path(cfg, self.run_dir)
        if resume is not None:
            log.info("trainer: resuming from %s", resume)
            if not cfg.resume_optimizer:
                log.warning("trainer: trainer.resume_optimizer=false: the weights of %s with a fresh optimizer", resume)
            self.progress = load_checkpoint(resume, model=self.objs.model,
                                            optimizer=self.objs.optimizer if cfg.resume_optimizer else None,
                                            scheduler=self.objs.scheduler, load_rng=cfg.resume_optimizer)

    @property
    def micro_batching(self) -> dict:
        """How every logprob and training pass forms its micro-batches (trainer.packing,
        trainer.max_tokens_per_micro_batch; trainer.micro_batch_size is passed beside it)."""
        return {"packing": self.cfg.packing, "max_tokens_per_micro_batch": self.cfg.max_tokens_per_micro_batch}

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (= the policy version the weights represent)."""
        return self.progress.step

    def step(self, batch: RolloutBatch) -> dict:
        """One step on ``batch`` (the whole global batch; each DP rank trains on its share):
        trainer.epochs passes of trainer.minibatches optimizer updates, after the no-grad passes
        its loss needs (proximal and reference logprobs, once, before the first update); returns
        the step's metrics (the same on every rank)."""
        from megarl.trainer.train_step import prepare_batch, train_step

        if self.writer is not None:
            self.writer.poll()  # commit a finished background write (collective: every rank steps)
        batch, prep = prepare_batch(self.objs, self.ref_model, batch, self.algo, self.cfg.micro_batch_size,
                                    self.cfg.logprob_temperature, **self.micro_batching)
        with self.router_stats.counting():
            metrics = train_step(self.objs, batch, loss_name=self.algo.loss, loss_params=loss_params(self.algo),
                                 micro_batch_size=self.cfg.micro_batch_size,
                                 temperature=self.cfg.logprob_temperature, current_version=self.progress.step,
                                 minibatches=self.cfg.minibatches, epochs=self.cfg.epochs, **self.micro_batching)
        metrics.update(prep)
        metrics.update(self.router_stats.metrics())
        self.progress.step += 1
        self.progress.consumed_samples += batch.batch_size
        return metrics

    def logprobs(self, batch: RolloutBatch, temperature: float | None = None) -> torch.Tensor:
        """Per-token logprobs ``[b, s]`` of ``batch`` under the current weights (collective; every rank
        gets the whole result). ``temperature`` defaults to ``trainer.logprob_temperature``."""
        from megarl.trainer.logprobs import compute_logprobs

        t = self.cfg.logprob_temperature if temperature is None else float(temperature)
        return compute_logprobs(self.model, batch, micro_batch_size=self.cfg.micro_batch_size, temperature=t,
                                **self.micro_batching).logprobs

    def topology(self):
        """This trainer's layout as the DDMA planner describes it (``TrainerTopology``)."""
        from megarl.trainer.ddma import trainer_topology

        return trainer_topology(self.model)

    def save(self) -> Path:
        """Atomic checkpoint of model, optimizer, scheduler, RNG and progress, plus the HF config and
        tokenizer files of ``model_dir`` so ``megarl convert mcore-to-hf`` can export it."""
        from megarl.trainer.checkpoint import save_checkpoint
        from megarl.trainer.model import read_hf_config

        return save_checkpoint(self.checkpoint_dir, model=self.objs.model, optimizer=self.objs.optimizer,
                               scheduler=self.objs.scheduler, progress=self.progress,
                               keep_last=self.cfg.keep_checkpoints, writer=self.writer,
                               hf_config=read_hf_config(self.model_dir), hf_extra_from=self.model_dir)

    def wait_saves(self) -> None:
        """Wait for the background checkpoint write in flight (trainer.async_save) and commit it."""
        if self.writer is not None:
            self.writer.wait("the trainer")


class LocalTrainer(RankTrainer):
    """Single-rank Megatron learner in this process: ``step(batch)``, ``hf_weights()``, ``save()``."""

    def __init__(self, cfg: TrainerConfig, algo: AlgorithmConfig, model_dir: str | Path, *,
                 total_steps: int, run_dir: str | Path):
        from megarl.utils.dist import free_tcp_port, init_distributed, init_model_parallel

        if cfg.tp * cfg.pp * cfg.dp != 1:
            raise ValueError(f"LocalTrainer runs one rank; got trainer tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}")
        init_distributed(0, 1, master_port=free_tcp_port())
        init_model_parallel(1, 1, seed=cfg.seed)
        super().__init__(cfg, algo, model_dir, total_steps=total_steps, run_dir=run_dir)
        self._sender = None  # made at the first start_sync, again when the spec changes

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight. One Megatron parameter at a time is assembled
        (a fused linear_qkv holds q, k and v interleaved per query group), so the extra memory is
        one parameter, not the model."""
        from itertools import groupby

        from megarl.trainer.shards import local_shard_specs, reassemble

        specs = [s for s in local_shard_specs(self.model) if not s.is_tied_copy]
        for _, pieces in groupby(specs, key=lambda s: s.mcore_name):
            yield from reassemble(pieces).items()

    def start_sync(self, spec, version: int) -> None:
        """Start sending this rank's shards for weights ``version`` (DDMA ``spec``) in a background
        thread (the controller meanwhile tells the generator to receive); :meth:`finish_sync` joins."""
        import threading

        from megarl.trainer.ddma import make_sender

        if self._sender is None or self._sender.spec != spec:
            self._sender = make_sender(self.model, spec)
        result: dict = {}

        def run():
            try:
                result["stats"] = self._sender.sync(int(version))
            except BaseException as e:  # noqa: BLE001 - re-raised in finish_sync
                result["error"] = e

        self._sync_thread = threading.Thread(target=run, name=f"ddma-send-v{version}", daemon=True)
        self._sync_result, self._sync_timeout = result, float(spec.timeout_s) + 30.0
        self._sync_thread.start()

    def finish_sync(self) -> list[dict]:
        """Wait for :meth:`start_sync`'s send; ``[stats]`` (one rank), as TrainerExecutor returns."""
        self._sync_thread.join(self._sync_timeout)
        if self._sync_thread.is_alive():
            raise TimeoutError(f"DDMA send did not finish within {self._sync_timeout:.0f} s")
        if "error" in self._sync_result:
            raise self._sync_result["error"]
        return [{"rank": 0, "tp": 0, "pp": 0, "dp": 0, **self._sync_result["stats"]}]

    def abandon_sync(self, why: str) -> None:
        """The receivers failed mid-sync (``why``): this rank's sender thread ends on its own (its
        transport times out or finishes), so it is joined and its own error dropped."""
        try:
            self.finish_sync()
        except Exception:  # noqa: BLE001 - the receivers' error is the one the caller reports
            pass

    def raise_if_dead(self) -> None:
        """In-process: nothing can have died separately from the caller."""

    def close(self) -> None:
        from megarl.utils.dist import destroy_distributed

        destroy_distributed()
