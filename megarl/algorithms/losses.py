"""Per-token policy losses, registered by name.

Each loss is a small pure function ``fn(inp: LossInputs, *, <its knobs>) -> LossTerms``: it turns
per-token tensors ``[batch, seq]`` into a per-token loss whose gradient is the estimator the loss
names, plus a bool map of the tokens whose weight it clipped / truncated / filtered. Aggregation,
the options shared by all losses (TIS, score centering, KL, entropy) and the health metrics live
in :mod:`megarl.algorithms.policy_loss`; the formulas are written out in ``docs/algorithms.md``.

Conventions: ``inp.logprobs`` is log pi (carries the gradient), every other tensor is detached;
masked positions hold zeros, so no loss needs to mask again. ``inp.anchor_logprobs`` is what a
single-ratio loss compares pi against: the sampler's log mu, or under TIS the trainer's own
recomputation of it (the inference mismatch then lives in the TIS factor).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from megarl.algorithms.metrics import fraction, masked_mean, masked_max
from megarl.algorithms.registry import register_loss

Tensor = torch.Tensor


@dataclasses.dataclass
class LossInputs:
    """Per-token inputs of a loss, all ``[batch, seq]``, float32 unless noted, zero where masked."""

    logprobs: Tensor                # log pi of the sampled tokens under the policy being trained (grad)
    behav_logprobs: Tensor          # log mu: the sampler's logprobs of the same tokens
    advantages: Tensor              # A, broadcast to tokens
    mask: Tensor                    # bool, True on completion tokens
    anchor_logprobs: Tensor         # log mu, or the trainer-side prox logprobs under TIS
    prox_logprobs: Optional[Tensor] = None   # log pi_prox (decoupled PPO), detached
    staleness: Optional[Tensor] = None       # long: current_version - version of the token (a3po)
    # Statistics of the whole minibatch (all micro-batches, all DP ranks), summed before this call by
    # the trainer (``batch_sums`` of the loss); None: the loss decides on its own tokens.
    batch_stats: Optional[Dict[str, float]] = None


@dataclasses.dataclass
class LossTerms:
    """What a loss returns before aggregation."""

    per_token: Tensor               # [batch, seq] loss per token (zero where masked)
    clipped: Tensor                 # [batch, seq] bool: this token's weight was clipped/truncated/filtered
    metrics: Dict[str, Tensor] = dataclasses.field(default_factory=dict)   # loss-specific, 0-d tensors
    prox_logprobs: Optional[Tensor] = None  # the proximal anchor the loss used (decoupled family), detached


def _check_positive(name: str, value: float, loss: str, *, above: float = 0.0) -> None:
    if value is None or not float(value) > above:
        raise ValueError(f"loss {loss!r}: {name} must be > {above}, got {value!r}")


def _ppo_clip(log_ratio: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float,
              dual_clip_c: Optional[float], loss: str) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate per token: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) (+ dual clip).

    Written with an explicit "clipped" map instead of max(): a token is clipped when the clipped
    branch is strictly larger (A > 0 and r > 1+eps_high, or A < 0 and r < 1-eps_low); there the
    value is the constant -A*clip(r) and the gradient is zero. A ratio exactly at the boundary is
    not clipped and keeps the full gradient -A r grad(log pi). Dual clip (Ye et al. 2020): for
    A < 0 the loss is also capped at -A*c (c > 1), which zeroes the gradient where r > c.
    """
    if eps_low is None or eps_high is None or not (0.0 <= eps_low < 1.0) or not eps_high >= 0.0:
        raise ValueError(f"loss {loss!r}: need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low!r}, "
                         f"eps_high={eps_high!r}")
    r = log_ratio.detach().exp()
    low, high = 1.0 - float(eps_low), 1.0 + float(eps_high)
    clipped = ((adv > 0) & (r > high)) | ((adv < 0) & (r < low))
    metrics: Dict[str, Tensor] = {}
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        _check_positive("dual_clip_c", dual_clip_c, loss, above=1.0)
        dual = (adv < 0) & (r > float(dual_clip_c)) & mask
        metrics["dual_clip_frac"] = fraction(dual, mask)
    ratio = _live_ratio(log_ratio, clipped | dual)
    per_token = torch.where(clipped, -adv * r.clamp(low, high), -adv * ratio)
    per_token = torch.where(dual, -adv * float(dual_clip_c or 0.0), per_token)
    return per_token, (clipped | dual) & mask, metrics


def _live_ratio(log_ratio: Tensor, constant: Tensor) -> Tensor:
    """exp(log_ratio) with its gradient, taken only where the loss uses it: at the ``constant`` tokens
    (clipped, dropped) it is 1. A ratio there may overflow (log pi - log mu > 88.7 in float32), and
    torch.where's backward would multiply the 0 of the unused branch by that inf: a NaN gradient that
    costs the whole update."""
    return torch.where(constant, torch.zeros_like(log_ratio), log_ratio).exp()


