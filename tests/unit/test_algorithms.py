"""Losses, gradients and metrics of megarl.algorithms against hand-computed values.

Every expected number below is derived by hand from the formula in docs/algorithms.md (the
derivation is in the comment next to it), not by running the code under test.
"""

import math

import pytest
import torch

from megarl.algorithms import (a3po_alpha, aggregate, policy_loss)

# float64 hand values via a few exp/log ops: ~1e-15 relative error; rtol 1e-9 ample, atol 1e-12 for exact-0 grads
TOL = dict(rtol=1e-9, atol=1e-12)


def logp(*probs):
    """One row of per-token log-probabilities (float64) from probabilities."""
    return torch.tensor([probs], dtype=torch.float64).log()


def leaf(x):
    return x.clone().requires_grad_(True)


def run(name, lp, mu, adv, mask=None, **kw):
    lp = leaf(lp)
    if mask is None:
        mask = torch.ones_like(lp, dtype=torch.bool)
    adv = torch.as_tensor(adv, dtype=torch.float64)
    if adv.dim() == 1 and adv.shape[0] == lp.shape[1] and lp.shape[0] == 1:
        adv = adv.unsqueeze(0)
    loss, metrics = policy_loss(name, logprobs=lp, behav_logprobs=mu, advantages=adv, mask=mask, **kw)
    loss.backward()
    return loss.item(), lp.grad, metrics


def expect_grad(grad, values):
    torch.testing.assert_close(grad, torch.tensor([values], dtype=torch.float64), **TOL)


# ----------------------------------------------------------------------------------------- aipo

def test_aipo_values_gradient_and_metrics():
    # pi/mu = [1.2, 5, 0.5]; rho = 4 truncates the middle weight to 4 (not to 0).
    mu, pi = logp(0.5, 0.1, 0.4), logp(0.6, 0.5, 0.2)
    adv = [2.0, 1.0, -1.0]
    loss, grad, m = run("aipo", pi, mu, adv, rho=4.0)
    # loss = -(1/3) * (1.2*2*log .6 + 4*1*log .5 + 0.5*(-1)*log .2)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx(-(2.4 * math.log(0.6) + 4 * math.log(0.5) - 0.5 * math.log(0.2)) / 3, rel=1e-12)
    # d loss / d log pi_t = -w_t A_t / 3
    expect_grad(grad, [-2.4 / 3, -4 / 3, 0.5 / 3])
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["is_weight/max"] == pytest.approx(5.0)
    assert m["is_weight/min"] == pytest.approx(0.5)
    assert m["is_weight/mean"] == pytest.approx(6.7 / 3)
    assert m["ess"] == pytest.approx(6.7 ** 2 / (3 * (1.44 + 25 + 0.25)))
    assert m["mismatch"] == pytest.approx((math.log(1.2) + math.log(5) + math.log(2)) / 3)
    # k3 estimate of KL(mu || pi) on mu-samples: mean(r - 1 - log r)
    assert m["kl_mu_pi"] == pytest.approx(((0.2 - math.log(1.2)) + (4 - math.log(5)) + (-0.5 + math.log(2))) / 3)
    assert m["tokens"] == 3.0
    assert all(isinstance(v, float) for v in m.values())


def test_aipo_ratio_exactly_at_rho_is_not_clipped():
    mu, pi = logp(0.1), logp(0.4)
    rho = torch.exp(pi - mu).item()  # the very ratio the loss computes (~4)
    loss, grad, m = run("aipo", pi, mu, [1.5], rho=rho)
    assert m["clip_frac"] == 0.0
    expect_grad(grad, [-rho * 1.5])
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx(-rho * 1.5 * math.log(0.4), rel=1e-12)


def test_on_policy_aipo_is_reinforce_with_baseline_and_ppo_never_clips():
    g = torch.Generator().manual_seed(0)
    lp = torch.rand(4, 7, generator=g, dtype=torch.float64).clamp(min=0.05).log()
    rewards = torch.rand(4, 1, generator=g, dtype=torch.float64)
    adv = (rewards - rewards.mean()).expand(4, 7)  # reward minus a baseline
    mask = torch.rand(4, 7, generator=g) > 0.3
    n = mask.sum().item()
    # REINFORCE with baseline: L = -(1/N) sum_t A_t log pi_t, grad = -A_t / N on completion tokens.
    ref_loss = -(adv * lp * mask).sum().item() / n
    ref_grad = -adv * mask / n
    for name in ("aipo", "ppo", "grpo", "vaco"):
        x = leaf(lp)
        loss, metrics = policy_loss(name, logprobs=x, behav_logprobs=lp, advantages=adv, mask=mask)
        loss.backward()
        torch.testing.assert_close(x.grad, ref_grad, **TOL)
        assert metrics["clip_frac"] == 0.0
        assert metrics["ess"] == pytest.approx(1.0) and metrics["kl_mu_pi"] == 0.0 and metrics["mismatch"] == 0.0
        if name == "aipo":
            # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
            assert loss.item() == pytest.approx(ref_loss, rel=1e-12)


