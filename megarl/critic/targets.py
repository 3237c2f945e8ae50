"""A step's per-token advantages and the critic's targets, from its values (algorithm.advantage gae|vtrace).

The controller's critic step (megarl/critic/executor.py ``CriticExecutor.advantages``) calls
:func:`critic_targets` with the batch's sequence rewards (credited to each row's last action) and the
values the critic gave the batch; GAE and V-trace themselves are megarl/algorithms/value_targets.py.
V-trace also takes log pi - log mu of every sampled token: the policy's logprobs before its update
against the sampler's (``behav_logprobs``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megarl.algorithms.value_targets import gae, last_action_rewards, vtrace
from megarl.batch import RolloutBatch


def critic_targets(algo, batch: RolloutBatch, rewards: Sequence[float], values: torch.Tensor, *,
                   policy_logprobs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, targets)`` ``[B, S]`` of ``algo.advantage`` (gae: GAE's advantages and returns;
    vtrace: V-trace's policy advantages and v_s targets, which need ``policy_logprobs``), zero off the
    loss mask; algorithm.gae_gamma, gae_lambda, vtrace_rho_bar and vtrace_c_bar are the knobs."""
    mask = batch.loss_mask.bool()
    r = last_action_rewards(torch.as_tensor(list(rewards), dtype=torch.float64), mask)
    if algo.advantage == "gae":
        return gae(r, values, mask, gamma=algo.gae_gamma, lam=algo.gae_lambda)
    if algo.advantage == "vtrace":
        if policy_logprobs is None:
            raise ValueError("algorithm.advantage=vtrace needs the policy's logprobs of the batch (log pi - log mu)")
        log_rhos = torch.where(mask, policy_logprobs.float() - batch.behav_logprobs.float(), 0.0)
        return vtrace(r, values, mask, log_rhos, gamma=algo.gae_gamma, lam=algo.gae_lambda,
                      rho_bar=algo.vtrace_rho_bar, c_bar=algo.vtrace_c_bar)
    raise ValueError(f"algorithm.advantage={algo.advantage!r} takes no critic; gae and vtrace do")


__all__ = ["critic_targets"]
