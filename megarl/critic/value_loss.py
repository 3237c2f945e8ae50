"""The critic's clipped value loss and its metrics (critic/value_loss, critic/explained_var).

PPO's value clip (as in OpenAI baselines ppo2 and verl's ``compute_value_loss``): the new value
may move at most ``value_clip`` from the value the rollout was scored with, and the loss takes
the worse of the clipped and unclipped squared errors, so a step never profits from moving a value
past the clip:

    L = 1/2 mean_tokens max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)

with ``G`` the targets (GAE's returns or V-trace's v_s), ``V_old`` the values the advantages were
computed with, the mean over the masked tokens (or over ``denominator`` tokens, the minibatch's
count when a micro-batch is one part of it). ``value_clip`` None: the plain squared error.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megarl.algorithms.value_targets import explained_variance

Tensor = torch.Tensor


def value_loss(values: Tensor, old_values: Tensor, targets: Tensor, mask: Tensor, *,
               value_clip: Optional[float] = 0.2, denominator: Optional[float] = None) -> Tuple[Tensor, Dict[str, float]]:
    """The clipped value loss (module doc) and its metrics: ``critic/value_loss`` (the loss),
    ``critic/clip_frac`` (tokens whose clipped error was the larger) and ``critic/explained_var``
    of ``old_values`` for ``targets`` (how well the values the advantages used predicted them)."""
    for name, x in (("old_values", old_values), ("targets", targets), ("mask", mask)):
        if tuple(x.shape) != tuple(values.shape):
            raise ValueError(f"{name} must be [batch, seq] = {tuple(values.shape)} like values, got {tuple(x.shape)}")
    if value_clip is not None and not float(value_clip) > 0:
        raise ValueError(f"value_clip must be > 0 (value units) or None (no clip), got {value_clip!r}")
    m = mask.bool()
    old, tgt = old_values.detach().to(values.dtype), targets.detach().to(values.dtype)
    err = (values - tgt) ** 2
    if value_clip is None:
        per_token, clipped = err, torch.zeros_like(m)
    else:
        c = float(value_clip)
        err_clipped = (old + (values - old).clamp(-c, c) - tgt) ** 2
        per_token = torch.maximum(err, err_clipped)
        clipped = (err_clipped > err) & m
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))
    count = float(m.sum()) if denominator is None else float(denominator)
    loss = 0.5 * per_token.sum() / max(count, 1.0)
    tokens = max(float(m.sum()), 1.0)
    return loss, {"critic/value_loss": float(loss.detach()), "critic/clip_frac": float(clipped.sum()) / tokens,
                  "critic/explained_var": explained_variance(old, tgt, m)}