# ------------------------------------------------------------------------------------------ ppo

PPO_MU, PPO_PI = logp(0.4, 0.5, 0.2, 0.1, 0.5), logp(0.6, 0.55, 0.1, 0.4, 0.3)  # r = 1.5, 1.1, .5, 4, .6
PPO_ADV = [1.0, 2.0, -1.0, -1.0, 1.0]


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_ppo_asymmetric_clip(name):
    loss, grad, m = run(name, PPO_PI, PPO_MU, PPO_ADV, eps_low=0.2, eps_high=0.28)
    # per token: A>0,r=1.5>1.28 -> -1.28 (clipped); -2*1.1; A<0,r=.5<.8 -> +0.8 (clipped);
    # A<0,r=4 -> +4 (unclipped: pessimistic side); A>0,r=.6 -> -0.6 (unclipped)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-1.28 - 2.2 + 0.8 + 4.0 - 0.6) / 5, rel=1e-12)
    expect_grad(grad, [0.0, -2.2 / 5, 0.0, 4.0 / 5, -0.6 / 5])
    assert m["clip_frac"] == pytest.approx(2 / 5)


def test_ppo_dual_clip():
    loss, grad, m = run("ppo", PPO_PI, PPO_MU, PPO_ADV, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    # the A<0, r=4 token is capped at -A*c = 3 with zero gradient
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-1.28 - 2.2 + 0.8 + 3.0 - 0.6) / 5, rel=1e-12)
    expect_grad(grad, [0.0, -2.2 / 5, 0.0, 0.0, -0.6 / 5])
    assert m["clip_frac"] == pytest.approx(3 / 5)
    assert m["ppo/dual_clip_frac"] == pytest.approx(1 / 5)


def test_ppo_ratio_exactly_at_the_clip_keeps_full_gradient():
    mu, pi = logp(0.5, 0.5), logp(0.6, 0.4)
    r = torch.exp(pi - mu)[0]
    eps_high, eps_low = r[0].item() - 1.0, 1.0 - r[1].item()  # 1+eps_high == r0 and 1-eps_low == r1 exactly
    loss, grad, m = run("ppo", pi, mu, [1.0, -1.0], eps_low=eps_low, eps_high=eps_high)
    assert m["clip_frac"] == 0.0
    expect_grad(grad, [-r[0].item() / 2, r[1].item() / 2])
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-r[0].item() + r[1].item()) / 2, rel=1e-12)


# ---------------------------------------------------------------------- decoupled_ppo and a3po

def test_decoupled_ppo():
    mu, prox, pi = logp(0.2, 0.5), logp(0.4, 0.25), logp(0.5, 0.275)
    # token 0: w_b = prox/mu = 2, r = pi/prox = 1.25 > 1.2 with A=1 -> clipped: 2 * -1.2, grad 0
    # token 1: w_b = 0.5, r = 1.1, A=-2 -> unclipped: 0.5 * 2 * 1.1 = 1.1, grad 0.5 * 2 * 1.1
    loss, grad, m = run("decoupled_ppo", pi, mu, [1.0, -2.0], prox_logprobs=prox)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-2.4 + 1.1) / 2, rel=1e-12)
    expect_grad(grad, [0.0, 1.1 / 2])
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["decoupled_ppo/behav_weight_mean"] == pytest.approx(1.25)
    # behaviour weight truncated at 1.5: token 0 becomes 1.5 * -1.2
    loss, _, m = run("decoupled_ppo", pi, mu, [1.0, -2.0], prox_logprobs=prox, behav_weight_cap=1.5)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-1.8 + 1.1) / 2, rel=1e-12)
    assert m["decoupled_ppo/behav_weight_trunc_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="prox_logprobs"):
        run("decoupled_ppo", pi, mu, [1.0, -2.0])


def test_a3po_alpha_is_the_papers_weight_of_the_sampler():
    # arXiv 2512.06547 section 3: log prox = alpha log mu + (1 - alpha) log pi; prox = mu when fresh
    # (alpha 1), and alpha falls as the staleness d grows: v_prox = v_theta - 1 gives alpha = 1/d
    torch.testing.assert_close(a3po_alpha(torch.tensor([0, 1, 2, 4, 10])),
                               torch.tensor([1.0, 1.0, 0.5, 0.25, 0.1]))


@pytest.mark.parametrize("staleness", [0, 1])
def test_a3po_on_fresh_data_equals_ppo(staleness):
    g = torch.Generator().manual_seed(1)
    mu = torch.rand(3, 5, generator=g, dtype=torch.float64).clamp(min=0.05).log()
    pi = mu + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5)
    versions = torch.full((3,), 7 - staleness)
    results = []
    for name, kw in (("a3po", dict(versions=versions, current_version=7)), ("ppo", {})):
        x = leaf(pi)
        loss, m = policy_loss(name, logprobs=x, behav_logprobs=mu, advantages=adv,
                              mask=torch.ones(3, 5), eps_low=0.2, eps_high=0.3, **kw)
        loss.backward()
        results.append((loss.item(), x.grad, m["clip_frac"]))
    # same float64 math two ways: rounding differences only (~1e-15)
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], **TOL)
    assert results[0][2] == results[1][2] > 0