@register_loss("aipo")
def aipo_loss(inp: LossInputs, *, rho: float = 4.0) -> LossTerms:
    """AIPO (LlamaRL): -sg(min(pi/mu, rho)) * A * log pi.

    Tokens above the cap keep the truncated weight rho (they still learn); a ratio exactly at rho
    is not counted as clipped.
    """
    _check_positive("rho", rho, "aipo")
    ratio = (inp.logprobs.detach() - inp.anchor_logprobs).exp()
    weight = ratio.clamp(max=float(rho))
    per_token = -weight * inp.advantages * inp.logprobs
    clipped = (ratio > float(rho)) & inp.mask
    return LossTerms(per_token, clipped, {"aipo/weight_mean": masked_mean(weight, inp.mask)})


def _ppo(inp: LossInputs, eps_low: float, eps_high: float, dual_clip_c: Optional[float], name: str) -> LossTerms:
    per_token, clipped, metrics = _ppo_clip(inp.logprobs - inp.anchor_logprobs, inp.advantages, inp.mask,
                                            eps_low, eps_high, dual_clip_c, name)
    return LossTerms(per_token, clipped, {f"ppo/{k}": v for k, v in metrics.items()})


@register_loss("ppo")
def ppo_loss(inp: LossInputs, *, eps_low: float = 0.2, eps_high: float = 0.2,
             dual_clip_c: Optional[float] = None) -> LossTerms:
    """PPO clipped surrogate with r = pi/mu and asymmetric clip [1-eps_low, 1+eps_high]."""
    return _ppo(inp, eps_low, eps_high, dual_clip_c, "ppo")


@register_loss("grpo")
def grpo_loss(inp: LossInputs, *, eps_low: float = 0.2, eps_high: float = 0.2,
              dual_clip_c: Optional[float] = None) -> LossTerms:
    """GRPO's policy loss: the PPO clipped surrogate (the group-normalised advantage is upstream)."""
    return _ppo(inp, eps_low, eps_high, dual_clip_c, "grpo")


def _decoupled(inp: LossInputs, log_prox: Tensor, eps_low: float, eps_high: float,
               dual_clip_c: Optional[float], behav_weight_cap: Optional[float], name: str) -> LossTerms:
    """sg(prox/mu) * PPO-clip(pi/prox): trust region around prox, off-policy correction prox/mu."""
    behav_weight = torch.where(inp.mask, (log_prox - inp.behav_logprobs).exp(), 0.0)
    metrics: Dict[str, Tensor] = {}
    if behav_weight_cap is not None:
        _check_positive("behav_weight_cap", behav_weight_cap, name)
        metrics[f"{name}/behav_weight_trunc_frac"] = fraction(behav_weight > float(behav_weight_cap), inp.mask)
        behav_weight = behav_weight.clamp(max=float(behav_weight_cap))
    per_token, clipped, ppo_metrics = _ppo_clip(inp.logprobs - log_prox, inp.advantages, inp.mask,
                                                eps_low, eps_high, dual_clip_c, name)
    metrics.update({f"{name}/{k}": v for k, v in ppo_metrics.items()})
    metrics[f"{name}/behav_weight_mean"] = masked_mean(behav_weight, inp.mask)
    metrics[f"{name}/behav_weight_max"] = masked_max(behav_weight, inp.mask)
    return LossTerms(behav_weight * per_token, clipped, metrics, prox_logprobs=log_prox.detach())


@register_loss("decoupled_ppo")
def decoupled_ppo_loss(inp: LossInputs, *, eps_low: float = 0.2, eps_high: float = 0.2,
                       dual_clip_c: Optional[float] = None,
                       behav_weight_cap: Optional[float] = None) -> LossTerms:
    """Decoupled PPO (Hilton et al. 2022; AReaL): sg(prox/mu) * PPO-clip(pi/prox), prox supplied."""
    if inp.prox_logprobs is None:
        raise ValueError("loss 'decoupled_ppo' needs prox_logprobs (the proximal policy's logprobs of the sampled "
                         "tokens, e.g. recomputed by the trainer before this update); or use loss 'a3po', which "
                         "approximates them from the token versions")
    return _decoupled(inp, inp.prox_logprobs, eps_low, eps_high, dual_clip_c, behav_weight_cap, "decoupled_ppo")


decoupled_ppo_loss.owns_behaviour_correction = True  # type: ignore[attr-defined]


def a3po_alpha(staleness: Tensor) -> Tensor:
    """A-3PO's alpha (arXiv 2512.06547 section 3: log prox = alpha log mu + (1 - alpha) log pi), the weight
    of the sampler: the proximal policy is one version behind the trained one, v_prox = v_theta - 1, so
    1 - alpha = (v_prox - v_behav) / (v_theta - v_behav) (AReaL's interpolation weight), i.e. alpha = 1/d
    for staleness d >= 1, and 1 when fresh (prox = mu)."""
    d = staleness.double()
    return torch.where(d > 0, 1.0 / d.clamp(min=1.0), torch.ones_like(d)).float()


