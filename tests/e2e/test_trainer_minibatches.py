"""A step of trainer.minibatches x trainer.epochs optimizer updates, held to a pure-torch reference.

The reference is written from the papers, not from megarl: HF transformers' model, torch's AdamW,
decoupled PPO's loss by hand (Hilton et al. 2022; the proximal policy computed once before the
step's first update and frozen for its updates: arXiv 2512.06547 section 2.2). megarl's trainer
(Megatron ranks in their own processes, at TP1 and TP2) must land on the same parameters after
minibatches=2 x epochs=2. The test also proves it can fail: the same reference with the proximal
policy recomputed before every minibatch lands far outside the bound.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig
from megarl.trainer.executor import TrainerExecutor

CPUS = [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None
EPS_CLIP = 0.2
LR, ADAM_EPS, GRAD_CLIP = 3e-3, 1e-4, 1.0
MINIBATCHES, EPOCHS = 2, 2
GROUPS, PER_GROUP = 4, 2



def param_atol(max_grad: float, adam_eps: float = ADAM_EPS, updates: int = MINIBATCHES * EPOCHS) -> float:
    """The bound on |theta_megarl - theta_ref| (fp32, elementwise), given the largest gradient
    element G of the reference's updates. Both sides compute the same sums in another order (HF's
    fused vs Megatron's separate projections, TP2's split K-dims and vocab shards), so a logprob
    differs by D ~ 1e-6 nats and each gradient element by ~1e-5 of G (the bound
    tests/e2e/test_trainer_executor.py derives for a layout change, 10 D). Adam's update
    lr * m / (sqrt(v) + eps) moves by at most ~lr * |dg| / eps for a gradient change dg (its
    derivative in g is <= 1/eps), which is why adam_eps is 1e-4 here: at the default 1e-8 an element
    whose gradient is within the noise of 0 flips sign and moves by 2 lr whatever the code does.
    Per update: lr * 1e-5 * G / eps; x4 updates; x2 for the moved weights' own effect on the later
    gradients (first order: the same size again). The planted break moves weights by ~lr."""
    return 2 * updates * LR * 1e-5 * max_grad / adam_eps


def _batch(model) -> RolloutBatch:
    """4 prompt groups x 2 replies of 8-12 tokens; behaviour logprobs near the model's own
    (so ratios start near 1 and the clip starts acting as the updates move the policy)."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lengths = [9, 12, 10, 8, 11, 12, 9, 10]
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 4 + [1.0] * (n - 4) for n in lengths]
    batch = RolloutBatch.from_sequences(tokens, masks, advantages=[1.0, -1.0, -0.5, 0.5, 1.0, -1.0, 0.7, -0.7],
                                        versions=[[0] * n for n in lengths])
    lp0 = _hf_logprobs(model, batch).detach()
    noise = 0.1 * torch.randn(lp0.shape, generator=g)
    batch.behav_logprobs = (lp0 + noise) * batch.loss_mask
    batch.group_ids = torch.arange(GROUPS).repeat_interleave(PER_GROUP)
    return batch


def _hf_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """Token-aligned log p(x_t | x_<t) under an HF causal LM (0 at position 0 and on padding)."""
    ids = batch.input_ids
    s = ids.shape[1]
    valid = torch.arange(s).unsqueeze(0) < batch.lengths.unsqueeze(1)
    logits = model(input_ids=ids, attention_mask=valid.long()).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)) * valid


