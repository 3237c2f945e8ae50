"""Trainer-checkpoint test machinery: the layouts, a rank's setup, one train step, its weights."""

from __future__ import annotations

import torch


SEQ, MICRO_BATCH, NUM_MICRO = 16, 2, 2


N_STEPS, K_STEPS = 4, 2


# TP=2 (plain fp32 optimizer), DP=2 + DistributedOptimizer, and bf16 weights with fp32 master
# copies at DP=2 (megatron's Float16Optimizer path)
LAYOUTS = {"tp2": dict(tp=2, pp=1, distopt=False), "dp2": dict(tp=1, pp=1, distopt=True),
           "dp2_bf16": dict(tp=1, pp=1, distopt=False, dtype="bfloat16")}


def _dims(ffn: int = 128):
    from megarl.models.layouts import ModelDims
    return ModelDims(family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_hidden_size=ffn, vocab_size=512, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
                     qkv_bias=False)


def _trainer_cfg(layout: dict):
    from megarl.trainer.config import TrainerConfig
    return TrainerConfig(tp=layout["tp"], pp=layout["pp"], dp=2 // (layout["tp"] * layout["pp"]),
                         micro_batch_size=MICRO_BATCH, lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                         lr_decay_style="cosine", weight_decay=0.01, grad_clip=1.0,
                         use_distributed_optimizer=layout["distopt"], seed=7,
                         params_dtype=layout.get("dtype", "float32"))


def _setup(layout: dict, with_optimizer: bool = True, ffn: int = 128):
    from megarl.trainer.model import build_gpt_model
    from megarl.trainer.optimizer import build_training, params_dtype
    from megarl.utils.dist import init_model_parallel

    cfg = _trainer_cfg(layout)
    init_model_parallel(cfg.tp, cfg.pp, seed=cfg.seed)
    model = build_gpt_model(_dims(ffn), spec="local", params_dtype=params_dtype(cfg))
    if not with_optimizer:
        return cfg, None, [model]
    objs = build_training(cfg, model, total_steps=N_STEPS)
    return cfg, objs, objs.model


def _train_step(objs, cfg) -> float:
    """One megarl train step (AIPO) on rollouts drawn from the global torch RNG, so a resume must
    restore the RNG as well to see the same data."""
    from megarl.batch import RolloutBatch
    from megarl.trainer.train_step import train_step

    rows = cfg.dp * MICRO_BATCH * NUM_MICRO
    mask = torch.ones(rows, SEQ)
    mask[:, :4] = 0.0  # the prompt
    batch = RolloutBatch(
        input_ids=torch.randint(0, 512, (rows, SEQ)), lengths=torch.full((rows,), SEQ),
        loss_mask=mask, behav_logprobs=-6.0 * mask, advantages=mask.clone(),  # +1: imitate
        versions=torch.zeros(rows, SEQ, dtype=torch.long))
    metrics = train_step(objs, batch, loss_name="aipo", loss_params={"rho": 4.0},
                         micro_batch_size=cfg.micro_batch_size,
                         temperature=cfg.logprob_temperature, current_version=0)
    assert metrics["update_successful"] and metrics["micro_batches"] == NUM_MICRO
    return metrics["loss"]


def _weights(chunks) -> dict:
    from megarl.trainer.model import unwrap
    return {n: p.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}
