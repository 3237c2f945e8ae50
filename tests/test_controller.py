"""`megarl train` end to end on a tiny model: real Megatron trainer, real vLLM generator, real
math-verify reward, weights pushed after every step; then a resumed run continues the same job."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _train(model_dir: Path, out_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
           f"model.path={model_dir}", f"logging.out_dir={out_dir}", "controller.eval_every=2",
           "data.eval_size=4", "trainer.checkpoint_interval=1", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_runs_end_to_end_and_resumes(tiny_llama_dir, tmp_path):
    out = _train(tiny_llama_dir, tmp_path, "controller.steps=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "tiny-test"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the untrained model's eval accuracy
    assert 0.0 <= rows[0]["eval/accuracy"] <= 1.0
    for r in rows[1:]:
        # 4 prompts x 2 samples, every phase timed, the loss and the sampler/learner gap finite
        assert r["gen/samples"] == 8
        assert all(r[f"time/{p}"] >= 0 for p in ("generate", "reward", "train", "sync", "idle"))
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        # bf16 engine vs fp32 trainer on the same weights: close, not equal
        assert 0 <= r["train/loss/mismatch"] < 0.1
        assert r["train/tokens"] > 0
    assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0
    assert "step 2/2" in out.stdout and "generate" in out.stdout  # the per-step phase line
    assert (run / "checkpoints" / "step_00000002").is_dir()
    assert (run / "metrics.png").is_file()
    assert any((run / "tensorboard").iterdir())

    # Resume: same run folder, one more step; it continues at step 3 from the saved state.
    out = _train(tiny_llama_dir, tmp_path, "controller.steps=3", "trainer.resume_from=auto")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3]  # no second baseline on resume
    assert "resuming from" in out.stdout


def test_train_reports_unsupported_layout_before_starting(tiny_llama_dir, tmp_path):
    out = _train(tiny_llama_dir, tmp_path, "trainer.tp=2")
    assert out.returncode == 2
    assert "trainer.tp=2" in out.stderr and "single-rank" in out.stderr
