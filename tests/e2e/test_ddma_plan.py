"""DDMA layouts + reference planner: trainer (Megatron TP x PP x DP) -> generator (vLLM TP x replicas).

Each case builds a random HF state dict, every trainer rank's local tensors (models.layouts), and every
vLLM worker's EXPECTED tensors with an independent reference (narrowing the HF tensors as vLLM's
loaders do), then runs the plan into zeroed buffers and checks exact equality, single writes and the
DP load balance."""

import dataclasses
import itertools
import random
import zlib

import pytest
import torch

from megarl.ddma.layouts import (DstRank, GeneratorTopology, SrcRank, TrainerTopology, destination_layouts,
                                 source_layouts, validate_vllm_tp, vllm_param_layouts)
from megarl.ddma.plan import execute_plan_ref, plan_sync
from megarl.models.layouts import ModelDims, hf_tensor_shapes, hf_to_local, local_param_layouts
from tests.harness.ddma import DIMS, _expected_vllm, _random_hf


def _dims(name):
    cfg = dict(rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(DIMS[name])
    return ModelDims.from_hf_config(cfg)


def _valid_cases():
    cases = []
    for name in DIMS:
        d = _dims(name)
        for ttp, pp, dp, gtp, reps in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2, 4), (1, 2)):
            if d.num_kv_heads % ttp or d.num_heads % ttp or d.ffn_hidden_size % ttp or d.num_layers % pp:
                continue
            try:
                validate_vllm_tp(d, gtp)
            except ValueError:
                continue
            cases.append((name, ttp, pp, dp, gtp, reps))
    return cases


def _matrix():
    cases = _valid_cases()
    must = [("llama_kv2_tied", 2, 2, 2, 4, 2), ("qwen2_kv2", 2, 1, 2, 4, 1), ("llama_kv4_untied", 4, 2, 2, 1, 1),
            ("qwen2_mha_tied", 1, 1, 2, 2, 2), ("llama_kv4_untied", 1, 1, 1, 1, 1), ("qwen2_mha_tied", 4, 2, 1, 1, 2)]
    assert all(c in cases for c in must)
    rest = [c for c in cases if c not in must]
    random.Random(1234).shuffle(rest)  # seeded order; the whole valid matrix runs (~240 cases, a few seconds)
    return must + rest


# ---------------------------------------------------------------- independent vLLM reference


# ---------------------------------------------------------------- the matrix

@pytest.mark.parametrize("name,ttp,pp,dp,gtp,reps", _matrix(), ids=lambda v: str(v))
def test_plan_exact(name, ttp, pp, dp, gtp, reps):
    d = _dims(name)
    src_topo, dst_topo = TrainerTopology(ttp, pp, dp), GeneratorTopology(gtp, reps)
    plan = plan_sync(d, src_topo, dst_topo)
    assert plan_sync(d, src_topo, dst_topo) is plan  # cached

    hf = _random_hf(d, seed=zlib.crc32(repr((name, ttp, pp, dp, gtp, reps)).encode()))
    ones = {n: torch.ones_like(v) for n, v in hf.items()}
    src = {}
    for r in src_topo.ranks():  # every DP replica gets its own (identical) tensors
        src[r] = hf_to_local(hf.__getitem__, local_param_layouts(d, ttp, r.tp, pp, r.pp))
    expected = {r: _expected_vllm(hf, d, gtp, r.tp) for r in dst_topo.ranks()}
    mask = {t: _expected_vllm(ones, d, gtp, t) for t in range(gtp)}  # 1 where HF data lives

    assert set(plan.dst_shapes) == set(expected)
    dst, count = {}, {}
    for r, exp in expected.items():
        assert set(plan.dst_shapes[r]) == set(exp), r
        for n, e in exp.items():
            assert tuple(plan.dst_shapes[r][n]) == tuple(e.shape), (r, n)
        dst[r] = {n: torch.zeros_like(e) for n, e in exp.items()}
        count[r] = {n: torch.zeros(e.shape, dtype=torch.int32) for n, e in exp.items()}
    for r in src:
        assert {n: tuple(v.shape) for n, v in src[r].items() if n in plan.src_shapes[r]} == dict(plan.src_shapes[r])

    for (s, r), copies in plan.pairs.items():
        assert copies
        for c in copies:
            assert c.numel > 0
            assert 0 <= c.src_offset and c.src_offset + c.numel <= src[s][c.src_param].numel()
            assert 0 <= c.dst_offset and c.dst_offset + c.numel <= dst[r][c.dst_param].numel()
            count[r][c.dst_param].view(-1)[c.dst_offset:c.dst_offset + c.numel] += 1
            if d.tie_word_embeddings:
                assert c.src_param != "output_layer.weight"
    execute_plan_ref(plan, src, dst)

    for r, exp in expected.items():
        for n, e in exp.items():
            assert torch.equal(count[r][n], mask[r.tp][n].to(torch.int32)), f"{r} {n}: written != once"
            assert torch.equal(dst[r][n], e), f"{r} {n}"

    sent, recv = plan.elements_sent(), plan.elements_received()
    total = sum(int(m.sum()) for t in range(gtp) for m in mask[t].values()) * reps
    assert sum(sent.values()) == sum(recv.values()) == total
    assert sum(plan.messages_sent().values()) == sum(plan.messages_received().values()) == len(plan.pairs)
    assert plan.bytes_sent(2)[SrcRank(0, 0, 0)] == 2 * sent[SrcRank(0, 0, 0)]
    if dp == 2:
        biggest = max(v.numel() for v in hf.values())
        for t, p in itertools.product(range(ttp), range(pp)):
            loads = [sent[SrcRank(t, p, k)] for k in range(dp)]
            assert min(loads) > 0, (t, p, loads)
            assert max(loads) - min(loads) <= biggest, (t, p, loads)