@register_loss("a3po")
def a3po_loss(inp: LossInputs, *, eps_low: float = 0.2, eps_high: float = 0.2,
              dual_clip_c: Optional[float] = None, behav_weight_cap: Optional[float] = None) -> LossTerms:
    """A-3PO (arXiv 2512.06547, section 3): decoupled PPO with log prox = alpha log mu + (1 - alpha) sg(log pi),
    alpha from staleness (:func:`a3po_alpha`). log pi is the training forward's own: at the step's first minibatch update that
    is the policy the step started from; later updates interpolate towards the moved policy (the paper's
    "tensors already available from the training loop", with no extra forward pass)."""
    if inp.prox_logprobs is not None:
        raise ValueError("loss 'a3po' approximates the proximal logprobs itself; drop prox_logprobs, or use loss "
                         "'decoupled_ppo' to train with the supplied ones")
    if inp.staleness is None:
        raise ValueError("loss 'a3po' needs versions (per-token policy versions) and current_version")
    alpha = a3po_alpha(inp.staleness)
    log_prox = inp.behav_logprobs + (1.0 - alpha) * (inp.logprobs.detach() - inp.behav_logprobs)
    terms = _decoupled(inp, log_prox, eps_low, eps_high, dual_clip_c, behav_weight_cap, "a3po")
    terms.metrics["a3po/alpha_mean"] = masked_mean(alpha, inp.mask)
    return terms


a3po_loss.owns_behaviour_correction = True  # type: ignore[attr-defined]
a3po_loss.approximates_prox = True  # type: ignore[attr-defined]  (prox_check compares it with a recompute)


@register_loss("vaco")
def vaco_loss(inp: LossInputs, *, tv_delta: float = 0.2) -> LossTerms:
    """VACO total-variation filtering (Align and Filter): the IS surrogate -A * pi/mu, filtered.

    TV = 0.5 * E_tokens |pi/mu - 1|. When TV > tv_delta / 2, the tokens whose gradient step would
    increase it (A * sign(pi - mu) > 0) are dropped (zero loss, still counted in the mean);
    otherwise every token is kept. The expectation is over the whole minibatch (VACO, arXiv
    2603.01365 section 4.2.2: the filter is decided per minibatch), which the trainer sums with :func:`vaco_batch_sums`
    over every micro-batch and DP rank before the update and passes in ``inp.batch_stats``; without
    it, over the tokens given.
    """
    _check_positive("tv_delta", tv_delta, "vaco")
    r = (inp.logprobs.detach() - inp.anchor_logprobs).exp()
    sums = inp.batch_stats if inp.batch_stats is not None else vaco_batch_sums(inp.logprobs, inp.anchor_logprobs,
                                                                              inp.mask)
    tv = torch.as_tensor(0.5 * float(sums["vaco/abs_dev"]) / max(float(sums["vaco/tokens"]), 1.0))
    active = tv > 0.5 * float(tv_delta)
    drop = active & (inp.advantages * (r - 1.0) > 0) & inp.mask
    ratio = _live_ratio(inp.logprobs - inp.anchor_logprobs, drop)
    per_token = torch.where(drop, torch.zeros_like(ratio), -inp.advantages * ratio)
    return LossTerms(per_token, drop, {"vaco/tv": tv, "vaco/filter_active": active.float(),
                                       "vaco/filter_frac": fraction(drop, inp.mask)})


def vaco_batch_sums(logprobs: Tensor, anchor_logprobs: Tensor, mask: Tensor) -> Dict[str, float]:
    """The sums VACO's TV estimate is made of, over the given tokens: sum |pi/mu - 1| and the token
    count. They add up over micro-batches and DP ranks, so the trainer reduces them to the minibatch's."""
    r = (logprobs.detach() - anchor_logprobs).exp()
    return {"vaco/abs_dev": float(torch.where(mask, (r - 1.0).abs(), torch.zeros_like(r)).double().sum()),
            "vaco/tokens": float(mask.sum())}


vaco_loss.batch_sums = vaco_batch_sums  # type: ignore[attr-defined]


@register_loss("sao")
def sao_loss(inp: LossInputs, *, eps_low: float = 0.2, eps_high: float = 0.2) -> LossTerms:
    """SAO's clip (arXiv 2607.07508): the importance-weighted surrogate -A * pi/mu, where a token whose
    ratio pi/mu has left the band [1 - eps_low, 1 + eps_high] around the rollout policy stops updating,
    whatever the sign of its advantage (PPO's clip stops only the moves that go on in the direction A
    already pushed). Out of the band the value is kept (-A * r, constant) and the gradient is zero; a
    ratio exactly on the band's edge still updates.
    """
    if not (0.0 <= float(eps_low) < 1.0) or not float(eps_high) >= 0.0:
        raise ValueError(f"loss 'sao': need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low!r}, "
                         f"eps_high={eps_high!r}")
    r = (inp.logprobs.detach() - inp.anchor_logprobs).exp()
    out = ((r < 1.0 - float(eps_low)) | (r > 1.0 + float(eps_high))) & inp.mask
    ratio = _live_ratio(inp.logprobs - inp.anchor_logprobs, out)
    per_token = torch.where(out, -inp.advantages * r, -inp.advantages * ratio)
    return LossTerms(per_token, out, {"sao/out_of_band_frac": fraction(out, inp.mask)})
