"""Options shared by every loss (TIS, score centering, KL, entropy), advantages, registry, config.

Expected numbers are derived by hand in the comments next to them.
"""

import dataclasses
import math

import pytest
import torch

from megarl.algorithms import (AlgorithmConfig, advantage_params, compute_advantages, expand_to_tokens,
                               get_advantage, get_loss, known_advantages, known_losses, loss_params,
                               policy_loss, register_loss, to_floats)
from megarl.algorithms.config import ADVANTAGE_NAMES, LOSS_NAMES

# float64 hand values via a few exp/log ops: ~1e-15 relative error; rtol 1e-9 ample, atol 1e-12 for exact-0 grads
TOL = dict(rtol=1e-9, atol=1e-12)


def logp(*probs):
    return torch.tensor([probs], dtype=torch.float64).log()


def run(name, lp, mu, adv, **kw):
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(name, logprobs=x, behav_logprobs=mu, advantages=torch.tensor([adv], dtype=torch.float64),
                                mask=torch.ones_like(lp), **kw)
    loss.backward()
    return loss.item(), x.grad, metrics


# ----------------------------------------------------------------------------------------- TIS

def test_tis_token_level():
    # token 0: mismatch w = prox/mu = .5/.2 = 2.5 -> cap 2; aipo ratio vs prox = .5/.5 = 1, A=1:
    #   -2 * 1 * 1 * log .5
    # token 1: w = .4/.5 = .8; ratio vs prox = .6/.4 = 1.5, A=-1: -.8 * 1.5 * -1 * log .6
    mu, prox, pi = logp(0.2, 0.5), logp(0.5, 0.4), logp(0.5, 0.6)
    loss, grad, m = run("aipo", pi, mu, [1.0, -1.0], prox_logprobs=prox, tis="token", tis_cap=2.0)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-2 * math.log(0.5) + 1.2 * math.log(0.6)) / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-2.0 / 2, 1.2 / 2]], dtype=torch.float64), **TOL)
    assert m["tis/clip_frac"] == pytest.approx(0.5)
    assert m["tis/weight_mean"] == pytest.approx((2 + 0.8) / 2)


def test_tis_sequence_level():
    # sequence weight = 2.5 * .8 = 2 -> cap 1.5 on both tokens
    mu, prox, pi = logp(0.2, 0.5), logp(0.5, 0.4), logp(0.5, 0.6)
    loss, grad, m = run("aipo", pi, mu, [1.0, -1.0], prox_logprobs=prox, tis="sequence", tis_cap=1.5)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx((-1.5 * math.log(0.5) + 1.5 * 1.5 * math.log(0.6)) / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-1.5 / 2, 1.5 * 1.5 / 2]], dtype=torch.float64), **TOL)
    assert m["tis/clip_frac"] == 1.0


def test_tis_with_ppo_clips_against_prox():
    # w = 2.5 -> 2; r = pi/prox = .65/.5 = 1.3 > 1.2 with A=1: clipped, 2 * -1.2, no gradient
    mu, prox, pi = logp(0.2), logp(0.5), logp(0.65)
    loss, grad, m = run("ppo", pi, mu, [1.0], prox_logprobs=prox, tis="token", tis_cap=2.0)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx(-2.4, rel=1e-12) and grad.item() == 0.0 and m["clip_frac"] == 1.0


def test_tis_errors():
    mu, pi = logp(0.2), logp(0.5)
    with pytest.raises(ValueError, match="needs prox_logprobs"):
        run("aipo", pi, mu, [1.0], tis="token")
    with pytest.raises(ValueError, match="already corrects"):
        run("decoupled_ppo", pi, mu, [1.0], tis="token", prox_logprobs=mu)
    with pytest.raises(ValueError, match="known: none, token, sequence"):
        run("aipo", pi, mu, [1.0], tis="seq")


# ---------------------------------------------------------------------------- score centering

def _centering_case(mu_full_probs):
    # one token, vocab 3, pi = [.5, .3, .2] from logits z = log pi, sampled y = 0
    z = torch.tensor([[[0.5, 0.3, 0.2]]], dtype=torch.float64).log().requires_grad_(True)
    full = torch.log_softmax(z, -1)
    mu_full = torch.tensor([[mu_full_probs]], dtype=torch.float64).log()
    return z, full, mu_full


