"""The C++ DDMA planner (csrc/plan.cpp via megarl/ddma/plan_native.py) builds the reference plan exactly.

Exact means the same pairs in the same order and the same Copy tuples in the same order (the
Python reference, megarl/ddma/plan.py, is the spec), on a seeded sample of trainer x generator
topologies; the native plan, executed, lands the vLLM shards; bad layouts raise the reference's
ValueErrors. Timing is not tested here (see the planner's report)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import re

import pytest
import torch

import megarl.native as native
from megarl.ddma import plan_native
from megarl.ddma.layouts import (DstRank, GeneratorTopology, SrcRank, TrainerTopology, destination_layouts,
                                 source_layouts, validate_vllm_tp)
from megarl.ddma.plan import Copy, _plan_layouts, execute_plan_ref, plan_sync
from megarl.models.layouts import ModelDims, ParamLayout, Piece, hf_to_local, local_param_layouts, validate_parallel
from tests.harness.ddma import DIMS, _expected_vllm, _random_hf

requires_native = pytest.mark.skipif(
    not plan_native.available() and os.environ.get("MEGARL_REQUIRE_NATIVE") != "1",
    reason="megarl._C.plan_copies not built (pip install --no-build-isolation --no-deps -e .)",
)
pytestmark = requires_native

# Dims that allow trainer TP 8 (test_ddma_plan's top out at TP 4), same style as its DIMS.
MORE_DIMS = {
    # GQA 16 heads / 8 kv: trainer TP up to 8; untied; vocab 300 padded on both sides
    "llama_kv8_untied": dict(model_type="llama", num_hidden_layers=4, hidden_size=64, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=4, intermediate_size=64, vocab_size=300),
    # qwen2 (qkv bias), MHA 8 heads, tied, vocab 250
    "qwen2_mha8_tied": dict(model_type="qwen2", num_hidden_layers=4, hidden_size=64, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=8, intermediate_size=128, vocab_size=250,
                            tie_word_embeddings=True),
    # kv 2 < generator TP 4/8 (vLLM replicates KV heads) with q/k/v biases (qwen2); vocab % 64 == 0
    "qwen2_kv2_bias": dict(model_type="qwen2", num_hidden_layers=4, hidden_size=32, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=4, intermediate_size=64, vocab_size=256,
                           ),
}
ALL_DIMS = {**DIMS, **MORE_DIMS}


def _dims(name: str) -> ModelDims:
    cfg = dict(rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(ALL_DIMS[name])
    return ModelDims.from_hf_config(cfg)


def _valid(d: ModelDims, ttp: int, pp: int, gtp: int) -> bool:
    try:
        validate_parallel(d, ttp, pp)
        validate_vllm_tp(d, gtp)
    except ValueError:
        return False
    return True


def _sample(n: int = 60) -> list[tuple]:
    grid = itertools.product(sorted(ALL_DIMS), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4))
    cases = [c for c in grid if _valid(_dims(c[0]), c[1], c[2], c[4])]
    must = [("llama_kv8_untied", 8, 4, 4, 8, 4),  # TP 8 on both sides, widest DP/replicas
            ("llama_kv8_untied", 8, 2, 2, 1, 2),  # TP 8 -> 1
            ("qwen2_kv2_bias", 2, 4, 4, 8, 2),    # kv 2 < generator TP 8: replicated KV heads
            ("qwen2_mha8_tied", 1, 4, 2, 8, 1),   # tied at PP > 1 (output-layer copy skipped)
            ("llama_kv2_tied", 2, 2, 4, 4, 4)]
    assert all(c in cases for c in must)
    rest = [c for c in cases if c not in must]
    return must + random.Random(20240611).sample(rest, n - len(must))


CASES = _sample()


def _plans(name, ttp, pp, dp, gtp, reps):
    d = _dims(name)
    src, dst = TrainerTopology(ttp, pp, dp), GeneratorTopology(gtp, reps)
    ref = plan_sync(d, src, dst, impl="ref")
    nat = plan_sync(d, src, dst, impl="native")
    return d, src, dst, ref, nat


@pytest.mark.parametrize("case", CASES, ids=str)
def test_native_plan_equals_reference(case):
    _, _, _, ref, nat = _plans(*case)
    assert nat is not ref
    assert list(nat.pairs) == list(ref.pairs)  # same pairs, same order
    for pair, copies in ref.pairs.items():
        got = nat.pairs[pair]
        assert type(got) is tuple and all(type(c) is Copy for c in got)
        assert got == copies, pair
    assert nat.src_shapes == ref.src_shapes and list(nat.src_shapes) == list(ref.src_shapes)
    assert nat.dst_shapes == ref.dst_shapes and list(nat.dst_shapes) == list(ref.dst_shapes)
    assert (nat.src, nat.dst) == (ref.src, ref.dst)
    assert nat.summary() == ref.summary()


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_native_plan_lands_vllm_shards(case):
    d, src, dst, _, plan = _plans(*case)
    hf = _random_hf(d, seed=sum(map(ord, str(case))))
    src_t = {r: hf_to_local(hf.__getitem__, local_param_layouts(d, src.tp, r.tp, src.pp, r.pp)) for r in src.ranks()}
    expected = {r: _expected_vllm(hf, d, dst.tp, r.tp) for r in dst.ranks()}
    dst_t = {r: {n: torch.zeros_like(e) for n, e in exp.items()} for r, exp in expected.items()}
    execute_plan_ref(plan, src_t, dst_t)
    for r, exp in expected.items():
        for n, e in exp.items():
            assert torch.equal(dst_t[r][n], e), (r, n)


def test_hand_made_layouts_sort_merge_and_first_holder():
    """Orders real layouts never produce: pieces listed against HF order (the runs' sort decides the
    copies), and one rank holding the same slice twice (the first listed holder sends)."""
    w = lambda hf_start, local_start: Piece("w", (4, 3), 0, hf_start, local_start, 2)  # noqa: E731
    whole = ParamLayout((4, 3), (Piece("w", (4, 3), 0, 0, 0, 4),))
    src_lay = {SrcRank(0, 0, 0): {"b": whole, "a": whole}}
    dst_lay = {DstRank(0, 0): {"crossed": ParamLayout((4, 3), (w(2, 0), w(0, 2))),
                               "reversed": ParamLayout((4, 3), (w(2, 2), w(0, 0)))}}
    src, dst = TrainerTopology(1, 1, 1), GeneratorTopology(1, 1)
    ref = _plan_layouts(src, dst, src_lay, dst_lay)
    assert dict(ref.pairs) == {(SrcRank(0, 0, 0), DstRank(0, 0)): (
        Copy("w", "b", 0, "crossed", 6, 6), Copy("w", "b", 6, "crossed", 0, 6), Copy("w", "b", 0, "reversed", 0, 12))}
    nat = plan_native.plan_layouts_native(src, dst, src_lay, dst_lay)
    assert list(nat.pairs.items()) == list(ref.pairs.items())


# ---------------------------------------------------------------- dispatch and caching

def test_impl_dispatch_and_cache(monkeypatch):
    d, src, dst = _dims("qwen2_kv2"), TrainerTopology(2, 2, 2), GeneratorTopology(4, 2)
    nat = plan_sync(d, src, dst, impl="native")
    assert plan_sync(d, src, dst) is nat and plan_sync(d, src, dst, impl="auto") is nat  # auto -> native, cached
    assert plan_sync(d, src, dst, impl="ref") is not nat
    with pytest.raises(ValueError, match="impl='fast'"):
        plan_sync(d, src, dst, impl="fast")
    # Without the C++ function: auto falls back to the reference, native says how to build it.
    monkeypatch.setattr(plan_native, "native_function", lambda name: None)
    assert plan_sync(d, src, dst) is plan_sync(d, src, dst, impl="ref")
    with pytest.raises(RuntimeError, match="plan_copies"):
        plan_native.plan_layouts_native(src, dst, source_layouts(d, src), destination_layouts(d, dst))
    assert native.native_function("no_such_function") is None


# ---------------------------------------------------------------- errors: the reference's ValueErrors

def _same_error(src, dst, src_lay, dst_lay, match: str) -> None:
    with pytest.raises(ValueError, match=match) as ref_err:
        _plan_layouts(src, dst, src_lay, dst_lay)
    with pytest.raises(ValueError) as nat_err:
        plan_native.plan_layouts_native(src, dst, src_lay, dst_lay)
    assert str(nat_err.value) == str(ref_err.value)


def _replace_piece(lay, rank, param, **changes):
    """A copy of one rank's layouts with the (only) piece of ``param`` changed; other ranks shared."""
    out = dict(lay)
    params = dict(lay[rank])
    layout = params[param]
    (piece,) = layout.pieces
    params[param] = dataclasses.replace(layout, pieces=(dataclasses.replace(piece, **changes),))
    out[rank] = params
    return out


