"""Sequence packing and token-budget micro-batches (trainer.packing, trainer.max_tokens_per_micro_batch).

The plan (pure functions) is checked on its values; the model is held to the padded rows it
replaces: logprobs, the step's grad norm and the weights after one update, at TP1, TP2 and PP2
(Megatron ranks in their own processes), and DP2 under a token budget whose two ranks run
different numbers of micro-batches. The planted breaks (mask not block-diagonal, unpack off by
one, positions not restarting) each fail a check here.

Bound (fp32, unit roundoff u = 2^-24). Packed and padded rows compute the same sums in another
order and shape (GEMMs over other row counts, softmax over other key counts with the masked keys
exactly 0) and rotate q/k at other absolute positions (RoPE's angle pos * inv_freq rounds with
absolute error <= u * pos, pos < S; the scores depend on the difference only in exact
arithmetic). Worst-case (Higham's n*u for a sum of n terms, not the random walk): a logprob is a
log-sum-exp over V vocab entries of logits from L layers whose sums have at most K terms (hidden,
ffn or keys) and angles of at most S radians: |dlp| <= u * (V + L * (K + S) + hidden) nats for
O(1) activations. The tiny Llama: V = 49152, L = 2, K = ffn, S the longest row -> ~3e-3; the
planted breaks move logprobs by O(1). Gradients carry the same relative error (the backward runs
the transposed sums), so the grad norm agrees to that relative bound; the first Adam update
lr * g / (|g| + eps) has slope <= lr / eps in g, so each weight moves by <= lr / eps * D * |g|
<= lr / eps * D * grad_norm more or less.
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
from megarl.trainer.packing import (balanced_partition, first_fit_decreasing, pack, thd_packed_seq_params,
                                    token_budget_groups)

CPUS = [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None
U = 2.0 ** -24
LENGTHS = [5, 40, 12, 33, 20, 7, 28, 16]  # long-tailed enough that a micro-batch of 4 packs into fewer rows
# adam_eps = 1 keeps the first update lr * g / (|g| + eps) near-linear in g (slope <= lr / eps): the
# weights' bound lr / eps * D * grad_norm (module doc) then sits well below the update itself (~lr |g|)
LR, ADAM_EPS = 1e-3, 1.0
ALGO = AlgorithmConfig(loss="decoupled_ppo")  # its proximal pass runs packed too


def logprob_bound(model_dir) -> float:
    """u * (V + L * (K + S) + hidden): the module doc's worst-case fp32 bound, from the checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    k = max(cfg["intermediate_size"], cfg["hidden_size"], max(LENGTHS))
    return U * (cfg["vocab_size"] + cfg["num_hidden_layers"] * (k + max(LENGTHS)) + cfg["hidden_size"])


def _batch(lengths=LENGTHS, seed=0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 2 + [1.0] * (n - 2) for n in lengths]
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.7, -0.7][:len(lengths)]
    return RolloutBatch.from_sequences(tokens, masks, advantages=adv, versions=[[0] * n for n in lengths])


# --- the plan ---------------------------------------------------------------------------------

def test_first_fit_decreasing_places_every_item_once_within_capacity():
    bins = first_fit_decreasing(LENGTHS, 40)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 40 for b in bins)
    # by hand, longest first into the first bin with room: 40 | 33+7 | 28+12 | 20+16 | 5
    assert bins == [[1], [3, 5], [6, 2], [4, 7], [0]]
    assert first_fit_decreasing([50, 3], 10) == [[0], [1]]  # over capacity: a bin of its own


def test_pack_block_diagonal_mask_positions_restart_and_unpack_inverts():
    _check_plan(pack)


def _check_plan(pack_fn):
    batch = _batch()
    layout = pack_fn(batch.input_ids, batch.lengths)
    rows, cap = layout.input_ids.shape
    assert cap == max(LENGTHS) and rows == len(first_fit_decreasing(LENGTHS, cap)) < len(LENGTHS)
    for i, n in enumerate(LENGTHS):
        r, o = int(layout.row[i]), int(layout.offset[i])
        assert layout.input_ids[r, o:o + n].tolist() == batch.input_ids[i, :n].tolist()
        assert layout.position_ids[r, o:o + n].tolist() == list(range(n))  # restart at 0 (absolute embeddings)
        block = layout.attention_mask[r, 0, o:o + n, o:o + n]
        assert torch.equal(~block, torch.ones(n, n, dtype=torch.bool).tril())  # causal inside the block
        others = torch.ones(cap, dtype=torch.bool)
        others[o:o + n] = False
        assert bool(layout.attention_mask[r, 0, o:o + n][:, others].all())  # sees nothing outside it
    # unpack of the packed ids is the padded ids on positions 1..len-1 and 0 elsewhere
    got = layout.unpack(layout.input_ids.double())
    valid = (torch.arange(batch.input_ids.shape[1]) >= 1) & (torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None])
    assert torch.equal(got, (batch.input_ids * valid).double())


