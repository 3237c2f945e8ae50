"""GAE and V-trace (megarl/algorithms/value_targets.py) against hand values and an independent numpy
reference written from the papers' sum forms (GAE: A_s = sum_t (gamma lambda)^(t-s) delta_t;
IMPALA eq. 1: v_s = V_s + sum_t gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t), observation tokens
bridged as SAO does. Pure math: no stack."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megarl.algorithms import AlgorithmConfig, advantage_params, compute_advantages
from megarl.algorithms.value_targets import explained_variance, gae, last_action_rewards, vtrace

# float64 throughout: the two implementations differ only by summation order, ~1e-15 relative on
# values of order 1; 1e-12 leaves three decades of room and still catches any wrong term.
TOL = 1e-12

# one row: prompt (0, 1), action (2), action (3), observation (4), action (5), padding (6)
MASK = torch.tensor([[0, 0, 1, 1, 0, 1, 0]], dtype=torch.bool)
# V before each token; 9.0 on the observation and -7.0 on the padding: a recursion that stepped
# through them instead of bridging would use them
VALUES = torch.tensor([[3.0, 3.0, 0.5, 0.25, 9.0, 1.0, -7.0]], dtype=torch.float64)
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)


def test_gae_hand_values_bridge_the_observation():
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=0.5, lam=0.5)
    # delta_5 = 1 + 0 - 1 = 0;  delta_3 = 0 + 0.5*1.0 - 0.25 = 0.25;  delta_2 = 0.5*0.25 - 0.5 = -0.375
    # A_5 = 0;  A_3 = 0.25 + 0.25*0 = 0.25;  A_2 = -0.375 + 0.25*0.25 = -0.3125
    assert adv.tolist() == [[0, 0, -0.3125, 0.25, 0, 0, 0]]
    assert ret.tolist() == [[0, 0, 0.1875, 0.5, 0, 1.0, 0]]


def test_vtrace_hand_values():
    log_rhos = torch.tensor([[0, 0, math.log(2), math.log(0.5), 0, math.log(0.5), 0]], dtype=torch.float64)
    adv, tgt = vtrace(REWARDS, VALUES, MASK, log_rhos, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0)
    # rho = 2, 0.5, 0.5 -> truncated rho = c = 1, 0.5, 0.5
    # k=5: 0.5*(1 - 1) = 0 -> v5 = 1;  k=3: 0.5*(1 - 0.25) = 0.375 -> v3 = 0.625
    # k=2: 1*(0.25 - 0.5) + 1*1*0.375 = 0.125 -> v2 = 0.625
    # advantages r + v_next - V: 0.625 - 0.5, 1 - 0.25, 1 - 1
    assert torch.allclose(tgt, torch.tensor([[0, 0, 0.625, 0.625, 0, 1.0, 0]], dtype=torch.float64), atol=TOL)
    assert torch.allclose(adv, torch.tensor([[0, 0, 0.125, 0.75, 0, 0.0, 0]], dtype=torch.float64), atol=TOL)


def _np_reference(rewards, values, mask, log_rhos, gamma, lam, rho_bar, c_bar):
    """Sum forms over each row's action list, plain loops (no recursion shared with the module)."""
    rewards, values, mask, log_rhos = (np.asarray(x, dtype=np.float64) for x in (rewards, values, mask, log_rhos))
    shape = mask.shape
    gae_adv, gae_ret, vt_adv, vt_tgt = (np.zeros(shape) for _ in range(4))
    for b in range(shape[0]):
        acts = [t for t in range(shape[1]) if mask[b, t]]
        V = [values[b, t] for t in acts] + [0.0]
        r = [rewards[b, t] for t in acts]
        rho = [math.exp(log_rhos[b, t]) for t in acts]
        K = len(acts)
        delta = [r[k] + gamma * V[k + 1] - V[k] for k in range(K)]
        v = []
        for s in range(K):
            a = sum((gamma * lam) ** (t - s) * delta[t] for t in range(s, K))
            gae_adv[b, acts[s]], gae_ret[b, acts[s]] = a, a + V[s]
            total = 0.0
            for t in range(s, K):
                cs = np.prod([lam * min(c_bar, rho[i]) for i in range(s, t)]) if t > s else 1.0
                total += gamma ** (t - s) * cs * min(rho_bar, rho[t]) * delta[t]
            v.append(V[s] + total)
        v.append(0.0)
        for s in range(K):
            vt_tgt[b, acts[s]] = v[s]
            vt_adv[b, acts[s]] = r[s] + gamma * v[s + 1] - V[s]
    return gae_adv, gae_ret, vt_adv, vt_tgt


@pytest.mark.parametrize("gamma,lam,rho_bar,c_bar", [(1.0, 1.0, 1.0, 1.0), (0.9, 0.7, 1.5, 0.8),
                                                     (0.5, 0.0, 0.5, 2.0)])
def test_random_multiturn_batches_match_the_numpy_reference(gamma, lam, rho_bar, c_bar):
    g = torch.Generator().manual_seed(7)
    b, s = 6, 23
    mask = torch.rand(b, s, generator=g) < 0.6
    mask[:, :3] = False                      # prompt
    mask[1] = False                          # a row without actions
    mask[2, 10:] = False                     # a short row (padding)
    values = torch.randn(b, s, generator=g, dtype=torch.float64)
    rewards = torch.where(mask, torch.randn(b, s, generator=g, dtype=torch.float64), 0.0)
    log_rhos = 0.5 * torch.randn(b, s, generator=g, dtype=torch.float64)
    ref = _np_reference(rewards, values, mask, log_rhos, gamma, lam, rho_bar, c_bar)
    got = (*gae(rewards, values, mask, gamma=gamma, lam=lam),
           *vtrace(rewards, values, mask, log_rhos, gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar))
    assert float(np.abs(ref[0]).sum()) > 1.0  # the reference is not trivially 0
    for name, r, x in zip(("gae adv", "gae returns", "vtrace adv", "vtrace targets"), ref, got):
        assert np.allclose(x.numpy(), r, atol=TOL, rtol=0), name
        assert not x[~mask].any(), name