def test_a3po_stale_tokens_hand_values():
    # log prox = alpha log mu + (1 - alpha) log pi, alpha = 1/d (the paper's weight of the sampler)
    # token 0, staleness 2: alpha = 1/2, prox = sqrt(.2 * .8) = .4 -> w_b = 2, r = 2 > 1.2 with A=1:
    #   clipped, 2 * -1.2, grad 0.
    # token 1, staleness 4: alpha = 1/4, pi/mu = 16 -> prox/mu = 16^.75 = 8, r = 16^.25 = 2, A=-1:
    #   unclipped, 8 * 2 = 16, grad 8 * 2 = 16.
    mu, pi = logp(0.2, 0.05), logp(0.8, 0.8)
    versions = torch.tensor([[8, 6]])
    loss, grad, m = run("a3po", pi, mu, [1.0, -1.0], versions=versions, current_version=10)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-2.4 + 16.0) / 2, rel=1e-12)
    expect_grad(grad, [0.0, 8.0])
    assert m["a3po/alpha_mean"] == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert m["stale_frac/d2"] == 0.5 and m["stale_frac/d4"] == 0.5 and m["stale_frac/d0"] == 0.0
    # equals decoupled PPO with that prox supplied: .4 and .05 * 8 = .4
    prox = logp(0.4, 0.4)
    loss2, grad2, _ = run("decoupled_ppo", pi, mu, [1.0, -1.0], prox_logprobs=prox)
    assert loss2 == pytest.approx(loss, rel=1e-12)  # same float64 math two ways: rounding differences only (~1e-15)
    torch.testing.assert_close(grad2, grad, **TOL)
    # with dual clip c = 1.5 the A<0 token is capped at 8 * 1.5 with zero gradient
    loss, grad, _ = run("a3po", pi, mu, [1.0, -1.0], versions=versions, current_version=10, dual_clip_c=1.5)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-2.4 + 12.0) / 2, rel=1e-12)
    expect_grad(grad, [0.0, 0.0])


def test_a3po_input_errors():
    mu, pi = logp(0.2, 0.05), logp(0.8, 0.8)
    with pytest.raises(ValueError, match="versions"):
        run("a3po", pi, mu, [1.0, -1.0])
    with pytest.raises(ValueError, match="newer than current_version"):
        run("a3po", pi, mu, [1.0, -1.0], versions=torch.tensor([[3, 5]]), current_version=4)
    with pytest.raises(ValueError, match="decoupled_ppo"):
        run("a3po", pi, mu, [1.0, -1.0], versions=torch.tensor([[3, 4]]), current_version=4, prox_logprobs=mu)


# ----------------------------------------------------------------------------------------- vaco

VACO_MU, VACO_PI = logp(0.4, 0.2, 0.3, 0.5), logp(0.6, 0.1, 0.3, 0.4)  # r = 1.5, .5, 1, .8
VACO_ADV = [1.0, 1.0, -1.0, -1.0]


