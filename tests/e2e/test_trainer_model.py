"""Megatron GPTModel built from HF configs: logits vs transformers, logprobs across TP/PP,
checkpoint conversion round trips, clear errors."""

from __future__ import annotations

import pytest
import torch

from megarl.utils.dist import run_multiprocess
from tests.harness.trainer_model import _hf_logits, _hf_logprobs, _sample_batch


def _model_worker(rank, world, tp, pp, source, kind, batch, temperature, want_logits):
    """Build at (tp, pp), load weights from an HF dir (kind='hf') or a Megatron checkpoint ('mcore')."""
    from megarl.trainer.convert import load_pretrained, read_meta
    from megarl.models.layouts import ModelDims
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp, pp, seed=123)
    cfg = read_hf_config(source) if kind == "hf" else read_meta(source)["hf_config"]
    model = build_gpt_model(ModelDims.from_hf_config(cfg))
    assert load_pretrained(model, source) == kind
    out = {"logprobs": compute_logprobs(model, batch, micro_batch_size=2, temperature=temperature,
                                        with_entropy=True)}
    if want_logits:  # TP=1 PP=1 only: the full (padded) vocab is local
        with torch.no_grad():
            out["logits"] = model(**batch.model_inputs())
    return out


@pytest.mark.parametrize("fixture,temperature", [("tiny_llama_dir", 1.0), ("tiny_qwen2_dir", 0.7),
                                                 ("tiny_llama_tied_dir", 1.0), ("tiny_llama32_dir", 1.0),
                                                 ("tiny_qwen3_dir", 0.7), ("tiny_mistral_dir", 1.0)])
def test_logits_match_transformers(fixture, temperature, request):
    from megarl.trainer.logprobs import valid_token_mask

    hf_dir = request.getfixturevalue(fixture)
    batch = _sample_batch(49152)
    ref = _hf_logits(hf_dir, batch)
    (res,) = run_multiprocess(_model_worker, 1, 1, 1, str(hf_dir), "hf", batch, temperature, True, timeout_s=300)
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    ours = res["logits"][..., :ref.shape[-1]]
    # both fp32, other kernels: a 128-term logit dot with sum|terms| ~10 rounds by <= 128 * 2^-24 * 10 ~ 8e-5
    assert (ours - ref)[valid].abs().max() < 1e-4
    assert res["logits"].shape[-1] == 49152  # 49152 is already a multiple of 128: no padding at TP=1
    # logprob = z_y/T - lse(z/T): each term moves by at most max|dz| / T, so twice the logits' bound over T
    assert torch.allclose(res["logprobs"].logprobs, _hf_logprobs(ref, batch, temperature), atol=2e-4 / temperature)
    # T 1.3 vs 1.0 changes logprobs (|lp| ~ ln 49152 ~ 11) by O(1): far above 1e-2
    assert not torch.allclose(res["logprobs"].logprobs, _hf_logprobs(ref, batch, 1.3), atol=1e-2)
    # entropy of the tempered real-vocab distribution
    p = torch.softmax(ref.double() / temperature, -1)
    ent = -(p * torch.log(p)).sum(-1)[:, :-1].float()
    # H moves by <= max|dz| * E|z - Ez| ~ 1e-4 (logit std ~1) + a fp32 49152-term sum ~1e-5
    assert torch.allclose(res["logprobs"].entropy, torch.nn.functional.pad(ent, (1, 0)) * valid_token_mask(batch),
                          atol=1e-4)


# ---------------------------------------------------------------- conversion + parallel layouts