def test_score_centering_exact_with_full_vocab():
    z, full, mu_full = _centering_case([0.2, 0.5, 0.3])
    loss, m = policy_loss("aipo", logprobs=full[..., 0], behav_logprobs=mu_full[..., 0], advantages=torch.ones(1),
                          mask=torch.ones(1, 1), score_centering=True, full_logprobs=full,
                          behav_full_logprobs=mu_full)
    loss.backward()
    # w = .5/.2 = 2.5; value unchanged: -2.5 log .5; grad_z = -w A (e_y - mu) = -2.5 [.8, -.5, -.3]
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss.item() == pytest.approx(-2.5 * math.log(0.5), rel=1e-12)
    torch.testing.assert_close(z.grad, torch.tensor([[[-2.0, 1.25, 0.75]]], dtype=torch.float64), **TOL)


def test_score_centering_token_approximation():
    # approx: grad log pi(y) scaled by (1 - mu_y)/(1 - pi_y) = .8/.5 = 1.6; w = 2.5:
    # grad_z = -2.5 * 1.6 * (e_0 - pi) = -4 [.5, -.3, -.2]; this equals the exact centering for the
    # sampler distribution that is pi tilted at y: [.2, .3*.8/.5, .2*.8/.5] = [.2, .48, .32]
    z, full, _ = _centering_case([0.2, 0.48, 0.32])
    loss, m = policy_loss("aipo", logprobs=full[..., 0], behav_logprobs=torch.tensor([[math.log(0.2)]], dtype=torch.float64),
                          advantages=torch.ones(1), mask=torch.ones(1, 1), score_centering=True)
    loss.backward()
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss.item() == pytest.approx(-2.5 * math.log(0.5), rel=1e-12)
    torch.testing.assert_close(z.grad, torch.tensor([[[-2.0, 1.2, 0.8]]], dtype=torch.float64), **TOL)
    assert m["score_center/factor_mean"] == pytest.approx(1.6)
    z2, full2, mu_full2 = _centering_case([0.2, 0.48, 0.32])
    loss2, _ = policy_loss("aipo", logprobs=full2[..., 0], behav_logprobs=mu_full2[..., 0], advantages=torch.ones(1),
                           mask=torch.ones(1, 1), score_centering=True, full_logprobs=full2,
                           behav_full_logprobs=mu_full2)
    loss2.backward()
    torch.testing.assert_close(z2.grad, z.grad, **TOL)


def test_score_centering_needs_both_full_vocab_tensors():
    z, full, mu_full = _centering_case([0.2, 0.5, 0.3])
    with pytest.raises(ValueError, match="both full_logprobs and behav_full_logprobs"):
        policy_loss("aipo", logprobs=full[..., 0], behav_logprobs=mu_full[..., 0], advantages=torch.ones(1),
                    mask=torch.ones(1, 1), score_centering=True, full_logprobs=full)


# ------------------------------------------------------------------------------ KL and entropy

@pytest.mark.parametrize("estimator,value,grad", [
    # pi = .5, ref = .25, d = log pi - log ref = log 2
    ("k1", math.log(2), 1.0),                           # d; grad 1
    ("k2", 0.5 * math.log(2) ** 2, math.log(2)),         # d^2/2; grad d
    ("k3", 0.5 - 1 + math.log(2), 1 - 0.5),             # ref/pi - 1 - log(ref/pi); grad 1 - ref/pi
    ("k1+", math.log(2), math.log(2)),                  # k1's value, k2's grad d
    ("k3+", 0.5 - 1 + math.log(2), math.log(2)),        # k3's value, k2's grad d
])
def test_kl_penalty_estimators(estimator, value, grad):
    pi, ref = logp(0.5), logp(0.25)
    loss, g, m = run("aipo", pi, pi, [0.0], ref_logprobs=ref, kl_coef=0.1, kl_estimator=estimator)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert m["kl_ref"] == pytest.approx(value, rel=1e-12)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert loss == pytest.approx(0.1 * value, rel=1e-12)
    # float64, a few ops: rounding ~1e-15 relative; 1e-12 leaves room
    assert g.item() == pytest.approx(0.1 * grad, rel=1e-12)


def _mean_kl_gradient(estimator, logits, ref_logits):
    """The penalty's gradient w.r.t. pi's logits, averaged exactly over the sampled token y ~ pi
    (every token of the vocabulary, weighted by pi(y)): what the loss term does in expectation."""
    total = torch.zeros_like(logits)
    probs = logits.softmax(-1)
    for y in range(logits.numel()):
        x = logits.clone().requires_grad_(True)
        lp = x.log_softmax(-1)[y].reshape(1, 1)
        ref = ref_logits.log_softmax(-1)[y].reshape(1, 1)
        loss, _ = policy_loss("aipo", logprobs=lp, behav_logprobs=lp.detach(), advantages=torch.zeros(1, dtype=x.dtype),
                              mask=torch.ones(1, 1), ref_logprobs=ref, kl_coef=1.0, kl_estimator=estimator)
        loss.backward()
        total += probs[y] * x.grad
    return total


