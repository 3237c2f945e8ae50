"""The one entry point the trainer calls: :func:`policy_loss`.

It validates and sanitises the per-token tensors, applies the options every loss can use
(truncated IS for train/inference mismatch, score centering, KL to a reference, entropy bonus),
aggregates, and returns the health metrics as python floats.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, Optional, Tuple, Union

import torch

from megarl.algorithms import losses as _losses  # noqa: F401  (registers the losses)
from megarl.algorithms.config import AGGREGATIONS, KL_ESTIMATORS, TIS_MODES, AlgorithmConfig
from megarl.algorithms.losses import LossInputs
from megarl.algorithms.metrics import (fraction, importance_metrics, masked_mean, staleness_metrics,
                                       to_floats)
from megarl.algorithms.registry import get_loss

Tensor = torch.Tensor

# Options of policy_loss that apply to every loss (the rest of loss_params is per loss).
_COMMON_LOSS_OPTIONS = ("aggregation", "tis", "tis_cap", "score_centering", "kl_coef", "kl_estimator",
                        "entropy_coef", "distill_coef")


def loss_knobs(name: str) -> Tuple[str, ...]:
    """Names of the loss-specific keyword parameters the loss ``name`` accepts."""
    fn = get_loss(name)
    params = list(inspect.signature(fn).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def loss_params(cfg: AlgorithmConfig) -> Dict[str, Any]:
    """Keyword arguments for ``policy_loss(cfg.loss, ...)``: the common options plus the loss's own knobs."""
    params = {name: getattr(cfg, name) for name in _COMMON_LOSS_OPTIONS}
    params.update({name: getattr(cfg, name) for name in loss_knobs(cfg.loss)})
    return params


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token-mean",
              denominator: Optional[Union[float, Tensor]] = None) -> Tensor:
    """Reduce a per-token ``[batch, seq]`` quantity to a scalar.

    - ``token-mean``: sum over all completion tokens / number of completion tokens.
    - ``seq-mean-token-sum``: mean over sequences of the per-sequence token sum.
    - ``seq-mean-token-mean``: mean over sequences of the per-sequence token mean.
    Sequences without a completion token (all-masked rows) are not counted. ``denominator``, when
    given, replaces the local count (tokens or sequences), so micro-batches that each divide by
    the global count sum to the global mean. An empty batch gives 0 (still attached to the graph).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; known: {', '.join(AGGREGATIONS)}")
    maskf = mask.to(per_token.dtype)
    masked = per_token * maskf
    if mode == "token-mean":
        numerator, count = masked.sum(), maskf.sum()
    else:
        tokens = maskf.sum(-1)
        rows = masked.sum(-1)
        if mode == "seq-mean-token-mean":
            rows = rows / tokens.clamp(min=1)
        numerator, count = rows.sum(), (tokens > 0).sum().to(per_token.dtype)
    if denominator is None:
        return numerator / count.clamp(min=1)
    if not float(denominator) > 0:
        raise ValueError(f"agg_denominator must be > 0, got {denominator!r}")
    return numerator / denominator


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || ref) estimate on tokens y sampled (approximately) from pi, as a loss term.

    With d = log pi(y) - log ref(y): k1 = d, k2 = d^2 / 2, k3 = ref/pi - 1 - log(ref/pi) (>= 0, Schulman's
    low-variance estimator; its log-ratio is clamped to [-20, 20] against overflow). k1 and k3 are
    unbiased estimates of KL(pi || ref)'s value; what a loss term does is its gradient, whose mean over
    y ~ pi is: k1's grad log pi, 0 (no pull toward ref: AlgorithmConfig refuses it as a penalty); k2's,
    grad KL(pi || ref); k3's, (1 - ref/pi) grad log pi, grad KL(ref || pi) (the other direction: GRPO's,
    DeepSeekMath eq. 4). ``k1+`` and ``k3+`` give k1's or k3's value with k2's gradient (straight-through):
    an unbiased value and the gradient of KL(pi || ref).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    diff = logprobs - ref_logprobs
    k2 = 0.5 * diff * diff
    base = estimator.rstrip("+")
    if base == "k1":
        value = diff
    elif base == "k2":
        value = k2
    else:
        log_ratio = (-diff).clamp(-20.0, 20.0)
        value = log_ratio.exp() - 1.0 - log_ratio
    if estimator.endswith("+"):
        return value.detach() + (k2 - k2.detach())
    return value


def centered_score_logprobs(logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor,
                            full_logprobs: Optional[Tensor] = None,
                            behav_full_logprobs: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """log pi with the same value whose gradient is the centered score grad log pi(y) - E_{y'~mu} grad log pi(y').

    Exact, with the full-vocab logprobs ``[batch, seq, vocab]`` of both pi (with grad) and mu:
    subtract C - sg(C), C = sum_v sg(mu_v) log pi_v. Otherwise a token-level approximation: mu
    over the vocabulary is taken to be pi except at the sampled token y, where it is the known
    mu(y) (the remaining mass 1 - mu(y) spread in proportion to pi). Then E_mu[grad log pi] =
    (mu(y) - pi(y)) / (1 - pi(y)) * grad log pi(y), so the centered score is
    sg((1 - mu(y)) / (1 - pi(y))) * grad log pi(y) (denominator floored at 1e-6).
    """
    detached = logprobs.detach()
    if (full_logprobs is None) != (behav_full_logprobs is None):
        raise ValueError("score centering needs both full_logprobs and behav_full_logprobs (full-vocab "
                         "[batch, seq, vocab]) for the exact form, or neither for the token approximation")
    if full_logprobs is not None:
        if full_logprobs.shape[:-1] != logprobs.shape or behav_full_logprobs.shape != full_logprobs.shape:
            raise ValueError(f"full-vocab logprobs must be [batch, seq, vocab] matching logprobs {tuple(logprobs.shape)}; "
                             f"got full_logprobs {tuple(full_logprobs.shape)}, behav_full_logprobs "
                             f"{tuple(behav_full_logprobs.shape)}")
        dtype = torch.promote_types(full_logprobs.dtype, logprobs.dtype)
        sampler_probs = torch.nan_to_num(behav_full_logprobs.detach().to(dtype).exp())
        expected = (sampler_probs * full_logprobs.to(dtype)).sum(-1)
        expected = torch.where(mask, expected, torch.zeros_like(expected))
        return logprobs - (expected - expected.detach()), {}
    factor = -torch.expm1(behav_logprobs) / (-torch.expm1(detached)).clamp(min=1e-6)
    factor = torch.where(mask, factor, torch.zeros_like(factor))
    return detached + factor * (logprobs - detached), {"score_center/factor_mean": masked_mean(factor, mask)}


def _tis_weight(prox: Tensor, behav: Tensor, mask: Tensor, mode: str, cap: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Truncated IS weight min(w, cap) for the trainer/sampler mismatch w = pi_train(old)/mu_sampler."""
    if not float(cap) > 0:
        raise ValueError(f"tis_cap must be > 0, got {cap!r}")
    log_w = torch.where(mask, prox - behav, torch.zeros_like(prox))
    if mode == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(prox)
    log_cap = math.log(float(cap))
    truncated = (log_w > log_cap) & mask
    weight = log_w.clamp(max=log_cap).exp()
    weight = torch.where(mask, weight, torch.zeros_like(weight))
    return weight, {"tis/weight_mean": masked_mean(weight, mask), "tis/clip_frac": fraction(truncated, mask)}