def _decoupled_ppo_by_hand(lp, prox, mu, adv, mask):
    """sg(prox/mu) * max(-A r, -A clip(r, 1-e, 1+e)) with r = pi/prox, token mean (Hilton et al. 2022)."""
    r = torch.exp(lp - prox)
    surrogate = torch.maximum(-adv * r, -adv * r.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
    per_token = torch.exp(prox - mu) * surrogate
    return (per_token * mask).sum() / mask.sum()


def _reference(model_dir, batch: RolloutBatch, *, prox_per_minibatch: bool = False):
    """The step in plain torch: 2 epochs over 2 minibatches (groups 0-1, groups 2-3)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=0.0)
    rows = [torch.arange(0, 4), torch.arange(4, 8)]  # groups are rows (0,1), (2,3), (4,5), (6,7)
    with torch.no_grad():
        prox_all = _hf_logprobs(model, batch)  # frozen for the whole step
    max_grad = 0.0
    for _ in range(EPOCHS):
        for r in rows:
            ids, mask = batch.input_ids[r], batch.loss_mask[r]
            sub = RolloutBatch(ids, batch.lengths[r], mask, batch.behav_logprobs[r], batch.advantages[r],
                               batch.versions[r])
            if prox_per_minibatch:  # the planted break: the anchor follows the moving policy
                with torch.no_grad():
                    prox = _hf_logprobs(model, sub)
            else:
                prox = prox_all[r]
            loss = _decoupled_ppo_by_hand(_hf_logprobs(model, sub), prox, sub.behav_logprobs, sub.advantages, mask)
            opt.zero_grad()
            loss.backward()
            max_grad = max(max_grad, max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None))
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, max_grad


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    batch = _batch(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref, max_grad = _reference(tiny_llama_dir, batch)
    return batch, initial, ref, max_grad


def test_minibatches_split_along_groups_in_order():
    ids = torch.tensor([[1, 2, 3]] * 6)
    batch = RolloutBatch.from_sequences(ids.tolist(), [[0, 1, 1]] * 6, advantages=list(range(6)))
    batch.group_ids = torch.tensor([7, 7, 3, 3, 9, 9])
    parts = batch.minibatches(2)  # 3 groups into 2: the first minibatch gets the extra group
    assert [p.advantages[:, 1].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]
    batch.group_ids = torch.tensor([5, 6, 5, 6, 8, 8])  # interleaved rows: a group still stays whole
    assert [p.group_ids.tolist() for p in batch.minibatches(3)] == [[5, 5], [6, 6], [8, 8]]
    assert batch.minibatches(1)[0] is batch
    with pytest.raises(ValueError, match="3 prompt group.*4 minibatches"):
        batch.minibatches(4)


@pytest.mark.parametrize("tp", [1, 2])
def test_minibatches_x_epochs_match_a_pure_torch_reference(setup, tiny_llama_dir, tmp_path, tp):
    batch, initial, ref, max_grad = setup
    atol = param_atol(max_grad)
    cfg = TrainerConfig(tp=tp, lr=LR, adam_eps=ADAM_EPS, grad_clip=GRAD_CLIP, micro_batch_size=3,
                        minibatches=MINIBATCHES, epochs=EPOCHS, resume_from=None)
    algo = AlgorithmConfig(loss="decoupled_ppo", eps_low=EPS_CLIP, eps_high=EPS_CLIP)
    with TrainerExecutor(cfg, algo, tiny_llama_dir, total_steps=1, run_dir=tmp_path, cpus=CPUS) as trainer:
        metrics = trainer.step(batch)
        got = dict(trainer.hf_weights())
    assert metrics["updates"] == MINIBATCHES * EPOCHS
    assert metrics["tokens"] == float(batch.loss_mask.sum())  # one pass's tokens, not four
    assert metrics["loss/clip_frac"] > 0  # the later updates moved pi out of the band around prox
    worst, moved = 0.0, 0.0
    for name, want in ref.items():
        worst = max(worst, float((got[name] - want).abs().max()))
        moved = max(moved, float((want - initial[name]).abs().max()))
    print(f"tp{tp}: worst {worst:.3g}, bound {atol:.3g}, moved {moved:.3g}, clip_frac {metrics['loss/clip_frac']:.3f}")
    assert moved > 3 * atol  # the step moved the weights well past the bound
    assert worst <= atol, (worst, atol, moved)


def test_the_reference_tells_a_prox_recomputed_per_minibatch(setup, tiny_llama_dir):
    batch, _, ref, max_grad = setup
    planted, _ = _reference(tiny_llama_dir, batch, prox_per_minibatch=True)
    worst = max(float((planted[n] - w).abs().max()) for n, w in ref.items())
    print(f"planted: {worst:.3g} vs bound {param_atol(max_grad):.3g}")
    assert worst > 3 * param_atol(max_grad), worst


# --- batch statistics are the minibatch's, whatever the micro-batch size and DP -------------------

# Larger than ADAM_EPS: the first Adam update is lr * g / (|g| + eps), saturating at lr for |g| >> eps,
# so a wrongly filtered token could move an element by at most 2 lr, too close to the bound at 1e-4.
# Gradient elements here are <= ~0.4; at 1e-2 most updates stay linear in g, and a different
# gradient shows as lr * dg / eps while float reordering shows as lr * 1e-5 * G / eps.
INVARIANCE_ADAM_EPS = 1e-2


def _invariance_batch(model) -> RolloutBatch:
    """8 rows; the sampler's logprobs sit 0.05 below the policy's on rows 0-3 (|pi/mu - 1| = 0.05)
    and 1.0 below on rows 4-7 (|pi/mu - 1| = 1.72). The minibatch's TV is ~0.44: above VACO's
    threshold tv_delta/2 = 0.3, so it filters every row; a micro-batch (or a DP rank's share) of
    rows 0-3 alone has TV 0.025 and would filter none of them."""
    g = torch.Generator().manual_seed(1)
    lengths = [10, 9, 11, 10, 9, 11, 10, 10]  # about equal, so the rows weigh alike in the TV
    tokens = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 3 + [1.0] * (n - 3) for n in lengths]
    batch = RolloutBatch.from_sequences(tokens, masks, advantages=[1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5],
                                        versions=[[0] * n for n in lengths])
    shift = torch.tensor([0.05] * 4 + [1.0] * 4).unsqueeze(1)
    batch.behav_logprobs = (_hf_logprobs(model, batch).detach() - shift) * batch.loss_mask
    batch.group_ids = torch.arange(4).repeat_interleave(2)
    return batch


def _one_step_worker(rank, world, model_dir, batch, runs):
    """Per (loss, micro_batch_size): a fresh model at DP=world, one step; rank 0 returns the full
    weights and the step's metrics."""
    from megarl.algorithms.config import AlgorithmConfig
    from megarl.algorithms.policy_loss import loss_params
    from megarl.models.layouts import ModelDims
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.shards import local_shard_specs, reassemble
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    out = {}
    for loss, mbs in runs:
        init_model_parallel(1, 1, seed=1)
        model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(model_dir)))
        load_hf_into_model(model, model_dir)
        cfg = TrainerConfig(dp=world, lr=LR, adam_eps=INVARIANCE_ADAM_EPS, grad_clip=0.0, micro_batch_size=mbs)
        objs = build_training(cfg, model, total_steps=1)
        algo = AlgorithmConfig(loss=loss, tv_delta=0.6)
        # numpy, not tensors: torch's queue would share their storage with a process about to exit
        weights = lambda: {k: v.numpy().copy() for k, v in reassemble(list(local_shard_specs(model))).items()}  # noqa: E731
        if rank == 0 and "initial" not in out:
            out["initial"] = weights()
        metrics = train_step(objs, batch, loss_name=loss, loss_params=loss_params(algo), micro_batch_size=mbs,
                             current_version=0)
        out[(loss, mbs)] = (weights(), metrics) if rank == 0 else None
    return out


