"""The value model (megarl/critic/model.py) in real Megatron ranks (run_multiprocess: fresh
processes, nothing leaks into other test files): the policy's tiny Llama with a scalar head, its
values aligned like logprobs (V of the prefix < t at t), the same values at TP=1 and TP=2, and a
few critic updates on GAE returns of a varying reward lowering the value loss."""

from __future__ import annotations

import torch

from megarl.batch import RolloutBatch
from megarl.utils.dist import run_multiprocess


def _batch(vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [12, 9, 10, 7]
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    # prompt of 3, then a reply with an observation token at position 5 (bridged by GAE)
    masks = [[0.0] * 3 + [1.0, 1.0, 0.0] + [1.0] * (n - 6) for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks)


def _worker(rank, world, tp, model_dir, batch, steps):
    from megarl.algorithms.value_targets import gae, last_action_rewards
    from megarl.critic.model import build_value_model, compute_values, critic_update
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.optimizer import build_training
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp, 1, seed=123)
    model = build_value_model(model_dir, head_init_std=0.02, seed=1)
    values = compute_values(model, batch, micro_batch_size=2)
    # one token changed at position 8 of row 0: V at t <= 8 (prefixes < t) must not move
    changed = RolloutBatch(**{**batch.__dict__, "input_ids": batch.input_ids.clone()})
    changed.input_ids[0, 8] = (int(changed.input_ids[0, 8]) + 1) % 100
    values_changed = compute_values(model, changed, micro_batch_size=2)
    out = {"values": values, "values_changed": values_changed, "losses": []}
    if steps:
        objs = build_training(TrainerConfig(tp=tp, lr=1e-3, lr_warmup_steps=0), model, steps)
        mask = batch.loss_mask.bool()
        rewards = last_action_rewards(torch.tensor([1.0, -1.0, 0.5, 0.0]), mask)  # varying reward
        for _ in range(steps):
            old = compute_values(objs.model[0], batch, micro_batch_size=2)
            _, returns = gae(rewards, old, mask, gamma=1.0, lam=1.0)
            out["losses"].append(critic_update(objs, batch, old, returns, value_clip=0.2, micro_batch_size=2))
    return out


def test_value_model_aligned_causal_tp_invariant_and_learns(tiny_llama_dir):
    batch = _batch(100)
    one = run_multiprocess(_worker, 1, 1, str(tiny_llama_dir), batch, 6, timeout_s=600)[0]
    v = one["values"]
    valid = torch.zeros_like(v, dtype=torch.bool)
    for b, n in enumerate(batch.lengths.tolist()):
        valid[b, 1:n] = True
    assert not v[~valid].any() and bool((v[valid] != 0).all())  # a value on every real position but the first
    assert torch.equal(one["values_changed"][0, :9], v[0, :9])   # V(prefix < t) for t <= 8 ignores token 8
    assert not torch.equal(one["values_changed"][0, 9:12], v[0, 9:12])
    assert torch.equal(one["values_changed"][1:], v[1:])
    losses = [m["critic/value_loss"] for m in one["losses"]]
    assert losses[0] > 0.1  # rewards 1, -1, 0.5, 0 against values near 0: the reference is not 0
    assert losses[-1] < 0.5 * losses[0], losses  # trained on its own targets, the loss falls
    # TP=2: the same values up to float32 reassociation of the sharded matmuls (~1e-6 relative of
    # activations of order 1; the head's output is of order 0.02 * sqrt(128) ~ 0.2)
    two = run_multiprocess(_worker, 2, 2, str(tiny_llama_dir), batch, 0, timeout_s=600)
    for r in two:
        assert torch.allclose(r["values"], v, atol=1e-5, rtol=0)
