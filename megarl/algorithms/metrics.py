"""Health metrics of off-policy RL, computed over the completion tokens (mask = 1).

Every function here returns 0-d detached tensors, so the loss path does not wait on the device
for each metric (only the staleness histogram needs its size on the host); :func:`to_floats`
turns a whole metrics dict into python floats with one transfer.
Empty selections (an all-masked batch) give 0.0, never NaN, so logs stay plottable.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Union

import torch

Tensor = torch.Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` over positions where the bool ``mask`` is True."""
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over True positions of ``mask``; 0 when the mask is empty."""
    count = mask.sum()
    return masked_sum(x, mask) / count.clamp(min=1)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of ``x`` over True positions of ``mask``; 0 when the mask is empty."""
    if x.numel() == 0:
        return x.new_zeros(())
    value = torch.where(mask, x, torch.full_like(x, -torch.inf)).max()
    return torch.where(mask.any(), value, torch.zeros_like(value))


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    """Min of ``x`` over True positions of ``mask``; 0 when the mask is empty."""
    return -masked_max(-x, mask)


def importance_metrics(logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor) -> Dict[str, Tensor]:
    """How far the learner pi is from the sampler mu on the sampled tokens.

    - ``is_weight/mean|max|min``: the raw token importance weight w = pi/mu.
    - ``ess``: normalised effective sample size (sum w)^2 / (n sum w^2), in (0, 1]; 1 = on-policy.
    - ``kl_mu_pi``: KL(mu || pi) estimated on tokens sampled from mu with the non-negative k3
      estimator E_mu[(w - 1) - log w].
    - ``mismatch``: mean |log pi - log mu| (train/inference mismatch when the versions agree).
    """
    # float64: w^2 of a very off-policy token (log w > 44) would overflow float32 in the ESS
    log_w = torch.where(mask, logprobs.detach().double() - behav_logprobs.detach().double(), 0.0)
    w = log_w.exp()
    count = mask.sum().clamp(min=1)
    sum_w = masked_sum(w, mask)
    sum_w2 = masked_sum(w * w, mask)
    ess = torch.where(sum_w2 > 0, sum_w * sum_w / (count * sum_w2).clamp(min=1e-30), torch.zeros_like(sum_w))
    return {
        "is_weight/mean": sum_w / count,
        "is_weight/max": masked_max(w, mask),
        "is_weight/min": masked_min(w, mask),
        "ess": ess,
        "kl_mu_pi": masked_mean(w - 1.0 - log_w, mask),
        "mismatch": masked_mean(log_w.abs(), mask),
    }


def staleness_metrics(staleness: Tensor, mask: Tensor) -> Dict[str, Tensor]:
    """Fraction of completion tokens by staleness d = current_version - token_version.

    Keys: ``stale_frac/d<k>`` for every d from 0 to the largest one present (so the set of keys
    is stable for a given max lag), plus ``staleness/mean`` and ``staleness/max``.
    """
    d = staleness[mask].long()
    total = max(int(d.numel()), 1)
    out: Dict[str, Tensor] = {}
    if d.numel():
        counts = torch.bincount(d).double() / total
        for k, frac in enumerate(counts.unbind(0)):
            out[f"stale_frac/d{k}"] = frac
    out["staleness/mean"] = masked_mean(staleness.double(), mask)
    out["staleness/max"] = masked_max(staleness.double(), mask)
    return out


def to_floats(metrics: Mapping[str, Union[Tensor, float, int]]) -> Dict[str, float]:
    """Detach every metric to a python float, with a single device->host transfer."""
    keys = list(metrics)
    if not keys:
        return {}
    device = next((v.device for v in metrics.values() if isinstance(v, Tensor)), torch.device("cpu"))
    stacked = torch.stack([
        v.detach().reshape(()).to(device=device, dtype=torch.float64) if isinstance(v, Tensor)
        else torch.tensor(float(v), dtype=torch.float64, device=device)
        for v in metrics.values()])
    values = stacked.tolist()
    return dict(zip(keys, values))


def fraction(flags: Tensor, mask: Tensor, count: Optional[Tensor] = None) -> Tensor:
    """Fraction of True positions of ``mask`` where ``flags`` is also True; 0 on an empty mask."""
    n = mask.sum() if count is None else count
    return (flags & mask).sum().double() / n.clamp(min=1).double()
