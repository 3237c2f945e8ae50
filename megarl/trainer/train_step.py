"""A training step of the policy on a batch of rollouts (TP x PP x DP, megatron schedules).

A step is ``epochs`` passes over the batch split into ``minibatches`` along prompt groups
(``RolloutBatch.minibatches``), each minibatch one optimizer update (:func:`train_update`): the
PPO-style step the seeds run (A-3PO: 4 updates per rollout batch; VACO: the forward lag N). What
the loss compares against is fixed before the first update (behaviour logprobs from the generator,
proximal and reference logprobs from :func:`prepare_batch`), so later updates see the policy move
away from it: that is where the PPO-family clips act.

One update: every trainer rank calls :func:`train_update` with the same minibatch; DP rank ``r``
trains on its share of the rows (contiguous, or token-balanced under a token budget), split into
micro-batches (gradient accumulation; packed with ``trainer.packing``),
through megatron's forward-backward pipeline schedule, then megatron DDP reduces the gradients and
the (distributed) optimizer clips and steps, and the LR scheduler advances (it counts updates).

Normalisation is over the minibatch, never the micro-batch: each micro-batch loss is
``policy_loss(..., agg_denominator=D)`` with ``D`` the minibatch's count over every DP rank (loss
tokens for ``token-mean``, sequences for the ``seq-mean-*`` aggregations), so the micro-batch
losses of all DP ranks sum to the loss of the whole minibatch; a loss that decides on a batch
statistic (VACO's TV) gets it summed over every micro-batch and DP rank by a no-grad pass before
the update (:func:`minibatch_stats`). The result is independent of micro-batch size, DP and TP (up
to float rounding). Megatron divides each micro-batch loss by the number of micro-batches and DDP
averages over DP; we pre-multiply by both.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import RolloutBatch
from megarl.trainer.logprobs import aligned_logprobs, dp_rows, dp_share, micro_batch_rows, run_pipeline  # noqa: F401 (dp_share: megarl/bench/trainer.py)

# How a step's updates reduce to the step's metrics: every loss metric is the mean over the step's
# updates weighted by each update's loss tokens; "tokens" counts one pass over the batch; the
# optimizer's figures as below (grad_norm: the mean, with grad_norm_max beside it).
_STEP_REDUCE = {"lr": "last", "trainable_params": "last", "model/params": "last", "skipped_steps": "last", "skipped": "sum", "update_successful": "all",
                "micro_batches": "sum", "grad_norm": "mean"}


# policy_loss metrics aggregated with agg_denominator (the global count): each micro-batch's value
# is its share of the batch's value, so they add up over micro-batches and DP ranks, like the loss.
# Every other metric is a per-micro-batch masked mean and is averaged weighted by loss tokens.
_SUMMED = ("tokens", "loss", "pg_loss", "kl_ref", "entropy")


def _global_denominator(batch: RolloutBatch, aggregation: str) -> float:
    if aggregation == "token-mean":
        return max(float(batch.loss_mask.sum()), 1.0)
    return max(float((batch.loss_mask.sum(-1) > 0).sum()), 1.0)  # sequences with a loss token


def _reduce_metrics(sums: dict[str, float], weight: float) -> dict[str, float]:
    """Token-weighted mean of per-micro-batch metrics over micro-batches and DP ranks; the
    counts ("tokens") and the globally normalised terms (``_SUMMED``) are summed. Result lives on
    the last PP stage, then goes to every stage."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    all_keys: list = [None] * ps.get_data_parallel_world_size()
    torch.distributed.all_gather_object(all_keys, sorted(sums), group=group)
    keys = sorted(set().union(*all_keys))  # data-dependent keys (e.g. staleness buckets) may differ
    vec = torch.tensor([sums.get(k, 0.0) for k in keys] + [weight], dtype=torch.float64)
    torch.distributed.all_reduce(vec, group=group)
    total_w = max(float(vec[-1]), 1.0)
    return {k: (float(v) if k in _SUMMED else float(v) / total_w) for k, v in zip(keys, vec[:-1])}


def _broadcast_metrics(metrics: dict | None) -> dict:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics or {}
    box = [metrics]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return box[0]


