"""Advantage estimators over groups of samples of the same prompt, registered by name.

Each takes sequence rewards ``[n]`` and the prompt group of every sample (``group_ids [n]``,
any integers, or ``group_size`` for contiguous groups) and returns one advantage per sample
``[n]``; :func:`expand_to_tokens` broadcasts it over the completion tokens. A group of one sample
carries no relative signal: its advantage is 0 under every estimator.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.algorithms.registry import get_advantage, register_advantage
from megarl.algorithms.value_targets import INPUTS as _CRITIC_INPUTS  # registers gae and vtrace

Tensor = torch.Tensor


def _group_index(n: int, group_ids: Optional[Tensor], group_size: Optional[int], device) -> Tensor:
    """Dense group index 0..G-1 for every sample."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids (group of each sample) or group_size (contiguous groups)")
    if group_size is not None:
        if int(group_size) < 1 or n % int(group_size):
            raise ValueError(f"group_size={group_size} must be >= 1 and divide the number of samples {n}")
        return torch.arange(n, device=device) // int(group_size)
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must be [n] = ({n},) like rewards, got {tuple(group_ids.shape)}")
    return torch.unique(group_ids, return_inverse=True)[1].to(device)


def group_stats(rewards: Tensor, group_ids: Optional[Tensor] = None,
                group_size: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and unbiased group std (std is 0 for groups of one)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [n] (one scalar per sample), got {tuple(rewards.shape)}")
    r = rewards.detach().double()
    idx = _group_index(r.shape[0], group_ids, group_size, r.device)
    groups = int(idx.max()) + 1 if r.numel() else 0
    count = torch.zeros(groups, dtype=r.dtype, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, idx, r) / count
    sq = torch.zeros_like(count).index_add_(0, idx, (r - mean[idx]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[idx], mean[idx], std[idx]


@register_advantage("grpo")
def grpo_advantage(rewards: Tensor, *, group_ids: Optional[Tensor] = None, group_size: Optional[int] = None,
                   normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), unbiased std; without normalize_std it is Dr.GRPO."""
    count, mean, std = group_stats(rewards, group_ids, group_size)
    adv = rewards.detach().double() - mean
    if normalize_std:
        scale = std + float(eps)
        # a group of equal rewards has std 0 and centered rewards 0: its advantage is 0, not 0/0
        adv = torch.where(scale > 0, adv / scale.clamp(min=torch.finfo(scale.dtype).tiny), torch.zeros_like(adv))
    return torch.where(count > 1, adv, torch.zeros_like(adv)).to(rewards.dtype if rewards.is_floating_point()
                                                                 else torch.float32)


@register_advantage("dr_grpo")
def dr_grpo_advantage(rewards: Tensor, *, group_ids: Optional[Tensor] = None,
                      group_size: Optional[int] = None) -> Tensor:
    """Dr.GRPO (Liu et al. 2025): r - mean_group, no std normalisation (no difficulty bias)."""
    return grpo_advantage(rewards, group_ids=group_ids, group_size=group_size, normalize_std=False)


@register_advantage("rloo")
def rloo_advantage(rewards: Tensor, *, group_ids: Optional[Tensor] = None,
                   group_size: Optional[int] = None) -> Tensor:
    """RLOO: r_i - mean of the other samples of the group = K/(K-1) (r_i - mean_group)."""
    count, mean, _ = group_stats(rewards, group_ids, group_size)
    adv = (rewards.detach().double() - mean) * count / (count - 1).clamp(min=1)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).to(rewards.dtype if rewards.is_floating_point()
                                                                 else torch.float32)


def advantage_knobs(name: str) -> Tuple[str, ...]:
    """Names of the estimator-specific keyword parameters (besides the grouping) of ``name``."""
    params = list(inspect.signature(get_advantage(name)).parameters.values())[1:]
    return tuple(p.name for p in params
                 if p.kind is inspect.Parameter.KEYWORD_ONLY
                 and p.name not in ("group_ids", "group_size") + _CRITIC_INPUTS)


def advantage_params(cfg: AlgorithmConfig) -> Dict[str, Any]:
    """Keyword arguments for ``compute_advantages(cfg.advantage, ...)`` (besides the grouping)."""
    rename = {"eps": "adv_eps"}
    return {name: getattr(cfg, rename.get(name, name)) for name in advantage_knobs(cfg.advantage)}


def compute_advantages(name: str, rewards: Tensor, *, group_ids: Optional[Tensor] = None,
                       group_size: Optional[int] = None, **params: Any) -> Tensor:
    """Advantages ``[n]`` of the estimator ``name`` for sequence rewards ``[n]`` (``[n, seq]`` per token
    for the critic's estimators gae/vtrace, which also take ``values``, ``mask`` and ``log_rhos``)."""
    fn = get_advantage(name)
    unknown = sorted(set(params) - set(advantage_knobs(name)) - set(_CRITIC_INPUTS))
    if unknown:
        raise ValueError(f"advantage estimator {name!r} does not take {', '.join(unknown)}; its knobs are: "
                         f"{', '.join(advantage_knobs(name)) or '(none)'}")
    return fn(rewards, group_ids=group_ids, group_size=group_size, **params)


def expand_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-sample advantages ``[n]`` broadcast to ``[n, seq]`` on completion tokens (0 elsewhere)."""
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages [n] must match mask rows: {tuple(advantages.shape)} vs {tuple(mask.shape)}")
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)