@pytest.mark.parametrize("estimator,direction", [("k1", None), ("k2", "pi||ref"), ("k3", "ref||pi"),
                                                 ("k1+", "pi||ref"), ("k3+", "pi||ref")])
def test_kl_penalty_mean_gradient_is_the_kl_direction_it_names(estimator, direction):
    # the reference: autograd of the exact KL over a 3-word vocabulary, independent of the estimators
    logits = torch.tensor([0.5, -0.2, 1.0], dtype=torch.float64)
    ref_logits = torch.tensor([0.0, 0.3, -0.5], dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    lp, lr = x.log_softmax(-1), ref_logits.log_softmax(-1)
    kl = (lp.exp() * (lp - lr)).sum() if direction == "pi||ref" else (lr.exp() * (lr - lp)).sum()
    want = torch.autograd.grad(kl, x)[0] if direction else torch.zeros(3, dtype=torch.float64)
    assert want.abs().max() > 0.1 or direction is None  # the two policies differ: a gradient to find
    # float64, 3 terms of a few ops each: ~1e-15; TOL's 1e-9 relative / 1e-12 absolute is ample
    torch.testing.assert_close(_mean_kl_gradient(estimator, logits, ref_logits), want, **TOL)


def test_k1_is_refused_as_a_penalty():
    with pytest.raises(ValueError, match="kl_estimator=k1 with kl_coef > 0: k1's gradient"):
        AlgorithmConfig(kl_coef=0.1, kl_estimator="k1")
    AlgorithmConfig(kl_coef=0.1, kl_estimator="k1+")
    AlgorithmConfig(kl_coef=0.0, kl_estimator="k1")  # off: the estimator is not used


def test_kl_needs_reference():
    with pytest.raises(ValueError, match="ref_logprobs"):
        run("aipo", logp(0.5), logp(0.5), [0.0], kl_coef=0.1)


def test_entropy_bonus():
    entropy = torch.tensor([[1.0, 2.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    pi = logp(0.5, 0.5, 0.5)
    loss, m = policy_loss("aipo", logprobs=pi, behav_logprobs=pi, advantages=torch.zeros(1), mask=mask,
                          entropy=entropy, entropy_coef=0.01)
    loss.backward()
    assert loss.item() == pytest.approx(-0.01 * 1.5) and m["entropy"] == pytest.approx(1.5)
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.005, -0.005, 0.0]], dtype=torch.float64))


# ---------------------------------------------------------------------------------- advantages

# three prompts with non-contiguous samples plus a singleton
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 1.0, 1.0, 5.0, 0.0, 0.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7, 7, 9, 2, 2])


def test_grpo_advantage():
    adv = compute_advantages("grpo", REWARDS, group_ids=GROUPS, eps=0.0)
    # group 7 = [1,0,1,1]: mean .75, unbiased std sqrt((3*.0625 + .5625)/3) = .5 -> [.5,-1.5,.5,.5]
    # group 3 = [2,4]: mean 3, std sqrt(2); group 2 = [0,0]: 0; singleton 9: 0
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([0.5, -s, -1.5, s, 0.5, 0.5, 0.0, 0.0, 0.0]))


def test_dr_grpo_and_unnormalised_grpo():
    expected = torch.tensor([0.25, -1.0, -0.75, 1.0, 0.25, 0.25, 0.0, 0.0, 0.0])
    torch.testing.assert_close(compute_advantages("dr_grpo", REWARDS, group_ids=GROUPS), expected)
    torch.testing.assert_close(compute_advantages("grpo", REWARDS, group_ids=GROUPS, normalize_std=False), expected)


