"""The papers' recipes (configs/recipes/) pass `megarl train RECIPE --dry-run` on this CPU machine,
without the weights or the data, and print a per-GPU memory plan; the plan's accounting matches
published figures; a layout that does not fit is refused naming the knob. Fast: no torch, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError, load_config
from megarl.config.memory import (GB, activation_bytes_per_layer, param_counts, plan_for, state_bytes_per_param,
                                  trainer_rank_params)
from megarl.models.dims import ModelDims

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
PLAN_LINE = re.compile(r"^#   (trainer|generator), per GPU: +([\d.]+) GB of (\d+)", re.M)


def test_there_is_a_recipe_per_seed_setup():
    names = {p.stem for p in RECIPES}
    assert {"llamarl_llama31_8b_math", "a3po_qwen3_8b_dapo_math", "a3po_qwen25_15b_gsm8k",
            "vaco_qwen25_05b_gsm8k"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_passes_dry_run_with_a_memory_plan(recipe, capsys):
    text = recipe.read_text()
    # each says where its numbers come from, its GPU layout and how to submit it
    assert re.search(r"sec\. \d|Appendix|Table \d", text) and "GPU layout:" in text
    # papers cited by arXiv id, never by a path on some machine
    assert re.search(r"arXiv \d{4}\.\d{5}", text) and not re.search(r"/work/|seeds/|/home/|/tmp/", text)
    assert re.search(r"^# Run: +sbatch .*launch/slurm.*\.sbatch configs/recipes/" + re.escape(recipe.name), text, re.M)
    assert main(["train", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = PLAN_LINE.findall(out)
    assert [role for role, _, _ in plan] == ["trainer", "generator"], out[-2000:]
    for _, used, of in plan:
        assert 1.0 < float(used) <= float(of)
    assert "#   weight sync: " in out and "# ranks: trainer tp" in out


def test_an_oversized_layout_is_one_line_naming_the_knob(capsys):
    llamarl = str(REPO / "configs" / "recipes" / "llamarl_llama31_8b_math.yaml")
    cases = [(["trainer.micro_batch_size=8"], r"^trainer\.tp=1 trainer\.pp=1: [\d.]+ GB per GPU .* does not fit "
                                              r"80 GB \(cluster\.gpu_memory_gb\); set trainer\.tp=\d+"),
             (["cluster.gpu_memory_gb=16"], r"^generator\.tp=1: weights 16\.1 GB per GPU leave no room .*; set "
                                            r"generator\.tp=\d+"),
             (["generator.gpu_memory_utilization=0", "generator.kv_cache_gib=70"],
              r"^generator\.kv_cache_gib=70: weights 16\.1 GB \+ KV cache 75\.2 GB .* set generator\.kv_cache_gib=\d+ "
              r"or less$")]
    for overrides, pattern in cases:
        assert main(["train", llamarl, *overrides, "--dry-run"]) == 2
        err = capsys.readouterr().err
        problems = [ln.removeprefix("  - ") for ln in err.splitlines() if ln.startswith("  - ")]
        assert any(re.search(pattern, p) for p in problems), err
        assert all("\n" not in p for p in problems)


def test_a_plan_needs_no_local_model_but_a_real_run_does():
    llamarl = REPO / "configs" / "recipes" / "llamarl_llama31_8b_math.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(llamarl)
    assert any(p.startswith("model.path='meta-llama/Llama-3.1-8B-Instruct': no such folder and not an HF id in the "
                            "local HF cache") for p in err.value.problems), err.value.problems
    assert any(p.startswith("data.train_path='data/MATH-lighteval/data/train-*.parquet': the pattern matches no file")
               for p in err.value.problems), err.value.problems
    cfg = load_config(llamarl, dry_run=True)
    assert cfg.reward.fn == "auto" and "decided when the job starts" in cfg.data.choice


def test_an_hf_id_resolves_to_the_local_hf_cache(tmp_path, monkeypatch):
    from megarl.utils.model_source import local_model_dir, shipped_config

    snap = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((REPO / "configs" / "models" / "qwen3-8b.json").read_text())
    (tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_model_dir("Qwen/Qwen3-8B") == snap
    assert local_model_dir("Qwen/Qwen3-4B") is None
    assert shipped_config("meta-llama/Llama-3.1-8B-Instruct") == REPO / "configs" / "models" / "llama-3.1-8b.json"


# ---------------------------------------------------------------------------------------------
# The accounting, against published figures


def _dims(name: str) -> ModelDims:
    import json

    return ModelDims.from_hf_config(json.loads((REPO / "configs" / "models" / name).read_text()))


def test_optimizer_state_matches_megatron_and_zero_tables():
    # Megatron-LM docs, "Distributed Optimizer": bf16 params + fp32 grads: 18 bytes/param without it,
    # 6 + 12/d with it.
    assert sum(state_bytes_per_param("bfloat16", dp=8, distributed=False)) == 18
    for d in (1, 8, 64):
        assert sum(state_bytes_per_param("bfloat16", dp=d, distributed=True)) == pytest.approx(6 + 12 / d)
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B params, mixed-precision Adam: 120 GB per GPU as
    # baseline, 31.4 GB with optimizer-state partitioning over 64 GPUs (2-byte gradients).
    assert sum(state_bytes_per_param("bfloat16", dp=64, distributed=False, grad_bytes=2)) * 7.5e9 / GB == 120
    assert round(sum(state_bytes_per_param("bfloat16", dp=64, distributed=True, grad_bytes=2)) * 7.5e9 / GB, 1) == 31.4
    # fp32 weights need no master copy
    assert state_bytes_per_param("float32", dp=1, distributed=True) == (4, 4, 8)


def test_activations_reduce_to_korthikanti_for_gpt():
    """Korthikanti et al. 2022, selective recompute, TP without SP: s b h (10 + 24 / t) bytes per layer
    for GPT (kv = h, GeLU 4h MLP keeping 2 FFN-wide tensors)."""
    gpt = ModelDims(family="llama", num_layers=1, hidden_size=12288, num_heads=96, num_kv_heads=96, head_dim=128,
                    ffn_hidden_size=4 * 12288, vocab_size=51200, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=2048, tie_word_embeddings=True, qkv_bias=False)
    s, b, h = 2048, 1, 12288
    for t in (1, 8):
        assert activation_bytes_per_layer(gpt, s, b, t, mlp_tensors=2) == pytest.approx(s * b * h * (10 + 24 / t))


def test_parameter_counts_are_the_published_sizes():
    assert param_counts(_dims("llama-3.1-8b.json"))["total"] == 8_030_261_248  # Llama 3.1 8B
    qwen05 = param_counts(_dims("qwen2.5-0.5b.json"))
    assert qwen05["head"] == 0 and qwen05["total"] == 494_032_768  # Qwen2.5-0.5B (tied): 0.49B
    # the TP shards of a rank add up to the model (plus vocab padding rows)
    d = _dims("llama-3.1-8b.json")
    assert 0 <= 2 * trainer_rank_params(d, 2, 1) - 8_030_261_248 < 2 * 128 * d.hidden_size * 2


def test_plan_numbers_for_the_8b_recipe():
    cfg = load_config(REPO / "configs" / "recipes" / "llamarl_llama31_8b_math.yaml", dry_run=True)
    plan = plan_for(cfg)
    # vocab 128,256 is a multiple of 128: no padding rows, so the rank holds exactly the HF elements
    assert plan.trainer["weights"] == pytest.approx(2 * 8_030_261_248, rel=1e-3)
    assert plan.trainer["gradients"] == pytest.approx(4 * 8_030_261_248, rel=1e-3)
    assert plan.trainer["optimizer"] == pytest.approx(12 * 8_030_261_248 / 32, rel=1e-3)
    assert plan.generator["weights"] == pytest.approx(2 * 8_030_261_248, rel=1e-6)
    # logits [2560 tokens, 128256] at their real size: bf16 output 2 + fp32 copy 4 + fp32 grad 4 + bf16 grad 2
    # (tests/e2e/test_memory_plan.py has every term)
    assert plan.trainer["logits"] == 2560 * 128_256 * 12
    assert plan.problems == []
