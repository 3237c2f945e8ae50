"""LocalTrainer.step trains with every loss and every option (no vLLM, fast): the extra forward
passes (proximal and reference logprobs) are filled, the option's metric is reported and checked
against an independent computation, and the weights change. The reference model is the initial
policy, also after a resume."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.config import LOSS_NAMES, AlgorithmConfig, needs_prox, needs_ref
from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig

CASES = [(loss, {}) for loss in LOSS_NAMES] + [
    ("aipo", {"tis": "token"}), ("aipo", {"tis": "sequence"}), ("grpo", {"tis": "token"}),
    ("aipo", {"kl_coef": 0.01}), ("aipo", {"entropy_coef": 0.01}), ("a3po", {"prox_check": True}),
]
NOISE = 0.05  # behaviour logprobs = the trainer's + N(0, NOISE): a sampler close to the learner


def _trainer(model_dir, run_dir, algo: AlgorithmConfig, **trainer_kw):
    from megarl.trainer.local import LocalTrainer

    cfg = TrainerConfig(lr=1e-4, micro_batch_size=2, grad_clip=0.0, **trainer_kw)
    return LocalTrainer(cfg, algo, model_dir, total_steps=4, run_dir=run_dir)


def _batch(trainer) -> RolloutBatch:
    """4 rows, advantages +-1, versions 0, behaviour logprobs near the current policy's."""
    from megarl.trainer.logprobs import compute_logprobs

    g = torch.Generator().manual_seed(0)
    lengths = [10, 7, 12, 9]
    tokens = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 4 + [1.0] * (n - 4) for n in lengths]
    batch = RolloutBatch.from_sequences(tokens, masks, advantages=[1.0, -1.0, 1.0, -1.0],
                                        versions=[[0] * n for n in lengths])
    lp = compute_logprobs(trainer.model, batch).logprobs
    behav = (lp + NOISE * torch.randn(lp.shape, generator=g)) * batch.loss_mask
    return RolloutBatch(**{**batch.__dict__, "behav_logprobs": behav})


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum())


@pytest.mark.parametrize("loss,options", CASES, ids=[f"{l}-{o}" if o else l for l, o in CASES])
def test_local_trainer_step_trains(tiny_llama_dir, tmp_path, loss, options):
    from megarl.trainer.logprobs import compute_logprobs

    algo = AlgorithmConfig(loss=loss, **options)
    trainer = _trainer(tiny_llama_dir, tmp_path, algo)
    try:
        assert (trainer.ref_model is not None) == needs_ref(algo)
        batch = _batch(trainer)
        before = compute_logprobs(trainer.model, batch, with_entropy=True)
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        m = trainer.step(batch)
        assert math.isfinite(m["loss"]) and m["update_successful"] and m["grad_norm"] > 0
        changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, weights[n])]
        assert "output_layer.weight" in changed and len(changed) > len(weights) // 2, changed
        assert ("prox_logprobs_s" in m) == needs_prox(algo)
        assert ("ref_logprobs_s" in m) == needs_ref(algo)

        mask = batch.loss_mask
        w = (before.logprobs - batch.behav_logprobs).exp()  # prox / mu with prox = pi before the update
        if loss == "decoupled_ppo":  # prox was filled with the pre-update policy's logprobs
            # prox recomputed in micro-batches of 2 (here 8): fp32 GEMM order, ~1e-6 per logprob; w ~ 1 -> 1e-5 abs
            assert m["loss/decoupled_ppo/behav_weight_mean"] == pytest.approx(_masked_mean(w, mask), abs=1e-5)
        if options.get("prox_check"):  # versions 0 at step 0: staleness 0, so a3po's prox is mu itself
            # the recomputed prox (micro-batches of 2) vs this test's pass (8): ~1e-6 per logprob; 1e-5 abs
            assert m["loss/prox_error"] == pytest.approx(
                _masked_mean((before.logprobs - batch.behav_logprobs).abs(), mask), abs=1e-5)
            assert m["loss/prox_error"] > NOISE / 2  # E|N(0, s)| = 0.8 s: the check sees the sampler's noise
        if options.get("tis") == "token":
            # as above (prox vs this test's pass: ~1e-6 per logprob, w ~ 1)
            assert m["loss/tis/weight_mean"] == pytest.approx(_masked_mean(w.clamp(max=2.0), mask), abs=1e-5)
        if options.get("tis") == "sequence":
            seq = (((before.logprobs - batch.behav_logprobs) * mask).sum(-1, keepdim=True)).exp().clamp(max=2.0)
            # <= 8 tokens' ~1e-6 logprob noise add in the exponent: ~8e-6 worst case, typical far less; w ~ 1
            assert m["loss/tis/weight_mean"] == pytest.approx(_masked_mean(seq.expand_as(mask), mask), abs=1e-5)
        if "entropy_coef" in options:  # the with-grad entropy equals the no-grad one of the same weights
            # with-grad (micro-batch 2) vs no-grad (8) pass: fp32 reorder, a few ulps of H ~ 10 + vocab sum; 1e-5 rel
            assert m["loss/entropy"] == pytest.approx(_masked_mean(before.entropy, mask), rel=1e-5)
        if "kl_coef" in options:
            # fp32 reorder noise d ~ 1e-6: k3 ~ d^2/2 plus e^d's rounding near 1 (2^-24 ~ 6e-8); 1e-6 leaves room
            assert abs(m["loss/kl_ref"]) < 1e-6  # the first step: policy == reference
            after = compute_logprobs(trainer.model, batch).logprobs  # the policy step 2 starts from
            m2 = trainer.step(batch)  # the policy moved, the reference did not
            d = before.logprobs - after  # log ref - log pi
            k3 = d.clamp(-20, 20).exp() - 1 - d
            # fp32 k3 = e^d-1-d cancels: ~2^-24/(d^2/2) ~ 1e-4 relative at d ~ 0.03, plus ~1e-6 logprob noise x 2/d
            assert m2["loss/kl_ref"] == pytest.approx(_masked_mean(k3, mask), rel=1e-3) and m2["loss/kl_ref"] > 0
    finally:
        trainer.close()