def test_rloo_advantage():
    # r_i - mean of the others: 1 - 2/3, 2 - 4, 0 - 1, 4 - 2, ...
    expected = torch.tensor([1 / 3, -2.0, -1.0, 2.0, 1 / 3, 1 / 3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(compute_advantages("rloo", REWARDS, group_ids=GROUPS), expected)


def test_group_size_and_expand_to_tokens():
    adv = compute_advantages("dr_grpo", torch.tensor([1.0, 3.0, 0.0, 2.0]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    torch.testing.assert_close(expand_to_tokens(adv, mask),
                               torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0, 0], [0.0, 0, 0], [1.0, 1, 1]]))
    with pytest.raises(ValueError, match="divide"):
        compute_advantages("grpo", torch.ones(3), group_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        compute_advantages("grpo", torch.ones(4))
    with pytest.raises(ValueError, match="does not take"):
        compute_advantages("rloo", torch.ones(4), group_size=2, normalize_std=False)


# ------------------------------------------------------------------------------ registry, config

def test_unknown_names_list_known_ones_and_guess():
    with pytest.raises(ValueError, match=r"unknown loss 'apio'; known: a3po, aipo, .*Did you mean 'aipo'"):
        get_loss("apio")
    with pytest.raises(ValueError, match=r"known: dr_grpo, gae, grpo, rloo, vtrace\. Did you mean 'rloo'"):
        get_advantage("rlo")
    with pytest.raises(ValueError, match="does not take rho; its knobs are: eps_low, eps_high, dual_clip_c"):
        run("ppo", logp(0.5), logp(0.5), [1.0], rho=2.0)
    with pytest.raises(ValueError, match="already registered"):
        register_loss("aipo")(lambda inp: None)


def test_config_names_match_the_registries_and_have_help():
    assert sorted(LOSS_NAMES) == known_losses()
    assert sorted(ADVANTAGE_NAMES) == known_advantages()
    for f in dataclasses.fields(AlgorithmConfig):
        assert "default" in f.metadata["help"], f.name


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_loss_params_drive_policy_loss(loss):
    cfg = AlgorithmConfig(loss=loss, kl_coef=0.01, entropy_coef=0.001, dual_clip_c=3.0)
    mu = torch.rand(2, 3, dtype=torch.float64).clamp(min=0.1).log()
    pi = (mu + 0.1).requires_grad_(True)
    extra = {"prox_logprobs": mu} if loss == "decoupled_ppo" else {}
    total, m = policy_loss(cfg.loss, logprobs=pi, behav_logprobs=mu, advantages=torch.tensor([1.0, -1.0]),
                           mask=torch.ones(2, 3), versions=torch.tensor([4, 3]), current_version=4,
                           ref_logprobs=mu, entropy=-pi, **loss_params(cfg), **extra)
    total.backward()
    assert torch.isfinite(pi.grad).all() and pi.grad.abs().sum() > 0
    assert {"kl_ref", "entropy", "stale_frac/d0", "stale_frac/d1"} <= set(m)


def test_config_validation_and_advantage_params():
    with pytest.raises(ValueError, match="algorithm.loss='aipo2' is not one of"):
        AlgorithmConfig(loss="aipo2")
    with pytest.raises(ValueError, match="algorithm.dual_clip_c=0.5 is out of range"):
        AlgorithmConfig(dual_clip_c=0.5)
    assert advantage_params(AlgorithmConfig()) == {"normalize_std": True, "eps": 1e-6}
    assert advantage_params(AlgorithmConfig(advantage="rloo")) == {}


def test_metrics_are_python_floats_after_one_transfer():
    out = to_floats({"a": torch.tensor(1.5), "b": torch.tensor(2, dtype=torch.long), "c": 3})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0} and all(type(v) is float for v in out.values())


def test_bf16_inputs_are_computed_in_float32():
    pi = torch.tensor([[-0.5, -1.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, m = policy_loss("aipo", logprobs=pi, behav_logprobs=pi.detach(), advantages=torch.tensor([2.0]),
                          mask=torch.ones(1, 2))
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(1.5)
    assert pi.grad.dtype == torch.bfloat16 and torch.equal(pi.grad.float(), torch.tensor([[-1.0, -1.0]]))


def test_extreme_weights_keep_metrics_finite():
    # w = e^59.9 on token 0: w^2 overflows float32, so the metrics must be computed in float64.
    # ESS = (w + 1)^2 / (2 (w^2 + 1)) -> 1/2; aipo loss = (-4 * -0.1 + -1 * -1) / 2 = 0.7
    lp = torch.tensor([[-0.1, -1.0]], requires_grad=True)
    loss, m = policy_loss("aipo", logprobs=lp, behav_logprobs=torch.tensor([[-60.0, -1.0]]),
                          advantages=torch.ones(1), mask=torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.7)
    assert m["ess"] == pytest.approx(0.5) and m["clip_frac"] == 0.5
    # fp32 input -0.1 is off by 1.5e-9, log w in float64: ~1.5e-9 relative; 1e-5 is loose (admits an fp32 log w, ~4e-6)
    assert m["is_weight/max"] == pytest.approx(math.exp(59.9), rel=1e-5)
