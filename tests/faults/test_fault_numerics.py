"""Numerics: a NaN/inf loss or gradient skips the update (weights, Adam state and LR schedule
untouched) with a WARNING and a counted metric; trainer.max_skipped_steps skips in a row stop the
job. A real tiny Megatron trainer fed an inf advantage, at DP=2 so both ranks must agree.

An inf advantage on one rank reaches the other through the DP gradient average and the loss's
reduction, so that test alone cannot tell the skip decision (one MAX over all ranks,
trainer/optimizer.py ``all_finite``) from ordinary averaging. The second test poisons one rank's
gradient after the reduction (MEGARL_FAULT_INJECT=nonfinite_grad on rank 0 alone): the other rank's
loss and gradients are finite, and only the shared decision makes it skip."""

from __future__ import annotations

import math

import torch

from megarl.batch import RolloutBatch
from megarl.utils.dist import run_multiprocess


def _batch(advantage: float) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 1000, (8,), generator=g).tolist() for _ in range(2)]
    # rank 1 (DP share 2) gets the finite row: only rank 0's gradient is non-finite
    return RolloutBatch.from_sequences(tokens, [[0.0] * 2 + [1.0] * 6] * 2, behav_logprobs=[[-1.0] * 8] * 2,
                                       advantages=[advantage, 1.0], versions=[[0] * 8] * 2)


def _worker(rank, world, hf_dir, plan):
    import os
    from megarl.models.layouts import ModelDims
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import NonFiniteStepError, build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=1)
    model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)))
    load_hf_into_model(model, hf_dir)
    objs = build_training(TrainerConfig(dp=world, lr=1e-3, max_skipped_steps=2), model, total_steps=8)

    def snapshot():
        weights = [p.detach().clone() for p in model.parameters()]
        adam = [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                for o in getattr(objs.optimizer, "chained_optimizers", [objs.optimizer])
                for s in getattr(o, "optimizer", o).state.values()]
        return weights, adam, objs.scheduler.num_steps

    out = []
    for adv in plan:
        before = snapshot()
        # "nan0": a finite batch, rank 0's gradient made NaN after the DP reduction (optimizer_step)
        os.environ.pop("MEGARL_FAULT_INJECT", None)
        if adv == "nan0":
            adv = 1.0
            if rank == 0:
                os.environ["MEGARL_FAULT_INJECT"] = "nonfinite_grad"
        try:
            m = train_step(objs, _batch(adv), loss_name="aipo", loss_params={"rho": 2.0}, micro_batch_size=1,
                           current_version=0)
        except NonFiniteStepError as e:
            out.append({"stopped": str(e)})
            break
        after = snapshot()
        same_w = all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        same_adam = len(before[1]) == len(after[1]) and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(before[1], after[1]))
        out.append({"skipped": m["skipped"], "skipped_steps": m["skipped_steps"], "ok": m["update_successful"],
                    "loss": m["loss"], "grad_norm": m["grad_norm"], "same_weights": same_w, "same_adam": same_adam,
                    "adam_tensors": sum(len(a) for a in before[1]),  # what same_adam compared
                    "sched": (before[2], after[2]),
                    "finite_weights": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                    "weights_sum": sum(float(p.detach().double().sum()) for p in model.parameters())})
    os.environ.pop("MEGARL_FAULT_INJECT", None)
    return out


def test_inf_advantage_skips_the_step_and_consecutive_skips_stop(tiny_llama_tied_dir, caplog):
    inf = float("inf")
    plan = [1.0, inf, 1.0, inf, inf, 1.0]  # step, skip, step, skip, skip -> stop (max 2 in a row)
    r0, r1 = run_multiprocess(_worker, 2, str(tiny_llama_tied_dir), plan, timeout_s=600)
    for rows in (r0, r1):
        ok1, skip1, ok2, skip2, stop = rows
        for row in (ok1, ok2):
            assert row["skipped"] == 0.0 and row["ok"] and not row["same_weights"] and math.isfinite(row["loss"])
            assert row["sched"][1] == row["sched"][0] + 1
        for row, total in ((skip1, 1.0), (skip2, 2.0)):
            assert row["skipped"] == 1.0 and row["skipped_steps"] == total and not row["ok"]
            assert row["same_weights"] and row["same_adam"] and row["finite_weights"]
            assert row["adam_tensors"] > 0  # Adam's moments exist after the first step: same_adam compared them
            assert row["sched"][1] == row["sched"][0]  # the LR schedule did not advance
            assert math.isnan(row["grad_norm"])
        assert "2 steps in a row had a NaN/inf loss or gradient" in stop["stopped"]
        assert "trainer.max_skipped_steps=2" in stop["stopped"]
    assert [r.get("skipped") for r in r0[:4]] == [r.get("skipped") for r in r1[:4]]


def test_a_nan_on_one_rank_after_the_reduction_skips_every_rank(tiny_llama_tied_dir):
    """Rank 1's loss and gradients stay finite; it skips because rank 0's gradient is NaN (the one
    decision). Without it rank 1 would update alone and the DP replicas' weights would part."""
    r0, r1 = run_multiprocess(_worker, 2, str(tiny_llama_tied_dir), [1.0, "nan0", 1.0], timeout_s=600)
    assert [r["skipped"] for r in r0] == [r["skipped"] for r in r1] == [0.0, 1.0, 0.0]
    assert math.isfinite(r1[1]["loss"])  # rank 1 saw nothing wrong of its own
    assert r1[1]["same_weights"] and r1[1]["same_adam"] and r1[1]["sched"][1] == r1[1]["sched"][0]
    assert r1[1]["adam_tensors"] > 0
    assert not r1[2]["same_weights"]  # the step after it trains
    # the replicas hold the same weights after every step (DP keeps them bit-identical)
    assert [r["weights_sum"] for r in r0] == [r["weights_sum"] for r in r1]