SRC, DST = TrainerTopology(2, 1, 2), GeneratorTopology(2, 2)


def test_error_missing_tensor():
    small, big = _dims("llama_kv4_untied"), dataclasses.replace(_dims("llama_kv4_untied"), num_layers=4)
    _same_error(SRC, DST, source_layouts(small, SRC), destination_layouts(big, DST),
                re.escape("no trainer rank holds model.layers.2.input_layernorm.weight (needed by "
                          "DstRank(replica=0, tp=0) model.layers.2.input_layernorm.weight)"))


def test_error_not_covered():
    d = _dims("llama_kv4_untied")
    _same_error(SRC, DST, source_layouts(d, SRC), destination_layouts(dataclasses.replace(d, vocab_size=400), DST),
                r"DstRank\(replica=0, tp=1\) model.embed_tokens.weight: model.embed_tokens.weight rows "
                r"\[224, 400\) are covered 76/176 by the trainer")


def test_error_overlapping_sources():
    d = _dims("llama_kv4_untied")
    lay = source_layouts(d, SRC)
    rank = sorted(lay)[-1]  # SrcRank(tp=1, pp=0, dp=1): o_proj columns [32, 64) -> [16, 48)
    bad = _replace_piece(lay, rank, "decoder.layers.0.self_attention.linear_proj.weight", hf_start=16)
    _same_error(SRC, DST, bad, destination_layouts(d, DST),
                re.escape("source pieces of model.layers.0.self_attn.o_proj.weight overlap without being replicas"))


def test_error_mixed_dims():
    d, src = _dims("llama_kv4_untied"), TrainerTopology(1, 1, 1)
    lay = source_layouts(d, src)
    name = "model.layers.1.self_attn.o_proj.weight"
    (rank,) = lay
    whole = Piece(name, (64, 64), 0, 0, 0, 64)  # the whole tensor, described along dim 0 instead of 1
    bad = _replace_piece(lay, rank, "decoder.layers.1.self_attention.linear_proj.weight", **vars(whole))
    _same_error(src, DST, bad, destination_layouts(d, DST),
                re.escape(f"{name}: source split on dim 0, destination on dim 1; mixed-dim planning"))
