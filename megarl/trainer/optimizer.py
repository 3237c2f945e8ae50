"""Megatron DDP + optimizer (+ DistributedOptimizer, grad clipping) + LR schedule from TrainerConfig.

Order matters: wrap the model in megatron DDP first (the DistributedOptimizer shards the DDP grad
buffers), then build the optimizer over the DDP chunks, then the scheduler. The scheduler is not
optional: megatron applies per-group weight-decay multipliers (no decay on norms and biases) and
the learning rate through it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.trainer.config import TrainerConfig, lr_decay_updates
from megarl.utils.faults import armed, injected, pause_point

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def params_dtype(cfg: TrainerConfig) -> torch.dtype:
    """The torch dtype of cfg.params_dtype."""
    try:
        return _DTYPES[cfg.params_dtype]
    except KeyError:
        raise ValueError(f"trainer.params_dtype={cfg.params_dtype!r}: use one of "
                         f"{sorted(_DTYPES)}") from None


def ddp_config(cfg: TrainerConfig):
    """Megatron DDP settings: fp32 grad reduction, reduction at the end of the backward pass."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer, check_for_nan_in_grad=False)


def wrap_ddp(cfg: TrainerConfig, model: torch.nn.Module):
    """Wrap a GPTModel chunk in megatron DDP and install the grad-finalization hook.

    Without ``config.finalize_model_grads_func`` the pipeline schedules never reduce gradients
    across DP (nor tied embeddings across PP stages): every rank would step on its local grads.
    With bfloat16 params the chunk is first wrapped in megatron's Float16Module, as megatron's
    own training does: it casts every parameter (the local spec's norms are created in fp32) so
    the optimizer keeps one fp32 master copy per param, and hands fp32 outputs to the loss.
    """
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if params_dtype(cfg) == torch.bfloat16:
        if not config.bf16:
            raise ValueError("trainer.params_dtype=bfloat16 but the model was built without "
                             "bf16=True; build it with the same params_dtype")
        model = Float16Module(config, model)
    config.finalize_model_grads_func = finalize_model_grads
    return DistributedDataParallel(config=config, ddp_config=ddp_config(cfg), module=model)


def optimizer_config(cfg: TrainerConfig):
    """megatron OptimizerConfig (AdamW) for the trainer section."""
    from megatron.core.optimizer import OptimizerConfig

    dtype = params_dtype(cfg)
    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer, decoupled_weight_decay=True,
        log_num_zeros_in_grad=False)


def build_optimizer(cfg: TrainerConfig, ddp_chunks: list):
    """The megatron optimizer over DDP-wrapped model chunks (a ChainedOptimizer of
    DistributedOptimizer when use_distributed_optimizer)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer

    if cfg.use_distributed_optimizer and not all(
            isinstance(c, DistributedDataParallel) for c in ddp_chunks):
        raise TypeError("build_optimizer: the DistributedOptimizer needs model chunks wrapped with "
                        "megarl.trainer.optimizer.wrap_ddp")
    return get_megatron_optimizer(optimizer_config(cfg), ddp_chunks)


def build_scheduler(cfg: TrainerConfig, optimizer: Any, total_steps: int):
    """OptimizerParamScheduler stepping once per optimizer step (increment=1).

    lr warms up linearly over lr_warmup_steps, then follows lr_decay_style down to min_lr by
    lr_decay_steps (0 = total_steps). Weight decay is constant."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = lr_decay_updates(cfg, total_steps)  # the validator checks the same (config/validate.py)
    if cfg.lr_decay_style != "constant" and decay_steps <= cfg.lr_warmup_steps:
        raise ValueError(f"trainer.lr_decay_steps={decay_steps} must exceed trainer."
                         f"lr_warmup_steps={cfg.lr_warmup_steps} for lr_decay_style="
                         f"{cfg.lr_decay_style!r}")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, cfg.lr_warmup_steps + 1), lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=0,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False)


class NonFiniteStepError(RuntimeError):
    """trainer.max_skipped_steps steps in a row had a NaN/inf loss or gradient: the job stops."""


@dataclass
class TrainingObjects:
    """What a training step needs besides data: the DDP-wrapped model chunks, optimizer, scheduler;
    and the count of steps skipped for a non-finite loss or gradient (in a row, and in all)."""
    model: list
    optimizer: Any
    scheduler: Any
    max_skipped_steps: int = 3
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    param_counts: dict = None  # {"model/params", "trainable_params"}: megarl.trainer.lora.param_counts


