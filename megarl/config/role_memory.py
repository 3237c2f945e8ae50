"""The memory blocks of the optional roles in the dry run's plan (megarl/config/dry_run.py), per GPU, from
the config and the models' config.json alone: the reward judge's vLLM engines (``reward.model``), the
distillation teacher's forward-only Megatron ranks (``algorithm.teacher``) and the critic's value model
(``algorithm.advantage: gae|vtrace``), each counted with the trainer's and generator's terms
(megarl/config/memory.py). No weights, no torch."""

from __future__ import annotations

import math

from megarl.config.memory import (DTYPE_BYTES, GB, OVERHEAD_GB, activation_bytes_per_layer,
                                  attention_score_bytes_per_layer, fused_attention_expected, generator_weight_bytes,
                                  kv_bytes_per_token, micro_batch_shape, trainer_plan, trainer_rank_params)
from megarl.models.dims import ModelDims


def judge_memory(cfg, gpu_bytes: float) -> tuple[list[str], list[str]]:
    """(plan lines, problems) of the reward judge's GPUs (reward.model, megarl/reward/judge.py): as a
    generator worker's, for the judge model at reward.judge_tp in generator.dtype, unquantized: weights,
    reward.judge_kv_cache_gib of KV cache (at least one reward.judge_max_model_len sequence) and the
    overhead. Nothing without reward.model; a line saying so when its config.json is not here."""
    from megarl.config.validate import model_shape

    r, dtype = cfg.reward, cfg.generator.dtype
    if not r.model:
        return [], []
    shape = model_shape(r.model, shipped_ok=True)
    if not shape or "_error" in shape:
        return [f"reward judge: no plan (reward.model={r.model}: its config.json is not here nor in configs/models/)"], []
    dims = ModelDims.from_hf_config(shape)
    terms = {"weights": generator_weight_bytes(dims, r.judge_tp, dtype, "none"), "kv_cache": r.judge_kv_cache_gib * 2**30,
             "overhead": OVERHEAD_GB * GB}
    total, per_token = sum(terms.values()), kv_bytes_per_token(dims, r.judge_tp, dtype)
    lines = [f"reward judge, per GPU: {total / GB:6.1f} GB of {gpu_bytes / GB:.0f}; tp{r.judge_tp} x "
             f"{r.judge_replicas} replica(s); KV holds {terms['kv_cache'] / per_token:,.0f} tokens (judge_max_model_len "
             f"{r.judge_max_model_len})"] + [f"    {k:<17} {v / GB:7.2f} GB" for k, v in terms.items()]
    problems = []
    if total > gpu_bytes:
        problems.append(f"reward.judge_tp={r.judge_tp}: the judge's {total / GB:.1f} GB per GPU (weights "
                        f"{terms['weights'] / GB:.1f}, KV {terms['kv_cache'] / GB:.1f}) does not fit {gpu_bytes / GB:g} GB; "
                        f"raise reward.judge_tp or lower reward.judge_kv_cache_gib")
    elif terms["kv_cache"] < r.judge_max_model_len * per_token:
        problems.append(f"reward.judge_kv_cache_gib={r.judge_kv_cache_gib}: holds less than one reward.judge_max_model_len="
                        f"{r.judge_max_model_len} sequence; set it to "
                        f"{math.ceil(r.judge_max_model_len * per_token / 2**30)} or more")
    return lines, problems


