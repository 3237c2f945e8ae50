"""Per-token advantages from a critic's values: GAE and V-trace, registered as ``gae`` and ``vtrace``.

The MDP is the reply, one action per sampled token. Every tensor is ``[batch, seq]`` aligned like
the logprobs (megarl/batch.py): ``values[b, t]`` is the critic's V of the state *before* token t
(the prefix ``< t``), ``rewards[b, t]`` the reward of taking token t, and ``mask[b, t]`` is True on
the tokens the policy sampled. A multi-turn rollout's observation tokens (environment feedback,
``mask`` False inside the reply) are not actions: as SAO's GAE does (arXiv 2607.07508; seed 003),
the recursion *bridges* them -- the state after an action's last token is the state before the
next action's first token, whatever observation lies between -- so delta and the discount step
from action to action. After a row's last action the episode ends: V = 0 there.

GAE (Schulman et al. 2016), over a row's actions a_1..a_K:
    delta_k = r_k + gamma V_{k+1} - V_k,   A_k = delta_k + gamma lambda A_{k+1},   returns G_k = A_k + V_k.
V-trace (Espeholt et al. 2018, IMPALA, eq. 1 and remark 1; seed 004), with rho_k = pi/mu of action k:
    rhō_k = min(rho_bar, rho_k),  c_k = lambda min(c_bar, rho_k),
    v_k - V_k = rhō_k delta_k + gamma c_k (v_{k+1} - V_{k+1}),   v_{K+1} = V_{K+1} = 0;
the critic's target is v_k, the policy's advantage r_k + gamma v_{k+1} - V_k. The importance
weight IMPALA multiplies into the policy gradient (rhō_k) is left to the policy loss, which
weights every token by its own ratio (aipo's min(pi/mu, rho), ppo's clip): multiplying it here too
would count it twice. With pi = mu (and rho_bar, c_bar >= 1) V-trace's targets are GAE's returns.

Functions return ``(advantages, targets)``, zero off the mask; the estimators registered for
``algorithm.advantage`` take one reward per sample (the sequence reward, credited to the row's
last action) and the critic's values.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megarl.algorithms.registry import register_advantage

Tensor = torch.Tensor


def _check(name: str, x: Tensor, shape) -> None:
    if not isinstance(x, Tensor) or tuple(x.shape) != tuple(shape):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be [batch, seq] = {tuple(shape)} like mask, got {got}")


def actions(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """The action positions of each row left-packed: ``index [B, K]`` (column k = the row's k-th
    masked position; K = the most actions in a row) and ``valid [B, K]`` (False past a row's last)."""
    m = mask.bool()
    count = m.sum(-1)
    k = int(count.max()) if m.numel() else 0
    # a stable sort puts the masked positions first, in order
    order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices[:, :k]
    valid = torch.arange(k, device=m.device).unsqueeze(0) < count.unsqueeze(-1)
    return order, valid


def last_action_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Sequence rewards ``[B]`` placed on each row's last action token: ``[B, S]``, 0 elsewhere
    (a row with no action gets none)."""
    m = mask.bool()
    if rewards.shape != m.shape[:1]:
        raise ValueError(f"rewards must be [batch] = ({m.shape[0]},), one per row, got {tuple(rewards.shape)}")
    out = torch.zeros(m.shape, dtype=torch.float64, device=m.device)
    has = m.any(-1)
    last = m.shape[-1] - 1 - m.flip(-1).to(torch.int8).argmax(-1)
    rows = torch.nonzero(has).squeeze(-1)
    out[rows, last[rows]] = rewards.detach().double()[rows]
    return out


def _packed(rewards: Tensor, values: Tensor, mask: Tensor, extra: Optional[Tensor] = None):
    _check("rewards", rewards, mask.shape)
    _check("values", values, mask.shape)
    m = mask.bool()
    if bool((rewards.detach()[~m] != 0).any()):
        raise ValueError("rewards are set on tokens outside the mask (prompt, observation or padding); a reward "
                         "belongs to an action token (credit a sequence reward with last_action_rewards)")
    index, valid = actions(m)
    take = [torch.where(valid, x.detach().double().gather(1, index), 0.0) for x in (rewards, values)]
    if extra is not None:
        take.append(torch.where(valid, extra.detach().double().gather(1, index), 0.0))
    return index, valid, take


def _unpack(index: Tensor, valid: Tensor, packed: Tensor, like: Tensor) -> Tensor:
    out = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    out.scatter_(1, index, torch.where(valid, packed, 0.0))
    return out.to(like.dtype if like.is_floating_point() else torch.float32)


def _next(x: Tensor) -> Tensor:
    """x of the next action (0 after the last: its columns are invalid and hold 0)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> Tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) over each row's actions, observation tokens bridged (module doc).
    Returns ``(advantages, returns)`` ``[B, S]``, zero off the mask."""
    _check_unit("gamma", gamma)
    _check_unit("lambda", lam)
    index, valid, (r, v) = _packed(rewards, values, mask)
    delta = r + float(gamma) * _next(v) - v
    adv = torch.zeros_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for k in range(delta.shape[1] - 1, -1, -1):
        running = torch.where(valid[:, k], delta[:, k] + float(gamma) * float(lam) * running, 0.0)
        adv[:, k] = running
    return _unpack(index, valid, adv, values), _unpack(index, valid, adv + v, values)


def vtrace(rewards: Tensor, values: Tensor, mask: Tensor, log_rhos: Tensor, *, gamma: float, lam: float = 1.0,
           rho_bar: float = 1.0, c_bar: float = 1.0) -> Tuple[Tensor, Tensor]:
    """V-trace over each row's actions, observation tokens bridged (module doc); ``log_rhos`` is
    log pi - log mu per token. Returns ``(advantages, targets)`` ``[B, S]``, zero off the mask."""
    _check_unit("gamma", gamma)
    _check_unit("lambda", lam)
    for name, value in (("rho_bar", rho_bar), ("c_bar", c_bar)):
        if not float(value) > 0:
            raise ValueError(f"vtrace: {name} must be > 0, got {value!r}")
    _check("log_rhos", log_rhos, mask.shape)
    index, valid, (r, v, lr) = _packed(rewards, values, mask, log_rhos)
    rho = lr.exp()
    rho_t, c = rho.clamp(max=float(rho_bar)), float(lam) * rho.clamp(max=float(c_bar))
    v_next = _next(v)
    delta = rho_t * (r + float(gamma) * v_next - v)
    diff = torch.zeros_like(delta)  # v_k - V_k
    running = torch.zeros_like(delta[:, 0])
    for k in range(delta.shape[1] - 1, -1, -1):
        running = torch.where(valid[:, k], delta[:, k] + float(gamma) * c[:, k] * running, 0.0)
        diff[:, k] = running
    targets = v + diff
    adv = r + float(gamma) * _next(targets) - v
    return _unpack(index, valid, adv, values), _unpack(index, valid, targets, values)


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def explained_variance(values: Tensor, targets: Tensor, mask: Tensor) -> float:
    """1 - Var(target - V) / Var(target) over the masked tokens (1: the critic predicts its targets,
    0: no better than their mean, < 0: worse); nan when the targets do not vary."""
    m = mask.bool()
    y, v = targets.detach().double()[m], values.detach().double()[m]
    var = float(y.var(unbiased=False)) if y.numel() else 0.0
    return 1.0 - float((y - v).var(unbiased=False)) / var if var > 0 else float("nan")


def _need(values: Optional[Tensor], mask: Optional[Tensor], name: str) -> None:
    if values is None or mask is None:
        raise ValueError(f"advantage estimator {name!r} needs the critic's values and the loss mask "
                         f"([batch, seq]); the controller's critic executor gives them (algorithm.advantage={name} "
                         f"starts it)")


@register_advantage("gae")
def gae_advantage(rewards: Tensor, *, group_ids: Optional[Tensor] = None, group_size: Optional[int] = None,
                  values: Optional[Tensor] = None, mask: Optional[Tensor] = None, gae_gamma: float = 1.0,
                  gae_lambda: float = 1.0) -> Tensor:
    """GAE per token ``[n, seq]`` for sequence rewards ``[n]`` and critic ``values``: the critic is the
    baseline, so the prompt groups are not used."""
    _need(values, mask, "gae")
    return gae(last_action_rewards(rewards, mask), values, mask, gamma=gae_gamma, lam=gae_lambda)[0]


@register_advantage("vtrace")
def vtrace_advantage(rewards: Tensor, *, group_ids: Optional[Tensor] = None, group_size: Optional[int] = None,
                     values: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                     log_rhos: Optional[Tensor] = None, gae_gamma: float = 1.0, gae_lambda: float = 1.0,
                     vtrace_rho_bar: float = 1.0, vtrace_c_bar: float = 1.0) -> Tensor:
    """V-trace policy advantages per token ``[n, seq]`` (``log_rhos``: log pi - log mu per token)."""
    _need(values, mask, "vtrace")
    if log_rhos is None:
        raise ValueError("advantage estimator 'vtrace' needs log_rhos (log pi - log mu of each sampled token: the "
                         "current policy's logprobs against the sampler's)")
    return vtrace(last_action_rewards(rewards, mask), values, mask, log_rhos, gamma=gae_gamma, lam=gae_lambda,
                  rho_bar=vtrace_rho_bar, c_bar=vtrace_c_bar)[0]


# the per-token inputs of these estimators: not config knobs (advantages.advantage_knobs skips them)
INPUTS = ("values", "mask", "log_rhos")