# ---------------------------------------------------------------- layouts at scale, errors

_LLAMA_405B = dict(model_type="llama", num_hidden_layers=126, hidden_size=16384, num_attention_heads=128,
                   num_key_value_heads=8, head_dim=128, intermediate_size=53248, vocab_size=128256,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)


def test_layouts_405b():
    # How fast this is (layouts only, no copy plan) is measured by megarl/bench/fast_paths.py, not
    # asserted here: a wall-clock bound fails on a loaded machine and proves nothing on an idle one.
    d = ModelDims.from_hf_config(_LLAMA_405B)
    src = source_layouts(d, TrainerTopology(8, 9, 4))
    dst = destination_layouts(d, GeneratorTopology(16, 2))  # tp 16 > 8 kv heads: replicated
    assert len(src) == 8 * 9 * 4 and len(dst) == 32
    qkv = dst[DstRank(1, 15)]["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.local_shape == (8 * 128 + 2 * 128, 16384)
    assert [p.hf_start for p in qkv.pieces] == [15 * 1024, 7 * 128, 7 * 128]
    emb = dst[DstRank(0, 15)]["model.embed_tokens.weight"]
    assert emb.local_shape == (128256 // 16, 16384)  # 128256 is a multiple of 64


def test_plan_405b_matching_tp():
    d = ModelDims.from_hf_config(_LLAMA_405B)
    plan = plan_sync(d, TrainerTopology(8, 2, 2), GeneratorTopology(8, 1))  # timed in megarl/bench/fast_paths.py
    sent = plan.elements_sent()
    shapes = hf_tensor_shapes(d)
    n_params = sum(torch.Size(s).numel() for s in shapes.values())
    norms = sum(s[0] for n, s in shapes.items() if len(s) == 1)  # replicated on each of the 8 workers
    assert sum(sent.values()) == n_params + 7 * norms
    assert max(sent.values()) - min(sent.values()) < 0.05 * max(sent.values())
    assert min(sent.values()) > 0


def test_vllm_tp_errors():
    d = _dims("llama_kv2_tied")  # 8 heads, 2 kv heads
    with pytest.raises(ValueError, match="num_key_value_heads"):
        vllm_param_layouts(dataclasses.replace(d, num_heads=12, num_kv_heads=4), 6, 0)  # 6 > 4, 4 !| 6
    with pytest.raises(ValueError, match="num_attention_heads"):
        vllm_param_layouts(d, 16, 0)


def test_vllm_vocab_padding_rows_hold_no_data():
    d = _dims("llama_kv4_untied")  # vocab 300 -> 320 padded, tp 4 -> 80 rows per rank
    lay = vllm_param_layouts(d, 4, 3)["lm_head.weight"]
    assert lay.local_shape == (80, 64)
    (p,) = lay.pieces
    assert (p.hf_start, p.length) == (240, 60)