def test_thd_params_are_cumulative_lengths():
    p = thd_packed_seq_params(torch.tensor([5, 40, 12]))
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 5, 45, 57] and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_kv is p.cu_seqlens_q and p.max_seqlen_q == p.max_seqlen_kv == 40
    layout = pack(_batch().input_ids[:3], torch.tensor([5, 40, 12]), thd=True)
    assert layout.attention_mask is None and tuple(layout.input_ids.shape) == (1, 57)
    assert layout.position_ids[0].tolist() == list(range(5)) + list(range(40)) + list(range(12))
    assert layout.model_inputs()["packed_seq_params"] is layout.packed_seq_params


def test_token_budget_micro_batches_within_budget():
    lengths = [5, 40, 12, 33, 20, 7, 28, 16, 90]
    for budget in (40, 48, 64, 100):
        groups = token_budget_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert sum(lengths[i] for i in g) <= budget or len(g) == 1  # an over-budget sequence alone
    assert [8] in token_budget_groups(lengths, 64)


def test_balanced_partition_within_the_longest_sequence():
    g = torch.Generator().manual_seed(3)
    for parts in (2, 3, 4):
        lengths = torch.clamp(torch.exp(torch.randn(37, generator=g) + 4.5), 16, 1024).long().tolist()
        split = balanced_partition(lengths, parts)
        assert sorted(i for p in split for i in p) == list(range(37))
        totals = [sum(lengths[i] for i in p) for p in split]
        assert max(totals) - min(totals) <= max(lengths)
        assert split == balanced_partition(lengths, parts)  # deterministic: every rank the same


# --- the model: packed vs padded, in-process (also where the planted breaks are tried) ---------

@pytest.fixture(scope="module")
def local_trainer(tiny_llama_dir, tmp_path_factory):
    from megarl.trainer.local import LocalTrainer

    cfg = TrainerConfig(lr=LR, adam_eps=ADAM_EPS, micro_batch_size=4, grad_clip=0.0)
    trainer = LocalTrainer(cfg, ALGO, tiny_llama_dir, total_steps=2, run_dir=tmp_path_factory.mktemp("pack"))
    yield trainer
    trainer.close()  # this process's torch.distributed: later in-process trainers (test_weight_sync) start their own


def _logprob_gap(trainer, **kw) -> float:
    from megarl.trainer.logprobs import compute_logprobs

    batch = _batch()
    padded = compute_logprobs(trainer.model, batch, micro_batch_size=4, packing=False, with_entropy=True)
    packed = compute_logprobs(trainer.model, batch, micro_batch_size=4, packing=True, with_entropy=True, **kw)
    return max(float((padded.logprobs - packed.logprobs).abs().max()),
               float((padded.entropy - packed.entropy).abs().max()))


def test_packed_logprobs_match_padded(local_trainer, tiny_llama_dir):
    bound = logprob_bound(tiny_llama_dir)
    for kw in ({}, {"max_tokens_per_micro_batch": 48}):
        gap = _logprob_gap(local_trainer, **kw)
        print(f"{kw}: packed vs padded {gap:.3g} (bound {bound:.3g})")
        assert gap <= bound


def _plant_full_causal(monkeypatch):
    """The break: a plain causal mask over the whole row (sequences see their row neighbours)."""
    import megarl.trainer.packing as packing

    real = packing.pack

    def broken(input_ids, lengths, thd=False):
        layout = real(input_ids, lengths, thd=thd)
        cap = layout.input_ids.shape[1]
        causal = torch.ones(cap, cap, dtype=torch.bool).triu(1)
        layout.attention_mask = causal.expand_as(layout.attention_mask).clone()
        return layout
    monkeypatch.setattr(packing, "pack", broken)


def _plant_unpack_off_by_one(monkeypatch):
    import megarl.trainer.packing as packing

    real = packing.PackedLayout.unpack
    monkeypatch.setattr(packing.PackedLayout, "unpack",
                        lambda self, packed: real(self, torch.roll(packed, 1, dims=1)))


def _plant_positions_not_restarting(monkeypatch):
    import megarl.trainer.packing as packing

    real = packing.pack

    def broken(input_ids, lengths, thd=False):
        layout = real(input_ids, lengths, thd=thd)
        rows, cap = layout.input_ids.shape
        layout.position_ids = torch.arange(cap).expand(rows, cap).clone()
        return layout
    monkeypatch.setattr(packing, "pack", broken)


@pytest.mark.parametrize("plant", [_plant_full_causal, _plant_unpack_off_by_one])
def test_planted_breaks_fail_the_bound(local_trainer, tiny_llama_dir, monkeypatch, plant):
    plant(monkeypatch)
    gap = _logprob_gap(local_trainer)
    print(f"{plant.__name__}: {gap:.3g} vs bound {logprob_bound(tiny_llama_dir):.3g}")
    assert gap > 100 * logprob_bound(tiny_llama_dir)