def build_training(cfg: TrainerConfig, model: torch.nn.Module | list,
                   total_steps: int) -> TrainingObjects:
    """DDP wrap + optimizer + scheduler for one GPTModel chunk (or a list of chunks)."""
    chunks = model if isinstance(model, list) else [model]
    if cfg.lora_rank > 0:  # adapters on, base frozen before DDP: only the adapters get grads and optimizer state
        from megarl.trainer.lora import apply_lora

        for c in chunks:
            apply_lora(c, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, seed=cfg.seed)
    from megarl.trainer.lora import param_counts

    counts = param_counts(chunks[0]) if len(chunks) == 1 else None
    ddp = [wrap_ddp(cfg, c) for c in chunks]
    opt = build_optimizer(cfg, ddp)
    return TrainingObjects(model=ddp, optimizer=opt, scheduler=build_scheduler(cfg, opt, total_steps),
                           max_skipped_steps=cfg.max_skipped_steps,
                           param_counts=counts and {"model/params": float(counts["model/params"]),
                                                    "trainable_params": float(counts["train/trainable_params"])})


def all_finite(objs: TrainingObjects, loss: float) -> bool:
    """Whether the loss and every gradient (after the DP reduction) are finite on every trainer
    rank: a collective (MAX over the default group), so all ranks skip or step together. Each rank
    checks its own gradient buffers: a NaN on any rank reaches the shard owner through the reduction."""
    bad = not math.isfinite(loss)
    for chunk in objs.model:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if not bad and g is not None and not bool(torch.isfinite(g).all()):
                bad = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if bad else 0.0], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    return not bad


def _poison_first_gradient(objs: TrainingObjects) -> None:
    """Fault injection: the first gradient buffer of this rank becomes NaN."""
    for chunk in objs.model:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                g.view(-1)[0] = float("nan")
                return


def optimizer_step(objs: TrainingObjects, loss: float = 0.0) -> dict:
    """One optimizer + scheduler step after forward/backward; zeroes grads for the next step.

    A NaN/inf ``loss`` or gradient skips the update and the LR-schedule step (megatron's optimizer
    does not check without a grad scaler, and clipping by a NaN norm would write NaN into every
    weight) with a WARNING; ``objs.max_skipped_steps`` skipped in a row raise
    :class:`NonFiniteStepError`. Returns {"update_successful", "grad_norm", "lr", "skipped" (0/1),
    "skipped_steps" (the run's total)}."""
    if injected("nonfinite_grad") is not None:  # fault tests (megarl/utils/faults.py): a diverged step's NaN
        _poison_first_gradient(objs)
    step = int(getattr(objs.scheduler, "num_steps", 0)) + objs.skipped_total + 1  # the step being trained
    if armed(f"train_step@{step}"):  # fault tests: a signal or kill lands while this step runs
        log.info("trainer rank %d: step %d: forward and backward done, holding before the optimizer update "
                 "(fault pause)", dist.get_rank() if dist.is_initialized() else 0, step)
        pause_point(f"train_step@{step}")
    finite = all_finite(objs, loss)
    if finite:
        ok, grad_norm, _ = objs.optimizer.step()
        if ok:
            objs.scheduler.step(increment=1)
        objs.skipped_in_a_row = 0
    else:
        ok, grad_norm = False, float("nan")
        objs.skipped_in_a_row += 1
        objs.skipped_total += 1
    for chunk in objs.model:
        chunk.zero_grad_buffer()
    objs.optimizer.zero_grad()
    lr = objs.optimizer.param_groups[0]["lr"] if objs.optimizer.param_groups else float("nan")
    if not finite:
        why = f"loss {loss}" if not math.isfinite(loss) else "a gradient"
        if objs.skipped_in_a_row >= objs.max_skipped_steps:
            raise NonFiniteStepError(
                f"trainer: {objs.skipped_in_a_row} steps in a row had a NaN/inf loss or gradient (the last: {why}); "
                f"trainer.max_skipped_steps={objs.max_skipped_steps} stops the job. Check the rewards and "
                f"advantages for inf/NaN, or lower trainer.lr")
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("trainer: step skipped: %s is NaN/inf (no update; %d in a row, %d in all; "
                        "trainer.max_skipped_steps=%d)", why, objs.skipped_in_a_row, objs.skipped_total,
                        objs.max_skipped_steps)
    return {"update_successful": bool(ok), "grad_norm": float(grad_norm or 0.0) if finite else float("nan"),
            "lr": float(lr), "skipped": 0.0 if finite else 1.0, "skipped_steps": float(objs.skipped_total),
            **(objs.param_counts or {})}
