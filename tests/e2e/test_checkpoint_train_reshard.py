"""`megarl train`-level resume at another layout: one tp1 checkpoint (controller.deterministic, fp32,
lag 0, written in the background: trainer.async_save) resumed at tp1, tp2 and pp2 gives the same step-3
grad norm and step-4 loss within 1e-4 relative (derived below); the same resume with a fresh optimizer
(trainer.resume_optimizer=false, the weights-only start) does not. The step-3 grad norm is computed
from the resumed weights on the resumed data (before any update); the step-4 loss comes after the
step-3 update, so it checks the resharded optimizer state. `megarl convert mcore-to-hf` exports the
async-written checkpoint too. Five tiny `megarl train` jobs (~4-6 min on 2 shared cores): slow.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# lr 1e-3 (tiny_test's 2e-5 moves the tiny model too little for a fresh optimizer to show in one step)
# entropy_coef: the random tiny model scores reward 0, so the advantages are 0; the entropy bonus gives every
# step a loss and a gradient that depend on the weights (without it loss and grad norm are 0 at any layout).
COMMON = ("controller.deterministic=true", "controller.max_policy_lag=0", "controller.eval_every=0",
          "algorithm.entropy_coef=0.01",
          "trainer.async_save=true", "trainer.lr=1e-3", "trainer.min_lr=1e-4", "trainer.lr_warmup_steps=0")
# Resharded fp32: the same weights, sums reordered over TP shards / PP stages: ~sqrt(n) * 2^-24 relative
# per reduction of n <= 512 terms (~1.3e-6). Adam's update m / sqrt(v) carries the same relative error, a
# few reductions deep per layer and through 2 steps: ~1e-5 at most. REL allows 10x that. The issue's own
# bar (1e-3) let a partly lost Adam state pass: a fresh optimizer lands only ~2e-3 away, so the control
# below must clear 10 * REL, not just REL.
REL = 1e-4


def _train(out: Path, model_dir: Path, *extra: str) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"), f"model.path={model_dir}",
           f"logging.out_dir={out}", *COMMON, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "tiny-test" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "train/loss" in r], done.stdout + done.stderr


def _export(step_dir: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    done = subprocess.run([sys.executable, "-m", "megarl", "convert", "mcore-to-hf", "--mcore", str(step_dir),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return load_file(str(out / "model.safetensors"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.mark.slow
def test_a_tp1_checkpoint_resumes_at_tp1_tp2_pp2_with_its_optimizer(tiny_llama_dir, tmp_path):
    first, _ = _train(tmp_path / "first", tiny_llama_dir, "controller.steps=2")
    assert [r["step"] for r in first] == [1, 2]
    ckpt = tmp_path / "first" / "tiny-test" / "checkpoints" / "step_00000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["async_save"] is True and meta["parallel"]["tp"] == 1
    got = {}
    for name, extra in (("tp1", ()), ("tp2", ("trainer.tp=2",)), ("pp2", ("trainer.pp=2",)),
                        ("fresh", ("trainer.resume_optimizer=false",))):
        shutil.copytree(tmp_path / "first", tmp_path / name)
        rows, text = _train(tmp_path / name, tiny_llama_dir, "controller.steps=4", *extra)
        assert "resuming from the step-2 checkpoint" in text, text[-3000:]
        by_step = {r["step"]: r for r in rows}
        assert sorted(by_step) == [1, 2, 3, 4], sorted(by_step)
        got[name] = (by_step[3]["train/grad_norm"], by_step[4]["train/loss"])
        if name in ("tp2", "pp2"):  # the ranks log it
            rank_log = (tmp_path / name / "tiny-test" / "logs" / "trainer_rank0.log").read_text(errors="replace")
            assert "resharded model and optimizer from tp1 pp1 dp1" in rank_log, rank_log[-3000:]
    print({k: (f"{g:.7g}", f"{l:.7g}") for k, (g, l) in got.items()})
    # The export reads the async-written checkpoints at any layout: step 4 written at tp1 and at tp2.
    # Both runs trained the same data from the same state: Adam's update is at most ~lr an element a
    # step, so 2 steps whose grads differ by fp32 reordering move the weights apart by < 2 * 2 * lr.
    hf = {name: _export(tmp_path / name / "tiny-test" / "checkpoints" / "step_00000004", tmp_path / f"hf_{name}")
          for name in ("tp1", "tp2")}
    assert hf["tp1"].keys() == hf["tp2"].keys()
    worst = max(float((hf["tp1"][k] - hf["tp2"][k]).abs().max()) for k in hf["tp1"])
    assert worst < 4 * 1e-3, worst
    assert all(g > 0 and l != 0 for g, l in got.values()), got  # something to compare
    for name in ("tp2", "pp2"):
        assert _rel(got[name][0], got["tp1"][0]) < REL, (name, got)
        assert _rel(got[name][1], got["tp1"][1]) < REL, (name, got)
    # the control: same weights and data at step 3 (same grad norm), another update (another step-4 loss)
    assert _rel(got["fresh"][0], got["tp1"][0]) < REL, got
    assert _rel(got["fresh"][1], got["tp1"][1]) > 10 * REL, got  # a lost Adam state is 10x outside the bound
