"""Rollout routing replay (R3) under pipeline parallelism: trainer PP2 with a full activation recompute
replays exactly what PP1 replays.

The model: a tiny Qwen3-MoE of 4 layers, layer 1 dense (MoE layers 0, 2, 3): PP2's first stage holds
MoE layer 0 and its second MoE layers 2 and 3, so each stage must take its own columns of the
``[tokens, moe_layers, k]`` ids (megarl/trainer/router_replay.py ``router_columns``). The "engine"
ids are random top-2 sets of the 4 experts, unlike the model's own routing on ~5 of 6 token-layer
pairs, so a column or a micro-batch replayed wrongly moves logprobs by O(1). Four micro-batches of
unequal lengths per step (packed: trainer.packing's default, the ids packed like the tokens): under PP2's 1F1B the first stage runs its second micro-batch's forward before
the first one's backward, so with ``trainer.recompute=full`` that backward's recompute must replay the
first micro-batch's ids, not the ones set last (a later micro-batch of another length: wrong shape).

Held to PP1 (no recompute), every run a fresh TrainerExecutor (Megatron ranks in their own
processes): the logprobs, one step's loss, grad norm, weights and MoE metrics. The MoE metrics (tokens
per expert, routing mismatch) are gathered over the stages, so PP2 reports PP1's counts exactly (a
recompute not counted again). Bound: tests/e2e/test_trainer_packing.py's worst-case fp32 bound (its
module doc): PP runs the same sums in the same order, and recompute reruns them, so the bound is
loose; the replay's own effect (O(1) nats) is asserted to be far above it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig

CPUS = [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None
U = 2.0 ** -24
LENGTHS = [30, 12, 24, 18, 9, 27, 15, 21]  # micro-batches of 2: four, of unequal padded lengths
MOE_LAYERS, EXPERTS, TOPK = (0, 2, 3), 4, 2
LR, ADAM_EPS = 1e-3, 1.0  # the first Adam update near-linear in g (test_trainer_packing.py)
ALGO = AlgorithmConfig(loss="decoupled_ppo")


@pytest.fixture(scope="module")
def moe4_dir(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe4"), "qwen3_moe", num_layers=4,
                                   head_dim=64, seed=7, extra_config={"mlp_only_layers": [1]})


def _bound(model_dir) -> float:
    """u * (V + L * (K + S) + hidden) (test_trainer_packing.py's module doc), from the checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    k = max(cfg["intermediate_size"], cfg["hidden_size"], max(LENGTHS))
    return U * (cfg["vocab_size"] + cfg["num_hidden_layers"] * (k + max(LENGTHS)) + cfg["hidden_size"])


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in LENGTHS]
    masks = [[0.0] * 2 + [1.0] * (n - 2) for n in LENGTHS]
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.7, -0.7]
    b = RolloutBatch.from_sequences(tokens, masks, advantages=adv, versions=[[0] * n for n in LENGTHS])
    b.behav_logprobs = (-10.8 + 0.05 * torch.randn(b.loss_mask.shape, generator=g)) * b.loss_mask
    b.group_ids = torch.arange(4).repeat_interleave(2)
    # random top-2 sets; -1 (unknown: the trainer's own choice) on each last token and the padding
    ids = torch.rand(len(LENGTHS), max(LENGTHS), len(MOE_LAYERS), EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    for i, n in enumerate(LENGTHS):
        ids[i, n - 1:] = -1
    b.routed_experts = ids
    return b


def _run(model_dir, run_dir, batch, *, pp: int, replay: bool, recompute: str = "none"):
    from megarl.trainer.executor import TrainerExecutor

    cfg = TrainerConfig(pp=pp, lr=LR, adam_eps=ADAM_EPS, micro_batch_size=2, grad_clip=0.0, router_replay=replay,
                        recompute=recompute)
    with TrainerExecutor(cfg, ALGO, model_dir, total_steps=1, run_dir=run_dir, cpus=CPUS) as trainer:
        lp = trainer.logprobs(batch)
        metrics = trainer.step(batch)
        weights = {n: w.clone() for n, w in trainer.hf_weights()}
    return lp, metrics, weights


def _moe(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("moe/")}


def test_pp2_with_full_recompute_replays_like_pp1(moe4_dir, tmp_path, batch):
    bound = _bound(moe4_dir)
    lp1, m1, w1 = _run(moe4_dir, tmp_path / "pp1", batch, pp=1, replay=True)
    lp2, m2, w2 = _run(moe4_dir, tmp_path / "pp2", batch, pp=2, replay=True, recompute="full")
    own1, own_m1, _ = _run(moe4_dir, tmp_path / "own1", batch, pp=1, replay=False)
    own2, own_m2, _ = _run(moe4_dir, tmp_path / "own2", batch, pp=2, replay=False)

    # the replay matters: its logprobs are O(1) nats from the model's own routing, and every pair counted
    replay_effect = float((lp1 - own1).abs().max())
    print(f"replay moves logprobs by {replay_effect:.3g} (bound {bound:.3g}); mismatch without replay "
          f"{own_m1['moe/routing_mismatch']:.3f}")
    assert replay_effect > 100 * bound
    assert 0.5 < own_m1["moe/routing_mismatch"] < 1.0  # random top-2 of 4: 5 of 6 pairs expected to differ
    assert m1["moe/routing_mismatch"] == m2["moe/routing_mismatch"] == 0.0

    # PP2 (its stages' columns, the recompute's own micro-batch) equals PP1
    lp_gap = float((lp1 - lp2).abs().max())
    norm = max(m1["grad_norm"], m2["grad_norm"])
    w_gap = max(float((w1[n] - w2[n]).abs().max()) for n in w1)
    moved = max(float((w1[n] - w0).abs().max()) for n, w0 in _initial(moe4_dir).items() if n in w1)
    print(f"pp2 vs pp1: logprobs {lp_gap:.3g}, grad_norm {m1['grad_norm']:.6g} vs {m2['grad_norm']:.6g}, "
          f"weights {w_gap:.3g} (moved {moved:.3g})")
    assert lp_gap <= bound
    assert abs(m1["loss"] - m2["loss"]) <= bound * max(abs(m1["loss"]), 1.0)
    assert abs(m1["grad_norm"] - m2["grad_norm"]) <= bound * norm
    assert w_gap <= LR / ADAM_EPS * bound * norm < moved / 3  # the update itself is far above the bound

    # the MoE metrics gathered over the stages: PP1's counts (a recompute not counted twice)
    assert set(_moe(m2)) == set(_moe(m1)) and len(_moe(m1)) == 5 + EXPERTS  # max, mean, min, imbalance, mismatch, loads
    for k, v in _moe(m1).items():
        assert m2[k] == pytest.approx(v, abs=1e-12), (k, v, m2[k])
    assert own_m2["moe/routing_mismatch"] == own_m1["moe/routing_mismatch"]
    assert float((own1 - own2).abs().max()) <= bound


def _initial(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update({n: t.float() for n, t in load_file(f).items()})
    return out
