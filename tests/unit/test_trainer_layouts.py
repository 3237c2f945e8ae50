"""Pure layout tests (no Megatron): HF <-> per-rank Megatron pieces, checked against independent
reshape-based references and by exact round trips."""

import pytest
import torch

from megarl.models.layouts import (ModelDims, hf_tensor_shapes, hf_to_local, local_param_layouts, local_to_hf,
                                    padded_vocab_size, validate_parallel)


def _dims(**kw):
    cfg = dict(model_type="llama", num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
               head_dim=16, intermediate_size=96, vocab_size=300, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(kw)
    return ModelDims.from_hf_config(cfg)


def _random_hf(dims, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_tensor_shapes(dims).items()}


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("norm_style", ["local", "te"])
def test_round_trip_exact(family, tied, tp, pp, norm_style):
    dims = _dims(model_type=family, tie_word_embeddings=tied)
    hf = _random_hf(dims)
    ranks = []
    for pr in range(pp):
        for tr in range(tp):
            lay = local_param_layouts(dims, tp, tr, pp, pr, norm_style=norm_style)
            ranks.append((lay, hf_to_local(hf.__getitem__, lay)))
    back = local_to_hf(ranks, dims)
    assert set(back) == set(hf)
    assert ("lm_head.weight" in back) == (not tied)
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in back
    for n in hf:
        assert torch.equal(back[n], hf[n]), n


def _reference_qkv(q, k, v, nq, ng, hd):
    """Independent construction of Megatron's TP=1 fused qkv: per group [q heads; k; v]."""
    tail = q.shape[1:]
    qg = q.reshape(ng, (nq // ng) * hd, *tail)
    kg = k.reshape(ng, hd, *tail)
    vg = v.reshape(ng, hd, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_and_fc1_match_reference(tp):
    dims = _dims(model_type="qwen2")
    hf = _random_hf(dims)
    p = "model.layers.1"
    full_w = _reference_qkv(hf[f"{p}.self_attn.q_proj.weight"], hf[f"{p}.self_attn.k_proj.weight"],
                            hf[f"{p}.self_attn.v_proj.weight"], 8, 4, 16)
    full_b = _reference_qkv(hf[f"{p}.self_attn.q_proj.bias"], hf[f"{p}.self_attn.k_proj.bias"],
                            hf[f"{p}.self_attn.v_proj.bias"], 8, 4, 16)
    gate, up = hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]
    for tr in range(tp):
        local = hf_to_local(hf.__getitem__, local_param_layouts(dims, tp, tr, 1, 0))
        # whole groups per rank -> TP shards of the TP=1 tensor are contiguous row chunks
        assert torch.equal(local["decoder.layers.1.self_attention.linear_qkv.weight"], full_w.chunk(tp)[tr])
        assert torch.equal(local["decoder.layers.1.self_attention.linear_qkv.bias"], full_b.chunk(tp)[tr])
        assert torch.equal(local["decoder.layers.1.mlp.linear_fc1.weight"],
                           torch.cat([gate.chunk(tp)[tr], up.chunk(tp)[tr]]))
        assert torch.equal(local["decoder.layers.1.mlp.linear_fc2.weight"],
                           hf[f"{p}.mlp.down_proj.weight"].chunk(tp, dim=1)[tr])
        assert torch.equal(local["decoder.layers.1.self_attention.linear_proj.weight"],
                           hf[f"{p}.self_attn.o_proj.weight"].chunk(tp, dim=1)[tr])


def test_vocab_padding_and_pp_assignment():
    dims = _dims()
    assert padded_vocab_size(300, 2) == 512 and padded_vocab_size(256, 1) == 256
    hf = _random_hf(dims)
    lay = local_param_layouts(dims, 2, 1, 2, 1)  # last stage, second TP rank
    local = hf_to_local(hf.__getitem__, lay)
    out = local["output_layer.weight"]
    assert out.shape == (256, 64)
    assert torch.equal(out[:44], hf["lm_head.weight"][256:300])
    assert torch.count_nonzero(out[44:]) == 0  # padding rows
    assert "embedding.word_embeddings.weight" not in lay
    # stage 1 of 2 holds global layers 2,3 as local 0,1
    assert torch.equal(local["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])
    assert "decoder.layers.2.input_layernorm.weight" not in local


def test_tied_pp_last_stage_copies_embedding():
    dims = _dims(tie_word_embeddings=True)
    assert "output_layer.weight" not in local_param_layouts(dims, 1, 0, 1, 0)
    lay = local_param_layouts(dims, 1, 0, 2, 1)
    assert lay["output_layer.weight"].pieces[0].hf_name == "model.embed_tokens.weight"


@pytest.mark.parametrize("kw,tp,pp,needle", [
    (dict(num_attention_heads=9, num_key_value_heads=3, head_dim=16), 2, 1, "num_attention_heads=9"),
    (dict(num_key_value_heads=2), 4, 1, "num_key_value_heads=2"),
    (dict(), 1, 3, "num_hidden_layers=4"),
])
def test_bad_parallel_names_the_key(kw, tp, pp, needle):
    with pytest.raises(ValueError, match=needle):
        validate_parallel(_dims(**kw), tp, pp)


def test_unsupported_config_names_the_key():
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        _dims(model_type="gpt2")
    with pytest.raises(ValueError, match="rope_type='llama3'"):
        _dims(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