@pytest.fixture(scope="module")
def mcore_ckpts(tmp_path_factory, tiny_llama_dir, tiny_llama_tied_dir, tiny_qwen2_dir, tiny_llama32_dir,
                tiny_qwen3_dir, tiny_mistral_dir):
    """The tiny models of every family converted at TP=2 x PP=2 (4 ranks), keyed by name."""
    from megarl.trainer.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("mcore")
    sources = {"llama": tiny_llama_dir, "llama_tied": tiny_llama_tied_dir, "qwen2": tiny_qwen2_dir,
               "llama32": tiny_llama32_dir, "qwen3": tiny_qwen3_dir, "mistral": tiny_mistral_dir}
    return {name: (hf, hf_to_mcore(hf, root / name, tp=2, pp=2)) for name, hf in sources.items()}


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "llama32", "qwen3", "mistral"])
def test_round_trip_tp2_pp2_exact(name, mcore_ckpts, tmp_path):
    from megarl.trainer.convert import HFReader, mcore_to_hf

    hf_dir, ckpt = mcore_ckpts[name]
    out = mcore_to_hf(ckpt, tmp_path / "hf")  # loads at TP=1 PP=1: resharding on load
    a, b = HFReader(hf_dir), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        ta, tb = a(n), b(n)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), n
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / f).is_file(), f
    import json
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


LAYOUTS = [(2, 2), (2, 1), (1, 2), (1, 1)]


def _layouts_worker(rank, world, ckpt, wrong_ckpt, batch):
    """On 4 ranks: logprobs at every layout, shard specs at TP2xPP2, a mismatching checkpoint."""
    from megarl.trainer.convert import load_model_checkpoint, read_meta
    from megarl.models.layouts import ModelDims
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model
    from megarl.trainer.shards import local_shard_specs
    from megarl.utils.dist import init_model_parallel

    dims = ModelDims.from_hf_config(read_meta(ckpt)["hf_config"])
    out = {"logprobs": {}}
    for tp, pp in LAYOUTS:
        init_model_parallel(tp, pp, seed=7)
        # vocab 49152 padded to a multiple of 5*tp (49155 / 49160): the checkpoint (saved with 128*tp
        # padding) reshards into other padding, and the padded logit columns must be masked
        model = build_gpt_model(dims, vocab_divisible_by=5)
        load_model_checkpoint(model, ckpt)
        out["logprobs"][(tp, pp)] = compute_logprobs(model, batch, micro_batch_size=2, with_entropy=True)
        if (tp, pp) == (2, 2):
            params = dict(model.named_parameters())
            specs = local_shard_specs(model)
            out["padded_rows"] = model.embedding.word_embeddings.weight.shape[0] if pp == 2 and rank < 2 else None
            out["specs"] = [(s.describe(), s.local_view.clone(), s.local_view.is_contiguous(),
                             s.local_view.untyped_storage().data_ptr()
                             == params[s.mcore_name].untyped_storage().data_ptr()) for s in specs]
    try:
        load_model_checkpoint(model, wrong_ckpt)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_logprobs_equal_across_layouts_and_shard_specs(mcore_ckpts):
    from megarl.trainer.convert import HFReader
    from megarl.trainer.shards import ShardSpec, reassemble

    hf_dir, ckpt = mcore_ckpts["llama_tied"]
    batch = _sample_batch(49152, seed=3)
    results = run_multiprocess(_layouts_worker, 4, str(ckpt), str(mcore_ckpts["qwen2"][1]), batch, timeout_s=600)
    ref = results[0]["logprobs"][(1, 1)]
    # the fp32 HF-vs-megatron logprob bound of test_logits_match_transformers
    assert torch.allclose(ref.logprobs, _hf_logprobs(_hf_logits(hf_dir, batch), batch), atol=1e-4)
    for r in results:
        for layout, lp in r["logprobs"].items():
            # same kernels, sums only split by TP/PP: a few fp32 ulps of |lp| ~ 11 (ulp 9.5e-7); 1e-5 ~ 10 ulps
            assert (lp.logprobs - ref.logprobs).abs().max() < 1e-5, layout
            assert (lp.entropy - ref.entropy).abs().max() < 1e-5, layout  # as above, H <= ln 49152 ~ 10.8
    # every rank's pieces (views of live parameter memory) reassemble the HF tensors exactly
    specs = []
    for r in results:
        for desc, view, contiguous, same_storage in r["specs"]:
            assert contiguous and same_storage, desc
            specs.append(ShardSpec(desc["hf_name"], tuple(desc["global_shape"]), desc["dim"], desc["start"],
                                   desc["length"], view, desc["mcore_name"], desc["is_tied_copy"]))
    assert results[0]["padded_rows"] == 49160 // 2
    assert any(s.is_tied_copy for s in specs)  # PP=2 tied: last stage holds an embedding copy
    full = reassemble(specs)
    hf = HFReader(hf_dir)
    assert sorted(full) == hf.names()
    for n in hf.names():
        assert torch.equal(full[n], hf(n)), n
    # a checkpoint of another architecture fails naming the differing HF config keys
    msg = results[0]["mismatch"]
    assert msg is not None and "does not match the model's config" in msg
    assert "model_type" in msg and "attention_bias" in msg and "tie_word_embeddings" in msg