def test_reference_is_the_initial_model_after_resume(tiny_llama_dir, tmp_path):
    algo = AlgorithmConfig(loss="aipo", kl_coef=0.01)
    trainer = _trainer(tiny_llama_dir, tmp_path, algo)
    try:
        initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
        assert all(not p.requires_grad for p in trainer.ref_model.parameters())
        batch = _batch(trainer)
        trainer.step(batch)
        trainer.step(batch)
        # the reference never trains; the policy did
        assert all(torch.equal(p, initial[n]) for n, p in trainer.ref_model.named_parameters())
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert not torch.equal(trained["output_layer.weight"], initial["output_layer.weight"])
        trainer.save()
    finally:
        trainer.close()
    resumed = _trainer(tiny_llama_dir, tmp_path, algo, resume_from="auto")
    try:
        assert resumed.step_count == 2
        assert all(torch.equal(p, trained[n]) for n, p in resumed.model.named_parameters())
        assert all(torch.equal(p, initial[n]) for n, p in resumed.ref_model.named_parameters())
        assert resumed.step(_batch(resumed))["loss/kl_ref"] > 0
    finally:
        resumed.close()


def test_ref_logprobs_survive_select_to_and_micro_batches():
    b = RolloutBatch.from_sequences([[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 1]])
    b = RolloutBatch(**{**b.__dict__, "prox_logprobs": torch.full((2, 3), -1.0),
                        "ref_logprobs": torch.tensor([[0.0, -2.0, -3.0], [0.0, -4.0, 0.0]])})
    (first, second) = b.to("cpu").micro_batches(1)
    assert torch.equal(first.ref_logprobs, torch.tensor([[0.0, -2.0, -3.0]]))
    assert torch.equal(second.ref_logprobs, torch.tensor([[0.0, -4.0]]))  # trimmed to the row's length
    assert second.prox_logprobs.shape == (1, 2)
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        RolloutBatch(**{**b.__dict__, "ref_logprobs": torch.zeros(2, 4)})


def test_losses_that_correct_themselves_match_the_registry():
    from megarl.algorithms.config import OWN_BEHAVIOUR_CORRECTION
    from megarl.algorithms.registry import get_loss

    assert {n for n in LOSS_NAMES if getattr(get_loss(n), "owns_behaviour_correction", False)} == \
        set(OWN_BEHAVIOUR_CORRECTION)
    assert not needs_prox(AlgorithmConfig(loss="a3po")) and needs_prox(AlgorithmConfig(loss="decoupled_ppo"))
    assert needs_prox(AlgorithmConfig(loss="a3po", prox_check=True))  # recomputed to compare, not to train with
    assert needs_prox(AlgorithmConfig(tis="sequence")) and not needs_prox(AlgorithmConfig())
    assert needs_ref(AlgorithmConfig(kl_coef=0.1)) and not needs_ref(AlgorithmConfig())
