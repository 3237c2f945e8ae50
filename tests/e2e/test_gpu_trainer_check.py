"""tools/gpu_trainer_check.py's own logic on CPU (``--cpu-dry``: CPU against CPU, the CUDA IPC calls on host
memory): it passes, and each planted break fails it. The step check is the one a no-op CUDA optimizer step
used to pass (its logprob bound is ~1e4 x what a 1e-5 step moves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _dry_run(tool: str, key: str, plant: str = "") -> tuple[int, dict]:
    """``tools/<tool> --cpu-dry`` with ``plant``: (exit code, its JSON line's ``key`` part)."""
    env = dict(os.environ, MEGARL_GPU_CHECK_PLANT=plant)
    p = subprocess.run([sys.executable, f"tools/{tool}", "--cpu-dry"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])[key]


def _check(plant: str = "") -> tuple[int, dict]:
    return _dry_run("gpu_trainer_check.py", "megarl_trainer", plant)


def test_the_cpu_dry_run_passes_and_sees_the_step():
    rc, out = _check()
    assert rc == 0 and out["ok"], out
    assert out["step_moved_by_cpu"] > 100_000 and out["step_moved_frac"] == 1.0 and out["step_overshoot"] == 0, out


def test_a_no_op_step_fails_it():
    # the logprob plant ("trainer") is tests/e2e/test_gpu_check_script.py's, through gpu_check.sh
    rc, out = _check("step")
    assert rc == 1 and not out["ok"], out
    assert out["step_moved_frac"] == 0.0 and out["logprobs_after_worst_ratio"] == 0.0, out  # only the step check sees it


def _scale(plant: str = "") -> tuple[int, dict]:
    return _dry_run("gpu_trainer_scale_check.py", "trainer_scale", plant)


def test_the_scale_check_resumes_bit_for_bit_and_a_planted_difference_fails_it():
    # tools/gpu_trainer_scale_check.py's control flow (its memory-vs-plan figure needs a GPU)
    rc, out = _scale()
    assert rc == 0 and out["ok"] and out["resume_bitwise_equal"] and out["resume_step"] == 1, out
    rc, out = _scale("scale")
    assert rc == 1 and not out["resume_bitwise_equal"], out


def test_the_scale_checks_plan_figure_is_the_dry_runs_for_its_shape(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_trainer_scale_check as check

    (tmp_path / "config.json").write_text(json.dumps({**check.COMMON, **check.SHAPE}))
    total, parts = check.plan_trainer_bytes(str(tmp_path))
    # bf16 weights 2 B + fp32 grads 4 B + Adam (fp32 master, m, v) 12 B per parameter, counted from the HF shapes
    import math

    from megarl.models.layouts import ModelDims, hf_tensor_shapes

    n = sum(math.prod(s) for s in hf_tensor_shapes(ModelDims.from_hf_config({**check.COMMON, **check.SHAPE})).values())
    assert 190e6 < n < 210e6, n
    assert parts["weights"] * 2**30 == pytest.approx(2 * n, rel=0.01), parts
    assert total >= 18 * n and "activations" in parts, parts