def teacher_memory(cfg, gpu_bytes: float) -> tuple[list[str], list[str]]:
    """(plan lines, problems) of one teacher rank's GPU (megarl/teacher/executor.py: forward-only
    Megatron ranks at the trainer's tp x pp x dp and params_dtype, megarl/config/memory.py's terms):
    its weights; one layer's activations and attention scores at a time (no grad: nothing is kept for
    a backward); the micro-batch's logits with their fp32 copy (no gradient); the overhead. Nothing
    without a teacher; a line saying so when its config.json is not here."""
    from megarl.config.validate import model_shape
    from megarl.models.layouts import padded_vocab_size

    a, t = cfg.algorithm, cfg.trainer
    if not a.teacher or not a.distill_coef > 0:
        return [], []
    shape = model_shape(a.teacher, shipped_ok=True)
    if not shape or "_error" in shape:
        return [f"teacher: no plan (algorithm.teacher={a.teacher}: its config.json is not here nor in "
                f"configs/models/)"], []
    dims = ModelDims.from_hf_config(shape)
    d = DTYPE_BYTES[t.params_dtype]
    row_len, rows = micro_batch_shape(cfg.data.max_prompt_tokens + cfg.generator.max_new_tokens, t.micro_batch_size,
                                      t.max_tokens_per_micro_batch)
    v_local = padded_vocab_size(dims.vocab_size, t.tp) / t.tp
    terms = {"weights": trainer_rank_params(dims, t.tp, t.pp, t.ep) * d,
             "activations": activation_bytes_per_layer(dims, row_len, rows, t.tp) * d / 2,  # 16-bit figures
             "attention_scores": attention_score_bytes_per_layer(dims, row_len, rows, t.tp, t.params_dtype),
             "logits": row_len * rows * v_local * (d + 4),
             "overhead": OVERHEAD_GB * GB}
    total = sum(terms.values())
    lines = [f"teacher, per GPU: {total / GB:6.1f} GB of {gpu_bytes / GB:.0f}; forward-only tp{t.tp} x pp{t.pp} x "
             f"dp{t.dp} (the trainer's layout), {a.teacher}"] + [f"    {k:<17} {v / GB:7.2f} GB"
                                                                 for k, v in terms.items()]
    problems = []
    if total > gpu_bytes:
        problems.append(f"algorithm.teacher={a.teacher!r}: the teacher's {total / GB:.1f} GB per GPU (weights "
                        f"{terms['weights'] / GB:.1f}) does not fit {gpu_bytes / GB:g} GB; raise trainer.tp or "
                        f"trainer.pp (the teacher runs at the trainer's layout)")
    return lines, problems


def critic_memory(cfg, gpu_bytes: float) -> tuple[list[str], list[str]]:
    """(plan lines, problems) of one critic rank's GPU (megarl/critic/executor.py: the value model, the policy's
    GPTModel with a scalar head, trained at critic.tp x pp x dp with the trainer's params_dtype and optimizer):
    the trainer's terms (:func:`trainer_plan`) at the critic's layout and micro-batch, without the logits
    (the head gives one value a token), a reference model, LoRA or the sync's fp8 copy. The weights keep an
    untied vocabulary projection the head replaces (an upper bound by vocab x hidden / tp). Nothing unless
    algorithm.advantage is gae or vtrace; a line saying so when the value model's config.json is not here."""
    from megarl.config.validate import model_shape

    critic, t = getattr(cfg, "critic", None), cfg.trainer
    if critic is None or cfg.algorithm.advantage not in ("gae", "vtrace"):
        return [], []
    source = critic.path or cfg.model.path
    shape = model_shape(source, shipped_ok=True)
    if (not shape or "_error" in shape) and critic.path:  # a megarl checkpoint: the policy's architecture
        shape = model_shape(cfg.model.path, shipped_ok=True)
    if not shape or "_error" in shape:
        return [f"critic: no plan (its model {source}: config.json is not here nor in configs/models/)"], []
    dims = ModelDims.from_hf_config(shape)
    tp, pp, dp = critic.layout(t)
    terms = trainer_plan(dims, tp=tp, pp=pp, dp=dp, params_dtype=t.params_dtype,
                         distributed_optimizer=t.use_distributed_optimizer,
                         seq=cfg.data.max_prompt_tokens + cfg.generator.max_new_tokens,
                         micro_batch=critic.micro_batch_size or t.micro_batch_size, recompute=t.recompute,
                         max_tokens=t.max_tokens_per_micro_batch, fused_attention=fused_attention_expected()[0])
    terms = {k: v for k, v in terms.items() if k not in ("logits", "entropy", "reference", "fp8_wire", "lora_merged")}
    total = sum(terms.values())
    lines = [f"critic, per GPU: {total / GB:6.1f} GB of {gpu_bytes / GB:.0f}; value model tp{tp} x pp{pp} x dp{dp} "
             f"(critic.tp/pp/dp), {source}"] + [f"    {k:<17} {v / GB:7.2f} GB" for k, v in terms.items() if v]
    problems = []
    if total > gpu_bytes:
        problems.append(f"critic.tp={critic.tp} critic.pp={critic.pp}: the critic's {total / GB:.1f} GB per GPU "
                        f"(weights {terms['weights'] / GB:.1f}, optimizer {terms['optimizer'] / GB:.1f}) does not fit "
                        f"{gpu_bytes / GB:g} GB; raise critic.tp or critic.pp (0 = the trainer's), or lower "
                        f"critic.micro_batch_size")
    return lines, problems


__all__ = ["critic_memory", "judge_memory", "teacher_memory"]