def _as_tokens(name: str, x: Optional[Tensor], shape: torch.Size, mask: Tensor, *, dtype=torch.float32) -> Optional[Tensor]:
    """Detached ``x`` as ``[batch, seq]`` (a ``[batch]`` tensor is broadcast over tokens), zero where masked."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 1 and x.shape[0] == shape[0]:
        x = x.unsqueeze(-1)
    if x.dim() != 2 or (x.shape[0] != shape[0]) or (x.shape[1] not in (1, shape[1])):
        raise ValueError(f"{name} must be [batch, seq] = {tuple(shape)} (or [batch]), got {tuple(x.shape)}")
    x = x.detach().to(dtype).expand(shape)
    return torch.where(mask, x, torch.zeros_like(x))


def policy_loss(name: str, *, logprobs: Tensor, behav_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                prox_logprobs: Optional[Tensor] = None, versions: Optional[Tensor] = None,
                current_version: Optional[int] = None, ref_logprobs: Optional[Tensor] = None,
                entropy: Optional[Tensor] = None, full_logprobs: Optional[Tensor] = None,
                behav_full_logprobs: Optional[Tensor] = None, aggregation: str = "token-mean",
                agg_denominator: Optional[Union[float, Tensor]] = None, tis: str = "none", tis_cap: float = 2.0,
                score_centering: bool = False, kl_coef: float = 0.0, kl_estimator: str = "k3",
                entropy_coef: float = 0.0, batch_stats: Optional[Dict[str, float]] = None,
                prox_reference: Optional[Tensor] = None, teacher_logprobs: Optional[Tensor] = None,
                distill_coef: float = 0.0, **params: Any) -> Tuple[Tensor, Dict[str, float]]:
    """Policy loss ``name`` over per-token ``[batch, seq]`` tensors; returns ``(loss, metrics)``.

    Args:
        logprobs: log pi of the sampled tokens under the policy being trained (carries the gradient).
        behav_logprobs: log mu, the sampler's logprobs of the same tokens.
        advantages: per token, or ``[batch]`` per sequence (broadcast).
        mask: 1/True on completion tokens; everything else is ignored (may hold garbage or -inf).
        prox_logprobs: proximal policy logprobs (decoupled_ppo), or the trainer's recomputation
            of the sampling policy (TIS).
        versions, current_version: per-token (or per-sequence) policy version that generated each
            token and the version being trained (a3po; staleness metrics).
        ref_logprobs: reference policy logprobs, needed when ``kl_coef`` != 0.
        entropy: per-token entropy of pi (with grad), needed when ``entropy_coef`` != 0.
        full_logprobs, behav_full_logprobs: ``[batch, seq, vocab]`` for exact score centering.
        aggregation: one of ``token-mean`` (default), ``seq-mean-token-sum``, ``seq-mean-token-mean``.
        agg_denominator: global token/sequence count to divide by instead of the local one.
        tis: ``none``, ``token`` or ``sequence``: truncated IS weight min(prox/mu, tis_cap) for the
            train/inference mismatch; the loss's own ratio is then taken against prox_logprobs.
        score_centering: replace grad log pi(y) by its centered version (see centered_score_logprobs).
        kl_coef, kl_estimator: weight and estimator (k1/k2/k3) of the KL(pi || ref) penalty.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        batch_stats: the loss's ``batch_sums`` over the whole minibatch (see :func:`loss_batch_sums`),
            for a loss that decides on a batch statistic (vaco's TV); None: over these tokens.
        prox_reference: recomputed proximal logprobs to compare with the proximal anchor the loss
            used (a3po's approximation): ``prox_error`` = mean |anchor - reference| over loss tokens.
        teacher_logprobs, distill_coef: the teacher's logprobs of the sampled tokens and the weight of
            its per-token reverse KL, subtracted from the advantage (megarl/algorithms/distill.py).
        **params: the loss's own knobs (rho, eps_low, eps_high, dual_clip_c, ...).

    Returns:
        ``loss`` (0-d tensor with grad) and ``metrics``: python floats with stable names
        (``loss``, ``pg_loss``, ``clip_frac``, ``is_weight/{mean,max,min}``, ``ess``, ``kl_mu_pi``,
        ``mismatch``, ``tokens``, ``stale_frac/d<k>``, ``staleness/{mean,max}``, and per-loss/option keys).
    """
    fn = get_loss(name)
    accepted = loss_knobs(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"loss {name!r} does not take {', '.join(unknown)}; its knobs are: "
                         f"{', '.join(accepted) or '(none)'}")
    if not isinstance(logprobs, Tensor) or logprobs.dim() != 2:
        raise ValueError(f"logprobs must be a [batch, seq] tensor, got "
                         f"{tuple(logprobs.shape) if isinstance(logprobs, Tensor) else type(logprobs).__name__}")
    shape = logprobs.shape
    if not isinstance(mask, Tensor) or mask.shape != shape:
        raise ValueError(f"mask must be [batch, seq] = {tuple(shape)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    if tis not in TIS_MODES:
        raise ValueError(f"unknown tis mode {tis!r}; known: {', '.join(TIS_MODES)}")
    m = mask.bool()

    compute_dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = torch.where(m, logprobs.to(compute_dtype), torch.zeros((), dtype=compute_dtype, device=logprobs.device))
    if behav_logprobs is None or advantages is None:
        raise ValueError("behav_logprobs (the sampler's logprobs of the sampled tokens) and advantages "
                         "(per token or per sequence) are required")
    mu = _as_tokens("behav_logprobs", behav_logprobs, shape, m, dtype=compute_dtype)
    adv = _as_tokens("advantages", advantages, shape, m, dtype=compute_dtype)
    prox = _as_tokens("prox_logprobs", prox_logprobs, shape, m, dtype=compute_dtype)
    distill_metrics: Dict[str, Tensor] = {}
    if distill_coef:  # on-policy distillation: A_t - coef * sg(log pi - log q), per token
        if teacher_logprobs is None:
            raise ValueError("distill_coef != 0 needs teacher_logprobs (the teacher's logprobs of the sampled tokens)")
        from megarl.algorithms.distill import distill_advantages

        teacher = _as_tokens("teacher_logprobs", teacher_logprobs, shape, m, dtype=compute_dtype)
        adv, distill_metrics["distill/reverse_kl"] = distill_advantages(adv, lp, teacher, m, distill_coef)

    staleness = None
    if versions is not None:
        if current_version is None:
            raise ValueError("versions were given without current_version (the policy version being trained)")
        v = _as_tokens("versions", versions, shape, m, dtype=torch.long)
        staleness = torch.where(m, int(current_version) - v, torch.zeros_like(v))
        if bool((staleness < 0).any()):
            raise ValueError(f"some token versions are newer than current_version={current_version}; "
                             f"max token version is {int(v[m].max())}")

    metrics: Dict[str, Tensor] = {}
    pg_logprobs = lp
    if score_centering:
        pg_logprobs, center_metrics = centered_score_logprobs(lp, mu, m, full_logprobs, behav_full_logprobs)
        metrics.update(center_metrics)

    anchor, tis_weight = mu, None
    if tis != "none":
        if getattr(fn, "owns_behaviour_correction", False):
            raise ValueError(f"loss {name!r} already corrects prox/mu itself; use tis='none' (and its "
                             f"behav_weight_cap to truncate that weight)")
        if prox is None:
            raise ValueError("tis needs prox_logprobs: the trainer's own logprobs of the sampled tokens under "
                             "the sampling weights (the mismatch is prox vs behav_logprobs)")
        tis_weight, tis_metrics = _tis_weight(prox, mu, m, tis, tis_cap)
        metrics.update(tis_metrics)
        anchor = prox

    terms = fn(LossInputs(pg_logprobs, mu, adv, m, anchor, prox, staleness, batch_stats), **params)
    if prox_reference is not None:
        if terms.prox_logprobs is None:
            raise ValueError(f"prox_reference: loss {name!r} has no proximal anchor to compare it with")
        ref_prox = _as_tokens("prox_reference", prox_reference, shape, m, dtype=compute_dtype)
        metrics["prox_error"] = masked_mean((terms.prox_logprobs - ref_prox).abs(), m)
    per_token = terms.per_token if tis_weight is None else terms.per_token * tis_weight
    pg_loss = aggregate(per_token, m, aggregation, agg_denominator)
    loss = pg_loss

    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs ref_logprobs (the reference policy's logprobs of the tokens)")
        ref = _as_tokens("ref_logprobs", ref_logprobs, shape, m, dtype=compute_dtype)
        kl = kl_penalty(lp, ref, kl_estimator)
        kl_value = aggregate(kl, m, aggregation, agg_denominator)
        loss = loss + float(kl_coef) * kl_value
        metrics["kl_ref"] = kl_value.detach()
    if entropy_coef:
        if entropy is None or entropy.shape != shape:
            raise ValueError(f"entropy_coef != 0 needs entropy: per-token entropy of pi [batch, seq] = "
                             f"{tuple(shape)} with grad")
        ent = torch.where(m, entropy.to(compute_dtype), torch.zeros((), dtype=compute_dtype, device=entropy.device))
        ent_value = aggregate(ent, m, aggregation, agg_denominator)
        loss = loss - float(entropy_coef) * ent_value
        metrics["entropy"] = ent_value.detach()

    out: Dict[str, Tensor] = {"loss": loss.detach(), "pg_loss": pg_loss.detach(), "tokens": m.sum(),
                              "clip_frac": fraction(terms.clipped, m)}
    out.update(importance_metrics(lp, mu, m))
    if staleness is not None:
        out.update(staleness_metrics(staleness, m))
    out.update(metrics)
    out.update(distill_metrics)
    out.update(terms.metrics)
    return loss, to_floats(out)


def loss_batch_sums(name: str, *, logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor,
                    prox_logprobs: Optional[Tensor] = None, tis: str = "none", **_: Any) -> Optional[Dict[str, float]]:
    """The sums a loss decides on over a whole minibatch (its ``batch_sums``, e.g. vaco's TV), from
    one micro-batch's tokens: they add up over micro-batches and DP ranks, and the total goes back to
    :func:`policy_loss` as ``batch_stats``. None for a loss that decides per token. Its anchor is the
    one ``policy_loss`` would give the loss: the trainer's prox under TIS, else the sampler's log mu."""
    sums_of = getattr(get_loss(name), "batch_sums", None)
    if sums_of is None:
        return None
    m = mask.bool()
    lp = torch.where(m, logprobs.detach().float(), torch.zeros((), device=logprobs.device))
    anchor = prox_logprobs if tis != "none" else behav_logprobs
    if anchor is None:
        raise ValueError("tis needs prox_logprobs (the trainer's recomputation of the sampling policy)")
    return sums_of(lp, _as_tokens("anchor", anchor, lp.shape, m, dtype=torch.float32), m)


def has_batch_sums(name: str) -> bool:
    """Whether loss ``name`` decides on a statistic of the whole minibatch (see :func:`loss_batch_sums`)."""
    return getattr(get_loss(name), "batch_sums", None) is not None