def train_step(objs, batch: RolloutBatch, *, loss_name: str, loss_params: dict[str, Any] | None = None,
               micro_batch_size: int, temperature: float = 1.0, current_version: int | None = None,
               minibatches: int = 1, epochs: int = 1, packing: bool = False,
               max_tokens_per_micro_batch: int = 0) -> dict:
    """A step on ``batch`` (the same global batch on every trainer rank): ``epochs`` passes over its
    ``minibatches`` (split along prompt groups), one :func:`train_update` each. Returns the step's
    metrics (on every rank): ``updates``, ``grad_norm_max`` and each update's metrics reduced over the
    step (``_STEP_REDUCE``; loss metrics token-weighted over the updates)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    parts = batch.minibatches(minibatches)
    updates = [train_update(objs, part, loss_name=loss_name, loss_params=loss_params,
                            micro_batch_size=micro_batch_size, temperature=temperature,
                            current_version=current_version, packing=packing,
                            max_tokens_per_micro_batch=max_tokens_per_micro_batch)
               for _ in range(epochs) for part in parts]
    return reduce_updates(updates, per_pass=len(parts))


def reduce_updates(updates: list[dict], per_pass: int) -> dict:
    """One step's metrics from its updates' (see ``_STEP_REDUCE``); ``per_pass``: updates in one epoch."""
    weights = [max(u.get("tokens", 0.0), 0.0) for u in updates]
    total = sum(weights) or 1.0
    out: dict = {}
    for key in dict.fromkeys(k for u in updates for k in u):
        values = [(u[key], w) for u, w in zip(updates, weights) if key in u]
        how = _STEP_REDUCE.get(key)
        if key == "tokens":
            out[key] = sum(u.get("tokens", 0.0) for u in updates[:per_pass])
        elif how == "last":
            out[key] = values[-1][0]
        elif how == "sum":
            out[key] = sum(v for v, _ in values)
        elif how == "all":
            out[key] = all(bool(v) for v, _ in values)
        elif how == "mean":
            out[key] = sum(v for v, _ in values) / len(values)
        else:  # loss metrics: weighted by the update's loss tokens
            w = sum(w for _, w in values)
            out[key] = sum(v * w for v, w in values) / w if w else sum(v for v, _ in values) / len(values)
    out["updates"] = float(len(updates))
    out["grad_norm_max"] = max(float(u.get("grad_norm", float("nan"))) for u in updates)
    return out


def train_update(objs, batch: RolloutBatch, *, loss_name: str, loss_params: dict[str, Any] | None = None,
                 micro_batch_size: int, temperature: float = 1.0, current_version: int | None = None,
                 packing: bool = False, max_tokens_per_micro_batch: int = 0) -> dict:
    """One optimizer update on ``batch`` (a minibatch; the same on every trainer rank).

    Args:
        objs: ``megarl.trainer.optimizer.TrainingObjects`` (DDP model chunk, optimizer, scheduler).
        loss_name, loss_params: a loss of ``megarl.algorithms`` and its keyword params
            (``megarl.algorithms.loss_params(cfg)``).
        micro_batch_size: sequences per forward/backward on one DP rank.
        temperature: logits are divided by it before log-softmax (see ``logprobs.py`` convention).
        current_version: the policy version being trained (staleness metrics, a3po).
        packing: pack each micro-batch's sequences (``trainer.packing``).
        max_tokens_per_micro_batch: > 0: micro-batches formed by length within this many tokens and
            DP shares balanced by tokens (``trainer.max_tokens_per_micro_batch``); DP ranks may then
            run different numbers of micro-batches: each scales its losses by its own count below
            (megatron divides by the local count), DDP reduces the gradients once per update
            whatever the count, and the stats/metrics reductions are one collective per rank.
    Returns (on every rank): ``loss`` (the whole minibatch's loss), ``grad_norm``, ``lr``,
    ``update_successful``, ``skipped`` (1 when a NaN/inf loss or gradient skipped the update) and
    ``skipped_steps`` (the run's total so far), ``tokens`` (loss tokens), ``micro_batches`` and the loss's metrics
    averaged over loss tokens (prefixed ``loss/``).
    """
    from megatron.core import parallel_state as ps

    # the submodule, not the package attribute: importing the submodule rebinds that name to it
    from megarl.algorithms.policy_loss import has_batch_sums, policy_loss
    from megarl.algorithms.registry import get_loss
    from megarl.trainer.model import unwrap
    from megarl.trainer.optimizer import optimizer_step

    params = dict(loss_params or {})
    with_entropy = bool(params.get("entropy_coef", 0.0))
    if params.get("kl_coef", 0.0) and batch.ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs batch.ref_logprobs (reference-policy logprobs): fill them with "
                         "prepare_batch(...) and a reference model before train_step")
    if params.get("distill_coef", 0.0) and batch.teacher_logprobs is None:
        raise ValueError("distill_coef != 0 needs batch.teacher_logprobs (the teacher's logprobs of the sampled "
                         "tokens): fill them with the teacher executor (megarl/teacher) before train_step")
    params.pop("agg_denominator", None)
    aggregation = params.get("aggregation", "token-mean")
    denominator = _global_denominator(batch, aggregation)
    (model,) = objs.model
    vocab = unwrap(model).megarl_dims.vocab_size
    balance = max_tokens_per_micro_batch > 0
    local = batch.select(dp_rows(batch, balance)[ps.get_data_parallel_rank()])
    micro = [local.select(rows) for rows in micro_batch_rows(local, micro_batch_size, max_tokens_per_micro_batch)]
    scale = len(micro) * ps.get_data_parallel_world_size()  # undo megatron's 1/num_mb and DDP's 1/dp
    # a3po with algorithm.prox_check: the recomputed prox is only compared with its approximation
    compare_prox = getattr(get_loss(loss_name), "approximates_prox", False)
    stats = (minibatch_stats(model, micro, loss_name, params, vocab, temperature, packing)
             if has_batch_sums(loss_name) else None)
    sums: dict[str, float] = {}
    weight = 0.0

    def on_logits(mb: RolloutBatch, logits: torch.Tensor, layout=None):
        nonlocal weight
        logprobs, entropy = aligned_logprobs(logits, mb, layout, vocab, temperature, with_entropy=with_entropy)
        loss, metrics = policy_loss(
            loss_name, logprobs=logprobs, behav_logprobs=mb.behav_logprobs, advantages=mb.advantages,
            mask=mb.loss_mask, prox_logprobs=None if compare_prox else mb.prox_logprobs, versions=mb.versions,
            current_version=current_version, ref_logprobs=mb.ref_logprobs, entropy=entropy,
            teacher_logprobs=mb.teacher_logprobs,
            agg_denominator=denominator, batch_stats=stats,
            prox_reference=mb.prox_logprobs if compare_prox else None, **params)
        w = float(mb.loss_mask.sum())
        for k, v in metrics.items():
            if k in ("tokens", "loss"):
                continue
            sums[k] = sums.get(k, 0.0) + (float(v) if k in _SUMMED else float(v) * w)
        sums["tokens"] = sums.get("tokens", 0.0) + w
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
        weight += w
        return loss * scale, {}

    model.train()
    run_pipeline(model, micro, on_logits, forward_only=False, packing=packing)
    metrics = _reduce_metrics(sums, weight) if ps.is_pipeline_last_stage() else None
    metrics = _broadcast_metrics(metrics)
    step = optimizer_step(objs, loss=metrics.get("loss", 0.0))  # a NaN/inf loss or gradient: skipped
    out = {"loss": metrics.get("loss", float("nan")), "tokens": metrics.get("tokens", 0.0),
           "micro_batches": len(micro), **step}
    out.update({f"loss/{k}": v for k, v in metrics.items() if k not in ("loss", "tokens")})
    return out


def minibatch_stats(model, micro: list[RolloutBatch], loss_name: str, params: dict, vocab: int,
                    temperature: float, packing: bool = False) -> dict[str, float] | None:
    """The statistic a loss decides on (``loss_batch_sums``, e.g. VACO's TV), summed over this DP
    rank's micro-batches and then over DP ranks: a no-grad forward pass over the minibatch at the
    current weights, before the update's own pass (which sees the same weights, so the same
    logprobs). A forward pass more per update, for such losses only. The sums live on the last PP
    stage, the only one that computes the loss; other stages return None."""
    from megatron.core import parallel_state as ps

    from megarl.algorithms.policy_loss import loss_batch_sums

    sums: dict[str, float] = {}

    def on_logits(mb: RolloutBatch, logits: torch.Tensor, layout=None):
        logprobs, _ = aligned_logprobs(logits, mb, layout, vocab, temperature)
        for k, v in loss_batch_sums(loss_name, logprobs=logprobs, behav_logprobs=mb.behav_logprobs,
                                    mask=mb.loss_mask, prox_logprobs=mb.prox_logprobs,
                                    tis=params.get("tis", "none")).items():
            sums[k] = sums.get(k, 0.0) + v
        return torch.zeros(()), {}

    with torch.no_grad():
        run_pipeline(model, micro, on_logits, forward_only=True, packing=packing)
    if not ps.is_pipeline_last_stage():
        return None
    keys = sorted(sums)  # the loss's fixed names: the same on every DP rank of the last stage
    vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(vec, group=ps.get_data_parallel_group())
    return {k: float(v) for k, v in zip(keys, vec)}


def build_reference_model(model_dir, params_dtype: torch.dtype = torch.float32):
    """The frozen reference policy for the KL penalty: a Megatron model at this rank's TP/PP
    layout (call after ``init_model_parallel``), loaded once from ``model_dir`` -- the HF folder
    (or megarl Megatron checkpoint) the trainer started from, never a resumed checkpoint, so a
    resumed run keeps the same reference. In eval mode, no grads, never wrapped in DDP/optimizer."""
    from megarl.trainer.convert import load_pretrained
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import build_gpt_model, read_hf_config

    dims = ModelDims.from_hf_config(read_hf_config(model_dir))
    ref = build_gpt_model(dims, params_dtype=params_dtype, init_weights=False)
    load_pretrained(ref, model_dir)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def prepare_batch(objs, ref_model, batch: RolloutBatch, algo_cfg, micro_batch_size: int,
                  temperature: float = 1.0, packing: bool = False,
                  max_tokens_per_micro_batch: int = 0) -> tuple[RolloutBatch, dict]:
    """The extra no-grad forward passes the loss and its options need, before ``train_step``:
    proximal logprobs of the current policy (``needs_prox``: decoupled_ppo, tis != none) and
    reference logprobs (``needs_ref``: kl_coef > 0, with ``ref_model`` from
    :func:`build_reference_model`). Collective like ``train_step`` (every trainer rank calls it
    with the same global batch). Returns the filled batch and timing metrics (seconds)."""
    import dataclasses
    import time

    from megarl.algorithms.config import needs_prox, needs_ref
    from megarl.trainer.logprobs import compute_logprobs

    fill: dict[str, torch.Tensor] = {}
    timings: dict[str, float] = {}
    if needs_prox(algo_cfg):
        t0 = time.monotonic()
        (model,) = objs.model
        fill["prox_logprobs"] = compute_logprobs(model, batch, micro_batch_size=micro_batch_size,
                                                 temperature=temperature, packing=packing,
                                                 max_tokens_per_micro_batch=max_tokens_per_micro_batch).logprobs
        timings["prox_logprobs_s"] = time.monotonic() - t0
    if needs_ref(algo_cfg):
        if ref_model is None:
            raise ValueError(f"algorithm.kl_coef={algo_cfg.kl_coef} needs a reference model (build_reference_model)")
        t0 = time.monotonic()
        fill["ref_logprobs"] = compute_logprobs(ref_model, batch, micro_batch_size=micro_batch_size,
                                                temperature=temperature, packing=packing,
                                                max_tokens_per_micro_batch=max_tokens_per_micro_batch).logprobs
        timings["ref_logprobs_s"] = time.monotonic() - t0
    return (dataclasses.replace(batch, **fill) if fill else batch), timings
