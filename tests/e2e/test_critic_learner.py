"""The critic's learner (megarl/critic/learner.py) in real Megatron ranks: a few updates (value loss
falls, explained variance reported), a checkpoint beside the trainer's, and a resume at another
layout (TP=1 -> TP=2) through the trainer's own checkpoint code, giving the same values."""

from __future__ import annotations

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.critic.config import CriticConfig
from megarl.utils.dist import run_multiprocess


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    lengths = [11, 8, 10, 9]
    tokens = [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 3 + [1.0] * (n - 3) for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks)


def _worker(rank, world, tp, model_dir, run_dir, steps, resume_from):
    from megarl.algorithms.value_targets import gae, last_action_rewards
    from megarl.critic.learner import CriticLearner
    from megarl.trainer.config import TrainerConfig
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp, 1, seed=123)
    learner = CriticLearner(TrainerConfig(tp=tp, micro_batch_size=2), CriticConfig(lr=1e-3, head_init_std=0.02),
                            model_dir, total_steps=max(steps, 1), run_dir=run_dir, resume_from=resume_from)
    batch = _batch()
    mask = batch.loss_mask.bool()
    rewards = last_action_rewards(torch.tensor([1.0, -1.0, 0.5, 0.0]), mask)  # a varying reward
    metrics = []
    for _ in range(steps):
        old = learner.values(batch)
        metrics.append(learner.step(batch, old, gae(rewards, old, mask, gamma=1.0, lam=0.95)[1]))
    saved = str(learner.save()) if steps else None
    return {"metrics": metrics, "values": learner.values(batch), "saved": saved, "step": learner.progress.step,
            "dir": str(learner.checkpoint_dir)}


def test_critic_learns_saves_and_resumes_at_tp2(tiny_llama_dir, tmp_path):
    first = run_multiprocess(_worker, 1, 1, str(tiny_llama_dir), str(tmp_path), 4, None, timeout_s=600)[0]
    losses = [m["critic/value_loss"] for m in first["metrics"]]
    assert losses[0] > 0.1 and losses[-1] < 0.5 * losses[0], losses  # rewards of +-1 vs values ~0: not 0 at start
    assert {"critic/value_loss", "critic/explained_var", "critic/grad_norm", "critic/lr"} <= set(first["metrics"][0])
    assert first["metrics"][-1]["critic/explained_var"] > first["metrics"][0]["critic/explained_var"]
    assert first["dir"] == str(tmp_path / "checkpoints" / "critic") and first["saved"].startswith(first["dir"])
    # resume from the critic's checkpoint folder at TP=2: same step count, same values (float32
    # reassociation of the sharded matmuls: ~1e-6 relative on activations of order 1)
    again = run_multiprocess(_worker, 2, 2, str(tiny_llama_dir), str(tmp_path), 0, "auto", timeout_s=600)
    for r in again:
        assert r["step"] == 4
        assert torch.allclose(r["values"], first["values"], atol=1e-5, rtol=0)
    fresh = run_multiprocess(_worker, 1, 1, str(tiny_llama_dir), str(tmp_path / "other"), 0, None)[0]
    assert not torch.allclose(fresh["values"], first["values"], atol=1e-3)  # the resume is what matched


def test_critic_config_problems():
    assert CriticConfig().problems() == []
    bad = CriticConfig(lr=0.0, value_clip=-1.0, micro_batch_size=-1, checkpoint_subdir="../x")
    assert [p.split("=")[0] for p in bad.problems()] == ["critic.lr", "critic.value_clip", "critic.micro_batch_size",
                                                         "critic.checkpoint_subdir"]
    from megarl.critic.learner import CriticLearner
    from megarl.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match=r"critic.lr=0.0: must be > 0"):  # refused before any model is built
        CriticLearner(TrainerConfig(), CriticConfig(lr=0.0), "/nonexistent", total_steps=1, run_dir="/tmp")
