"""The train step: a simple loss decreases on a tiny model, identically at TP=2, TP=1 x DP=2 and PP=2."""

from __future__ import annotations

import torch

from megarl.batch import RolloutBatch
from megarl.utils.dist import run_multiprocess


def _batch(vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [10, 7, 12, 9]
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 4 + [1.0] * (n - 4) for n in lengths]
    # behaviour logprobs far below pi: the AIPO weight sits at its cap rho, so the loss is
    # -rho * mean(log pi) with advantages +1, which must fall as training raises log pi
    behav = [[-50.0] * n for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks, behav_logprobs=behav, advantages=[1.0, 1.0, 1.0, 1.0],
                                       versions=[[0] * n for n in lengths])


def _train_worker(rank, world, hf_dir, batch, layouts, steps):
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    out = {}
    for tp, pp in layouts:
        cfg = TrainerConfig(tp=tp, pp=pp, dp=world // (tp * pp), lr=1e-3, grad_clip=1.0,
                            use_distributed_optimizer=True)
        init_model_parallel(tp, pp, seed=1)
        model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)))
        load_hf_into_model(model, hf_dir)
        objs = build_training(cfg, model, total_steps=steps)
        from megarl.trainer.shards import local_shard_specs
        early = local_shard_specs(model)  # taken before training: views must follow the updates
        initial = [s.local_view.clone() for s in early]
        out[(tp, pp)] = [train_step(objs, batch, loss_name="aipo", loss_params={"rho": 4.0},
                                    micro_batch_size=1, current_version=0) for _ in range(steps)]
        late = local_shard_specs(model)
        assert all(torch.equal(a.local_view, b.local_view) for a, b in zip(early, late))
        assert not all(torch.equal(a.local_view, b) for a, b in zip(early, initial))
        if pp == 2:  # tied embeddings: stage 0's embedding and stage 1's output layer stay identical
            out["embed_copies"] = [s.local_view.clone() for s in local_shard_specs(model)
                                   if s.hf_name == "model.embed_tokens.weight"]
    return out


def test_loss_decreases_and_matches_across_tp(tiny_llama_tied_dir):
    batch = _batch(49152)
    results = run_multiprocess(_train_worker, 2, str(tiny_llama_tied_dir), batch, [(2, 1), (1, 1), (1, 2)], 4,
                               timeout_s=600)
    tp2, tp1, pp2 = results[0][(2, 1)], results[0][(1, 1)], results[0][(1, 2)]  # (1, 1) on 2 ranks = DP 2
    losses = [m["loss"] for m in tp2]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    for a, b in [*zip(tp2, tp1), *zip(tp2, pp2)]:
        # fp32 reorder noise ~1e-6, grown by 4 Adam sign-like steps (g ~ 0 can flip); 1e-4 relative leaves room
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a["loss"], b["loss"])
        # grads carry that step-grown noise; the norm sums ~6.3M squares (49152 x 128) in layout order; 1e-3 rel
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * a["grad_norm"]
        assert a["tokens"] == b["tokens"] == float(batch.loss_mask.sum())
        assert a["update_successful"] and a["lr"] == 1e-3
    (first,), (last,) = results[0]["embed_copies"], results[1]["embed_copies"]
    assert torch.equal(first, last)
    # every rank reports the same metrics
    assert [m["loss"] for m in results[1][(2, 1)]] == losses