def test_vaco_tv_above_threshold_filters_tokens_that_increase_tv():
    # TV = 0.5 * mean|r - 1| = 0.5 * (0.5 + 0.5 + 0 + 0.2) / 4 = 0.15 > delta/2 = 0.1.
    # A*(r-1) > 0 on tokens 0 (1 * .5) and 3 (-1 * -.2): dropped. Kept: -1*.5 and -(-1)*1.
    loss, grad, m = run("vaco", VACO_PI, VACO_MU, VACO_ADV, tv_delta=0.2)
    assert m["vaco/tv"] == pytest.approx(0.15)
    assert m["vaco/filter_active"] == 1.0
    assert m["vaco/filter_frac"] == m["clip_frac"] == pytest.approx(0.5)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-0.5 + 1.0) / 4, rel=1e-12)
    expect_grad(grad, [0.0, -0.5 / 4, 1.0 / 4, 0.0])


def test_vaco_tv_below_threshold_keeps_every_token():
    # delta/2 = 0.2 > TV = 0.15: the plain IS surrogate -A r on all tokens.
    loss, grad, m = run("vaco", VACO_PI, VACO_MU, VACO_ADV, tv_delta=0.4)
    assert m["vaco/filter_active"] == 0.0 and m["clip_frac"] == 0.0
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-1.5 - 0.5 + 1.0 + 0.8) / 4, rel=1e-12)
    expect_grad(grad, [-1.5 / 4, -0.5 / 4, 1.0 / 4, 0.8 / 4])


def test_vaco_decides_on_the_minibatch_statistic_it_is_given():
    # The same 4 tokens as above (their own TV 0.15 > 0.1 would filter) inside a minibatch whose other
    # tokens sit at r = 1: |r - 1| sums to 1.2 over 16 tokens -> TV = 0.5 * 1.2 / 16 = 0.0375 < 0.1.
    from megarl.algorithms.policy_loss import loss_batch_sums

    mask = torch.ones(1, 4, dtype=torch.bool)
    own = loss_batch_sums("vaco", logprobs=VACO_PI, behav_logprobs=VACO_MU, mask=mask)
    assert own == pytest.approx({"vaco/abs_dev": 1.2, "vaco/tokens": 4.0})
    rest = loss_batch_sums("vaco", logprobs=VACO_MU.repeat(1, 3), behav_logprobs=VACO_MU.repeat(1, 3),
                           mask=torch.ones(1, 12, dtype=torch.bool))
    stats = {k: own[k] + rest[k] for k in own}  # what the trainer sums over micro-batches and DP ranks
    loss, grad, m = run("vaco", VACO_PI, VACO_MU, VACO_ADV, tv_delta=0.2, batch_stats=stats)
    assert m["vaco/tv"] == pytest.approx(0.0375) and m["vaco/filter_active"] == 0.0
    expect_grad(grad, [-1.5 / 4, -0.5 / 4, 1.0 / 4, 0.8 / 4])  # every token kept, as below the threshold
    assert loss_batch_sums("ppo", logprobs=VACO_PI, behav_logprobs=VACO_MU, mask=mask) is None


# ------------------------------------------------------------------------------------------ sao

