"""Every recipe of configs/recipes/ runs end to end here, scaled down: the recipe file itself with only
what must shrink overridden (a tiny random model of the recipe's family, tiny data files of the recipe's
row schemas, a few steps and prompts, short replies, one CPU rank each side, fp32), through `megarl
train` for real (Megatron + vLLM on CPU). What the recipe sets stays: the loss and its knobs,
trainer.minibatches / epochs, max_policy_lag, the prompt instruction, the reward, the eval sets and
their scoring. Asserted from metrics.jsonl: each step made minibatches x epochs updates, the recipe's
loss ran (its own metric), A-3PO's staleness bound reaches d = 2 where alpha < 1, and LlamaRL's three
eval sets are each logged under their names.

Planted breaks seen failing (then restored): PromptSource.eval_sets() returning only the first set
fails LlamaRL's eval/math/n (KeyError); A-3PO's Setup 1 recipe at max_policy_lag 1 fails alpha < 1 at
step 3 (d <= 1: alpha = 1); the trainer splitting a step into one minibatch whatever
trainer.minibatches says (train_step.py) fails VACO's train/updates (1 != 4).
About a minute per recipe on 2 cores (mostly engine and trainer start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config

REPO = Path(__file__).resolve().parents[2]
GSM8K = REPO / "tests" / "data" / "gsm8k" / "train_head50.jsonl"
LOSS_METRIC = {"a3po": "a3po/alpha_mean", "vaco": "vaco/tv", "aipo": "aipo/weight_mean"}

# What shrinks, for every recipe: one CPU rank each side (the engine on both cores), fp32 on both sides,
# 2 replies of 8 tokens per prompt, 2 held-out prompts per set, no checkpoints.
SHRINK = ["cluster.device=cpu", "cluster.launcher=local", "cluster.gpu_memory_gb=0", "trainer.tp=1", "trainer.pp=1",
          "trainer.dp=1", "trainer.micro_batch_size=4", "trainer.params_dtype=float32", "trainer.checkpoint_interval=0",
          "generator.tp=1", "generator.replicas=1", "generator.threads_bind=0-1", "generator.enforce_eager=true",
          "generator.dtype=float32", "generator.n_samples=2", "generator.max_new_tokens=8",
          "generator.max_model_len=512", "data.max_prompt_tokens=400", "data.eval_size=2"]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _math(path: Path, start: int, n: int) -> str:
    return _jsonl(path, [{"problem": f"What is {i} plus {i + 3}?", "solution": f"It is $\\boxed{{{2 * i + 3}}}$.",
                          "level": "Level 1", "type": "Algebra"} for i in range(start, start + n)])


def _data(recipe: str, tmp: Path) -> list[str]:
    """The recipe's data paths pointed at tiny files of the same row schemas."""
    gsm = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    if recipe in ("a3po_qwen25_15b_gsm8k", "vaco_qwen25_05b_gsm8k"):
        return [f"data.train_path={_jsonl(tmp / 'gsm_train.jsonl', gsm[:40])}",
                f"data.eval_path={_jsonl(tmp / 'gsm_test.jsonl', gsm[40:])}"]
    if recipe == "a3po_qwen3_8b_dapo_math":  # verl rows: the prompt as chat messages, the gold in reward_model
        rows = [{"data_source": "math_dapo", "ability": "MATH",
                 "prompt": [{"role": "user", "content": f"Solve: what is {i} times 3? The last line of your response "
                                                        f"should be of the form Answer: $Answer."}],
                 "reward_model": {"style": "rule", "ground_truth": str(3 * i)}} for i in range(24)]
        return [f"data.train_path={_jsonl(tmp / 'dapo.jsonl', rows)}"]
    if recipe == "llamarl_llama31_8b_math":
        return [f"data.train_path={_math(tmp / 'math_train.jsonl', 0, 24)}",
                f"data.eval_paths=[math500={_math(tmp / 'math500.jsonl', 100, 3)}, "
                f"math={_math(tmp / 'math_test.jsonl', 100, 6)}, gsm8k={_jsonl(tmp / 'gsm_test.jsonl', gsm[40:])}]"]
    return []  # calculator: builtin:arithmetic


MODEL = {"a3po_qwen25_15b_gsm8k": "tiny_qwen2_dir", "vaco_qwen25_05b_gsm8k": "tiny_qwen2_dir",
         "calculator_qwen25_15b_arithmetic": "tiny_qwen2_dir", "a3po_qwen3_8b_dapo_math": "tiny_qwen3_dir",
         "llamarl_llama31_8b_math": "tiny_llama_dir"}


@pytest.mark.parametrize("recipe", sorted(MODEL))
def test_recipe_runs_end_to_end_scaled_down(recipe, tmp_path, request):
    path = REPO / "configs" / "recipes" / f"{recipe}.yaml"
    model = request.getfixturevalue(MODEL[recipe])
    recipe_cfg = load_config(path, dry_run=True)
    # A-3PO: 3 steps, so a bound of 2 is reached (batch 3 is admitted with batches 1-2, at version 0, and
    # trained at version 2: d = 2, alpha = 1/2)
    steps = 3 if recipe_cfg.algorithm.loss == "a3po" else 2
    # one prompt per minibatch: prompts_per_step stays divisible by trainer.minibatches
    prompts = recipe_cfg.trainer.minibatches if recipe_cfg.trainer.minibatches > 1 else 2
    overrides = [f"model.path={model}", f"logging.out_dir={tmp_path / 'runs'}", *SHRINK, *_data(recipe, tmp_path),
                 f"controller.steps={steps}", f"controller.eval_every={steps}", f"controller.prompts_per_step={prompts}"]
    cfg = load_config(path, overrides)  # the run's own config: the recipe's choices kept, what shrank shrunk
    assert (cfg.algorithm.loss, cfg.trainer.minibatches, cfg.trainer.epochs, cfg.controller.max_policy_lag) == \
        (recipe_cfg.algorithm.loss, recipe_cfg.trainer.minibatches, recipe_cfg.trainer.epochs,
         recipe_cfg.controller.max_policy_lag)
    out = subprocess.run([sys.executable, "-m", "megarl", "train", str(path), *overrides], capture_output=True,
                         text=True, timeout=900, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / cfg.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1))  # step 0: the baseline eval
    for r in rows[1:]:
        assert r["train/updates"] == cfg.trainer.minibatches * cfg.trainer.epochs, r["train/updates"]
        assert f"train/loss/{LOSS_METRIC[cfg.algorithm.loss]}" in r  # the recipe's loss ran
        assert r["gen/samples"] == prompts * 2 and r["lag/max"] <= cfg.controller.max_policy_lag
    if cfg.algorithm.loss == "a3po":
        # alpha = 1/d over the step's tokens (the sampler's weight): 1 at d <= 1, 1/2 at d = 2 (the bound),
        # so 1/2 <= mean < 1
        assert rows[1]["train/loss/a3po/alpha_mean"] == 1.0
        assert 0.5 <= rows[3]["train/loss/a3po/alpha_mean"] < 1.0 and rows[3]["lag/max"] == 2.0
    for r in (rows[0], rows[-1]):
        if cfg.data.eval_paths:  # each set under its own name, the first also as the headline
            for name, n in (("math500", 2), ("math", 2), ("gsm8k", 2)):
                assert r[f"eval/{name}/n"] == n and 0.0 <= r[f"eval/{name}/accuracy"] <= 1.0, (name, r)
            assert r["eval/accuracy"] == r["eval/math500/accuracy"] and r["eval/n"] == 2
        else:
            assert r["eval/n"] == 2 and 0.0 <= r["eval/accuracy"] <= 1.0