def test_bad_tp_names_the_problem(tiny_llama_dir, tmp_path):
    from megarl.trainer.convert import hf_to_mcore

    with pytest.raises(ValueError, match=r"tp=3 does not divide the HF config num_attention_heads=4"):
        hf_to_mcore(tiny_llama_dir, tmp_path / "x", tp=3, pp=1)
    with pytest.raises(ValueError, match=r"pp=4 does not divide the HF config num_hidden_layers=2"):
        hf_to_mcore(tiny_llama_dir, tmp_path / "y", tp=1, pp=4)


def test_bad_tp_when_building_the_model(tiny_llama_dir):
    # num_key_value_heads=2 with tp=4: the model config builder refuses, naming key and tp
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import read_hf_config, transformer_config

    dims = ModelDims.from_hf_config(read_hf_config(tiny_llama_dir))
    with pytest.raises(ValueError, match=r"tp=4 does not divide the HF config num_key_value_heads=2"):
        transformer_config(dims, tp=4, pp=1)


FP32_NOISE_FACTOR = 4  # see test_smollm2_logits_match_transformers


def test_smollm2_logits_match_transformers(smollm2_dir):
    """SmolLM2-135M (30 layers, 9 heads / 3 KV heads, tied, bf16 weights) in fp32 on both sides."""
    import time

    batch = _sample_batch(49152, seed=5)
    t0 = time.monotonic()
    ref = _hf_logits(smollm2_dir, batch)
    (res,) = run_multiprocess(_model_worker, 1, 1, 1, str(smollm2_dir), "hf", batch, 1.0, True, timeout_s=600)
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    diff = (res["logits"][..., :ref.shape[-1]] - ref)[valid].abs().max()
    # The bound is the reference's own fp32 rounding on these tokens (transformers fp32 against float64),
    # not a number from one machine: two fp32 implementations each that far from the exact logits differ
    # by up to twice it, and x2 again for sums accumulated in another order (other kernels, other CPUs)
    noise = (ref - _hf_logits(smollm2_dir, batch, torch.float64))[valid].abs().max()
    bound = FP32_NOISE_FACTOR * float(noise)
    print(f"SmolLM2 max |logit diff| = {diff:.2e}, transformers' own fp32 noise {noise:.2e}, bound {bound:.2e} "
          f"({time.monotonic() - t0:.1f} s)")
    assert 0 < noise and diff < bound, (float(diff), bound)
    # logprob = z_y - lse(z): each term moves by at most max|dz|, so the logprobs by twice the logits' bound
    assert torch.allclose(res["logprobs"].logprobs, _hf_logprobs(ref, batch), atol=2 * bound)


@pytest.mark.slow
def test_smollm2_round_trip_tp3_pp2_exact(smollm2_dir, tmp_path):
    """SmolLM2 at its natural TP (9 heads / 3 KV heads: one query group per rank), 6 ranks, bf16."""
    from megarl.trainer.convert import HFReader, hf_to_mcore, mcore_to_hf

    ckpt = hf_to_mcore(smollm2_dir, tmp_path / "mcore", tp=3, pp=2)
    out = mcore_to_hf(ckpt, tmp_path / "hf")
    a, b = HFReader(smollm2_dir), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        ta, tb = a(n), b(n)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), n