def test_sao_stops_tokens_outside_the_band_whatever_the_advantage():
    # r = pi/mu = 1.5, .5, 1, .8 (as vaco's); band [0.8, 1.2]. Out: tokens 0 (r 1.5) and 1 (r .5):
    # token 0 has A = +1 (PPO would also stop it), token 1 has A = +1 with r < 1 (PPO keeps it:
    # the update moves it back towards the band; SAO stops it anyway). Token 3 sits on the edge 0.8:
    # kept. Loss = mean(-A r) with the out-of-band values kept: (-1.5 - .5 + 1 + .8) / 4.
    loss, grad, m = run("sao", VACO_PI, VACO_MU, [1.0, 1.0, -1.0, -1.0], eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx((-1.5 - 0.5 + 1.0 + 0.8) / 4, rel=1e-12)  # float64: ~1e-15 rounding
    expect_grad(grad, [0.0, 0.0, 1.0 / 4, 0.8 / 4])  # d(-A r)/d log pi = -A r on the kept tokens
    assert m["clip_frac"] == m["sao/out_of_band_frac"] == pytest.approx(0.5)
    # PPO on the same tokens keeps token 1's gradient (-A r = -0.5 / 4): the difference SAO makes
    _, ppo_grad, _ = run("ppo", VACO_PI, VACO_MU, [1.0, 1.0, -1.0, -1.0], eps_low=0.2, eps_high=0.2)
    assert float(ppo_grad[0, 1]) == pytest.approx(-0.5 / 4)
    with pytest.raises(ValueError, match="eps_low"):
        run("sao", VACO_PI, VACO_MU, VACO_ADV, eps_low=1.0)


@pytest.mark.parametrize("name,adv,kw,value,grad1", [
    # token 0: log pi - log mu = 89 > 88.72 = log(float32 max): pi/mu is inf. It is clipped (A > 0),
    # dual-clipped (A < 0, c = 3) or dropped (vaco: TV is inf, A (r - 1) > 0): a constant with gradient 0.
    # token 1: pi = mu, r = 1, gradient -A r / 2 tokens.
    ("ppo", 1.0, {}, (-1.2 - 1.0) / 2, -0.5),
    ("ppo", -1.0, {"dual_clip_c": 3.0}, (3.0 + 1.0) / 2, 0.5),
    ("vaco", 1.0, {"tv_delta": 0.2}, (0.0 - 1.0) / 2, -0.5),
])
def test_a_ratio_that_overflows_in_a_constant_token_leaves_the_gradient_finite(name, adv, kw, value, grad1):
    lp = torch.tensor([[-0.5, -1.0]], dtype=torch.float32, requires_grad=True)
    mu = torch.tensor([[-89.5, -1.0]], dtype=torch.float32)
    loss, _ = policy_loss(name, logprobs=lp, behav_logprobs=mu, advantages=torch.tensor([[adv, adv]]),
                          mask=torch.ones(1, 2, dtype=torch.bool), **kw)
    loss.backward()
    # float32, a couple of ops on O(1) values: ~1e-7 relative; 1e-6 leaves room
    assert loss.item() == pytest.approx(value, rel=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, grad1]]), rtol=1e-6, atol=0.0)


def test_a3po_prox_error_against_a_recomputed_prox():
    # staleness 2 and 4 as in test_a3po_stale_tokens_hand_values: approximated log prox = alpha log mu +
    # (1 - alpha) log pi = log .4 and log(.05 * 16^.75) = log .4. Against a recomputed prox of
    # .5 and .2: |log .4 - log .5| and |log .4 - log .2| = log 1.25 and log 2, mean over 2 tokens.
    mu, pi = logp(0.2, 0.05), logp(0.8, 0.8)
    versions = torch.tensor([[8, 6]])
    _, _, m = run("a3po", pi, mu, [1.0, -1.0], versions=versions, current_version=10,
                  prox_reference=logp(0.5, 0.2))
    assert m["prox_error"] == pytest.approx((math.log(1.25) + math.log(2)) / 2, rel=1e-9)
    # decoupled_ppo's anchor is the prox it is given: no error against itself
    _, _, m = run("decoupled_ppo", pi, mu, [1.0, -1.0], prox_logprobs=logp(0.5, 0.2), prox_reference=logp(0.5, 0.2))
    assert m["prox_error"] == 0.0
    with pytest.raises(ValueError, match="no proximal anchor"):
        run("ppo", pi, mu, [1.0, -1.0], prox_reference=mu)


def test_a_step_reduces_its_updates_token_weighted():
    from megarl.trainer.train_step import reduce_updates

    u1 = {"loss": 1.0, "tokens": 10.0, "loss/clip_frac": 0.0, "grad_norm": 2.0, "lr": 1e-3, "skipped": 0.0,
          "skipped_steps": 0.0, "update_successful": True, "micro_batches": 2}
    u2 = {**u1, "loss": 4.0, "tokens": 30.0, "loss/clip_frac": 0.5, "grad_norm": 4.0, "lr": 5e-4}
    m = reduce_updates([u1, u2, u1, u2], per_pass=2)  # 2 epochs of 2 minibatches
    assert m["loss"] == pytest.approx((1 * 10 + 4 * 30) / 40)  # each update weighted by its loss tokens
    assert m["loss/clip_frac"] == pytest.approx(0.5 * 30 / 40)
    assert m["tokens"] == 40.0  # one pass over the batch
    assert m["grad_norm"] == 3.0 and m["grad_norm_max"] == 4.0 and m["lr"] == 5e-4
    assert m["updates"] == 4.0 and m["micro_batches"] == 8 and m["update_successful"] is True
    assert reduce_updates([{**u1, "skipped": 1.0, "update_successful": False}, u2], per_pass=2)["skipped"] == 1.0


# ------------------------------------------------------------------------------ shared edge cases