def test_on_policy_vtrace_is_gae():
    """pi = mu (log rho = 0) with rho_bar, c_bar >= 1: V-trace's targets are GAE's returns (IMPALA
    remark 1), and with lambda = 1 its advantages GAE's too."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(4, 17, generator=g) < 0.7
    mask[:, 0] = False
    values = torch.randn(4, 17, generator=g, dtype=torch.float64)
    rewards = last_action_rewards(torch.tensor([1.0, -1.0, 0.5, 2.0]), mask)
    zeros = torch.zeros_like(values)
    for lam in (1.0, 0.6):
        adv, ret = gae(rewards, values, mask, gamma=0.95, lam=lam)
        vadv, tgt = vtrace(rewards, values, mask, zeros, gamma=0.95, lam=lam, rho_bar=1.0, c_bar=1.0)
        assert torch.allclose(tgt, ret, atol=TOL)
    assert not torch.allclose(vadv, adv, atol=TOL)  # lambda 0.6: r + gamma v_next - V is not GAE's advantage
    vadv, _ = vtrace(rewards, values, mask, zeros, gamma=0.95, lam=1.0)
    assert torch.allclose(vadv, gae(rewards, values, mask, gamma=0.95, lam=1.0)[0], atol=TOL)


def test_last_action_rewards_and_refusals():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert last_action_rewards(torch.tensor([2.0, 3.0, 4.0]), mask).tolist() == [[0, 0, 2, 0], [0, 0, 0, 3],
                                                                                 [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="outside the mask"):
        gae(torch.tensor([[1.0, 0, 0, 0]] * 3), torch.zeros(3, 4), mask, gamma=1, lam=1)
    with pytest.raises(ValueError, match="values must be"):
        gae(torch.zeros(3, 4), torch.zeros(3, 5), mask, gamma=1, lam=1)
    with pytest.raises(ValueError, match="gamma must be in"):
        gae(torch.zeros(3, 4), torch.zeros(3, 4), mask, gamma=1.5, lam=1)
    with pytest.raises(ValueError, match="rho_bar must be > 0"):
        vtrace(torch.zeros(3, 4), torch.zeros(3, 4), mask, torch.zeros(3, 4), gamma=1, rho_bar=0)


def test_registered_estimators_take_the_config_knobs():
    cfg = AlgorithmConfig(advantage="gae", gae_gamma=0.5, gae_lambda=0.5)
    adv = compute_advantages("gae", torch.tensor([1.0]), values=VALUES, mask=MASK, **advantage_params(cfg))
    assert adv.tolist() == [[0, 0, -0.3125, 0.25, 0, 0, 0]]
    cfg = AlgorithmConfig(advantage="vtrace")
    log_rhos = torch.tensor([[0, 0, math.log(2), math.log(0.5), 0, math.log(0.5), 0]], dtype=torch.float64)
    adv = compute_advantages("vtrace", torch.tensor([1.0]), values=VALUES, mask=MASK, log_rhos=log_rhos,
                             **advantage_params(cfg))
    assert torch.allclose(adv, torch.tensor([[0, 0, 0.125, 0.75, 0, 0.0, 0]], dtype=torch.float64), atol=TOL)
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages("gae", torch.tensor([1.0]), **advantage_params(AlgorithmConfig(advantage="gae")))
    with pytest.raises(ValueError, match="needs log_rhos"):
        compute_advantages("vtrace", torch.tensor([1.0]), values=VALUES, mask=MASK)
    for key, bad in (("gae_gamma", 1.5), ("gae_lambda", -0.1), ("vtrace_rho_bar", 0.0), ("vtrace_c_bar", -1.0)):
        with pytest.raises(ValueError, match=f"algorithm.{key}={bad!r} is out of range"):
            AlgorithmConfig(**{key: bad})


def test_explained_variance_hand_value():
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    targets = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    # residuals 0.5, -0.5, 0.5, -0.5: var 0.25; var(targets over the mask) = 1.25 -> 1 - 0.2
    values = targets - torch.tensor([[0.5, -0.5, 0.5, -0.5, 50.0]])
    assert explained_variance(values, targets, mask) == pytest.approx(0.8, abs=1e-12)
    assert math.isnan(explained_variance(values, torch.ones(1, 5), mask))


@pytest.mark.parametrize("name", ["gae", "vtrace"])
def test_config_takes_a_critic_estimator_with_the_critic_section(name):
    """gae/vtrace validate now that a critic executor runs (tests/e2e/test_critic_executor.py); the critic's knobs are
    checked with them, naming the key."""
    from megarl.config import ConfigError, load_config

    assert load_config("configs/tiny_test.yaml", [f"algorithm.advantage={name}"]).algorithm.advantage == name
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny_test.yaml", [f"algorithm.advantage={name}", "critic.value_clip=-1"])
    assert info.value.problems == ["critic.value_clip=-1.0: must be >= 0 (reward units; 0 = no clip)"]