def test_vaco_and_ppo_steps_do_not_depend_on_micro_batch_size_or_dp(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from megarl.utils.dist import run_multiprocess

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    batch = _invariance_batch(hf)
    runs = [(loss, mbs) for loss in ("vaco", "ppo") for mbs in (1, 2, 8)]
    dp1 = run_multiprocess(_one_step_worker, 1, str(tiny_llama_dir), batch, runs, timeout_s=600)[0]
    dp2 = run_multiprocess(_one_step_worker, 2, str(tiny_llama_dir), batch, [("vaco", 2), ("ppo", 2)],
                           timeout_s=600)[0]
    vaco = dp1[("vaco", 8)][1]
    assert vaco["loss/vaco/filter_active"] == 1.0  # the whole minibatch's TV is over the threshold ...
    # by hand: 28 loss tokens at |pi/mu - 1| = e^0.05 - 1 and 28 at e - 1: TV = (0.05127 + 1.71828) / 4 = 0.44239;
    # mu is transformers' logprobs, pi Megatron's (within 1e-4 nats: each ratio within 1e-4 relative), so
    # the TV moves by ~1e-4; 1e-3 leaves 10x
    assert vaco["loss/vaco/tv"] == pytest.approx(((math.exp(0.05) - 1) + (math.e - 1)) / 4, abs=1e-3)
    for loss in ("vaco", "ppo"):
        want, metrics = dp1[(loss, 8)]  # one micro-batch on one rank: the statistic is the batch's
        # one Adam update: the bound param_atol derives, with the grad norm bounding the largest element
        atol = param_atol(metrics["grad_norm"], INVARIANCE_ADAM_EPS, updates=1)
        moved = max(float(abs(w - dp1["initial"][n]).max()) for n, w in want.items())
        assert metrics["grad_norm"] > 0 and moved > 3 * atol, (loss, moved, atol)  # a step that did move
        for other in [dp1[(loss, 1)], dp1[(loss, 2)], dp2[(loss, 2)]]:
            worst = max(float(abs(other[0][n] - w).max()) for n, w in want.items())
            assert worst <= atol, (loss, worst, atol)
            # ... and it is the same statistic at micro-batch 1, where rows 0-3 alone would not filter
            for key in ("loss", "loss/clip_frac", "loss/vaco/tv", "loss/vaco/filter_active"):
                if key in metrics:
                    assert other[1][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


def test_the_lr_schedule_counts_updates_and_a_resume_between_steps_is_bit_exact(setup, tiny_llama_dir, tmp_path):
    """2 steps of 2 x 2 updates under a linear decay over the run's 8 updates; the second step run
    straight and run again from the first step's checkpoint in fresh rank processes."""
    batch = setup[0]
    algo = AlgorithmConfig(loss="decoupled_ppo")

    def cfg(**kw):
        return TrainerConfig(lr=LR, adam_eps=ADAM_EPS, micro_batch_size=4, minibatches=MINIBATCHES, epochs=EPOCHS,
                             lr_decay_style="linear", checkpoint_dir=str(tmp_path / "ckpt"), **kw)

    with TrainerExecutor(cfg(resume_from=None), algo, tiny_llama_dir, total_steps=2, run_dir=tmp_path / "a",
                         cpus=CPUS) as trainer:
        first = trainer.step(batch)
        saved = trainer.save()
        second = trainer.step(batch)
        straight = dict(trainer.hf_weights())
    # megatron's linear decay: lr * (1 - updates / 8) after each update; a schedule in steps would say
    # 1 - 1/2 after the first step and 0 after the second
    assert first["lr"] == pytest.approx(LR * (1 - 4 / 8)) and second["lr"] == pytest.approx(0.0, abs=1e-12)
    with TrainerExecutor(cfg(resume_from=str(saved)), algo, tiny_llama_dir, total_steps=2, run_dir=tmp_path / "b",
                         cpus=CPUS) as trainer:
        assert trainer.step_count == 1
        again = trainer.step(batch)
        resumed = dict(trainer.hf_weights())
    assert again["loss"] == second["loss"] and again["lr"] == second["lr"]
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name