def _all_losses_kwargs():
    versions = torch.tensor([5, 3])
    return {"aipo": {}, "ppo": {}, "grpo": {}, "vaco": {"tv_delta": 0.01}, "sao": {},
            "decoupled_ppo": {"prox_logprobs": None}, "a3po": {"versions": versions, "current_version": 5}}


@pytest.mark.parametrize("name", sorted(_all_losses_kwargs()))
def test_zero_advantages_give_zero_loss_and_gradient(name):
    g = torch.Generator().manual_seed(2)
    mu = torch.rand(2, 4, generator=g, dtype=torch.float64).clamp(min=0.05).log()
    pi = mu + torch.randn(2, 4, generator=g, dtype=torch.float64)
    kw = dict(_all_losses_kwargs()[name])
    if "prox_logprobs" in kw:
        kw["prox_logprobs"] = (mu + pi) / 2
    x = leaf(pi)
    loss, _ = policy_loss(name, logprobs=x, behav_logprobs=mu, advantages=torch.zeros(2), mask=torch.ones(2, 4), **kw)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(pi))


@pytest.mark.parametrize("name", sorted(_all_losses_kwargs()))
def test_all_masked_row_is_ignored_even_with_garbage(name):
    g = torch.Generator().manual_seed(3)
    mu = torch.rand(2, 4, generator=g, dtype=torch.float64).clamp(min=0.05).log()
    pi = mu + 0.3 * torch.randn(2, 4, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    kw = dict(_all_losses_kwargs()[name])
    if "prox_logprobs" in kw:
        kw["prox_logprobs"] = (mu + pi) / 2
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    garbage_pi, garbage_mu = pi.clone(), mu.clone()
    garbage_pi[1], garbage_mu[1] = -torch.inf, torch.nan
    garbage_pi[0, 3], garbage_mu[0, 3] = torch.nan, -torch.inf
    x = leaf(garbage_pi)
    loss, m = policy_loss(name, logprobs=x, behav_logprobs=garbage_mu, advantages=adv, mask=mask, **kw)
    loss.backward()
    # the same loss on row 0's three tokens alone
    kw0 = {k: (v[:1, :3] if k == "prox_logprobs" else v[:1] if k == "versions" else v) for k, v in kw.items()}
    y = leaf(pi[:1, :3])
    loss0, m0 = policy_loss(name, logprobs=y, behav_logprobs=mu[:1, :3], advantages=adv[:1],
                            mask=torch.ones(1, 3), **kw0)
    loss0.backward()
    # same float64 math two ways: rounding differences only (~1e-15)
    assert loss.item() == pytest.approx(loss0.item(), rel=1e-12)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad[:1, :3], y.grad, **TOL)
    assert torch.equal(x.grad[1], torch.zeros(4, dtype=torch.float64)) and x.grad[0, 3] == 0
    for key in ("clip_frac", "is_weight/max", "ess", "kl_mu_pi", "mismatch"):
        # float64 means of the same few tokens (masked zeros added): rounding only; abs for metrics that are 0
        assert m[key] == pytest.approx(m0[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("name", ["aipo", "ppo", "vaco"])
def test_fully_masked_batch_gives_zero_loss_and_metrics(name):
    x = leaf(logp(0.5, 0.2))
    loss, m = policy_loss(name, logprobs=x, behav_logprobs=logp(0.1, 0.9), advantages=torch.ones(1),
                          mask=torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    assert all(v == 0.0 for v in m.values()), m


# --------------------------------------------------------------------------------- aggregation

def test_aggregation_modes():
    per = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(per, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    # the empty third row is not a sequence
    assert aggregate(per, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(per, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per, mask, "token-mean", denominator=8).item() == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="known: token-mean"):
        aggregate(per, mask, "mean")


def test_aggregation_through_policy_loss():
    # on-policy aipo: per-token loss -A log pi; row 0: A=1 over 2 tokens, row 1: A=2 over 1 token
    lp = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, 2.0], dtype=torch.float64)
    l2, l4 = math.log(2), math.log(4)
    for mode, expected in (("token-mean", (l2 + l4 + 2 * l2) / 3), ("seq-mean-token-sum", ((l2 + l4) + 2 * l2) / 2),
                           ("seq-mean-token-mean", ((l2 + l4) / 2 + 2 * l2) / 2)):
        loss, _ = policy_loss("aipo", logprobs=lp, behav_logprobs=lp, advantages=adv, mask=mask, aggregation=mode)
        # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
        assert loss.item() == pytest.approx(expected, rel=1e-12), mode