def test_planted_positions_not_restarting_fails_the_plan_check(monkeypatch):
    """megatron-core's rope ignores position_ids (the module doc of packing.py), so this break
    does not move a logprob of our RoPE models; it is caught on the plan, where an absolute
    position embedding would read it."""
    import megarl.trainer.packing as packing

    _plant_positions_not_restarting(monkeypatch)
    with pytest.raises(AssertionError):
        _check_plan(packing.pack)


# --- the model across layouts: Megatron ranks in their own processes ---------------------------

def _run(model_dir, run_dir, *, tp=1, pp=1, dp=1, packing, max_tokens=0, batch=None):
    """(logprobs, step metrics, weights) of a fresh trainer: logprobs of the batch, then one step."""
    from megarl.trainer.executor import TrainerExecutor

    cfg = TrainerConfig(tp=tp, pp=pp, dp=dp, lr=LR, adam_eps=ADAM_EPS, micro_batch_size=4, grad_clip=0.0,
                        packing=packing, max_tokens_per_micro_batch=max_tokens)
    with TrainerExecutor(cfg, ALGO, model_dir, total_steps=1, run_dir=run_dir, cpus=CPUS) as trainer:
        lp = trainer.logprobs(batch)
        metrics = trainer.step(batch)
        weights = {n: w.clone() for n, w in trainer.hf_weights()}
    return lp, metrics, weights


@pytest.fixture(scope="module")
def step_batch():
    batch = _batch()
    # behaviour logprobs a little off the policy's: ratios near 1, a gradient on every row
    batch.behav_logprobs = (-10.8 + 0.05 * torch.randn(batch.loss_mask.shape,
                                                       generator=torch.Generator().manual_seed(1))) * batch.loss_mask
    batch.group_ids = torch.arange(4).repeat_interleave(2)
    return batch


def _compare(a, b, bound):
    lp_a, m_a, w_a = a
    lp_b, m_b, w_b = b
    lp_gap = float((lp_a - lp_b).abs().max())
    norm = max(m_a["grad_norm"], m_b["grad_norm"])
    w_gap = max(float((w_a[n] - w_b[n]).abs().max()) for n in w_a)
    w_bound = LR / ADAM_EPS * bound * norm
    print(f"logprobs {lp_gap:.3g} (bound {bound:.3g}); grad_norm {m_a['grad_norm']:.6g} vs {m_b['grad_norm']:.6g}; "
          f"weights {w_gap:.3g} (bound {w_bound:.3g})")
    assert lp_gap <= bound
    assert abs(m_a["grad_norm"] - m_b["grad_norm"]) <= bound * norm
    assert abs(m_a["loss"] - m_b["loss"]) <= bound * max(abs(m_a["loss"]), 1.0)
    assert w_gap <= w_bound
    return w_a


@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2), dict(pp=2)], ids=["tp1", "tp2", "pp2"])
def test_packed_step_matches_padded(tiny_llama_dir, tmp_path, step_batch, layout):
    bound = logprob_bound(tiny_llama_dir)
    padded = _run(tiny_llama_dir, tmp_path / "padded", packing=False, batch=step_batch, **layout)
    packed = _run(tiny_llama_dir, tmp_path / "packed", packing=True, batch=step_batch, **layout)
    _assert_moved(tiny_llama_dir, _compare(padded, packed, bound), LR / ADAM_EPS * bound * padded[1]["grad_norm"])


def _assert_moved(model_dir, weights, w_bound):
    """The update moved some weight well past the bound the weights were held to (else the
    comparison could not fail)."""
    from safetensors.torch import load_file

    initial = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        initial.update(load_file(f))
    moved = max(float((weights[n] - initial[n].float()).abs().max()) for n in weights if n in initial)
    print(f"moved {moved:.3g} vs weight bound {w_bound:.3g}")
    assert moved > 3 * w_bound


def test_dp2_token_budget_step_matches_padded(tiny_llama_dir, tmp_path, step_batch):
    """DP2 with a budget of 40 tokens: balanced shares of unequal row counts whose ranks run
    different numbers of micro-batches, against DP2 padded contiguous halves."""
    budget = 40  # shares 40+20+16+5 | 33+28+12+7 -> micro-batches 40 | 20+16 | 5 and 33+7 | 28+12
    shares = balanced_partition(LENGTHS, 2)
    counts = [len(token_budget_groups([LENGTHS[i] for i in share], budget)) for share in shares]
    totals = [sum(LENGTHS[i] for i in share) for share in shares]
    assert counts[0] != counts[1], counts  # the case under test
    assert max(totals) - min(totals) <= max(LENGTHS)
    bound = logprob_bound(tiny_llama_dir)
    padded = _run(tiny_llama_dir, tmp_path / "padded", dp=2, packing=False, batch=step_batch)
    budgeted = _run(tiny_llama_dir, tmp_path / "budget", dp=2, packing=True, max_tokens=budget, batch=step_batch)
    _assert_moved(tiny_llama_dir, _compare(padded, budgeted, bound), LR / ADAM_EPS * bound * padded[1]["grad_norm"])
    assert budgeted[1]["micro_batches"] in counts
