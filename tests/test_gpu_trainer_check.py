"""tools/gpu_trainer_check.py's own logic on CPU (``--cpu-dry``: CPU against CPU, the CUDA IPC calls on host
memory): it passes, and each planted break fails it. The step check is the one a no-op CUDA optimizer step
used to pass (its logprob bound is ~1e4 x what a 1e-5 step moves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _check(plant: str = "") -> tuple[int, dict]:
    env = dict(os.environ, MEGARL_GPU_CHECK_PLANT=plant)
    p = subprocess.run([sys.executable, "tools/gpu_trainer_check.py", "--cpu-dry"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])["megarl_trainer"]


def test_the_cpu_dry_run_passes_and_sees_the_step():
    rc, out = _check()
    assert rc == 0 and out["ok"], out
    assert out["step_moved_by_cpu"] > 100_000 and out["step_moved_frac"] == 1.0 and out["step_overshoot"] == 0, out


def test_a_no_op_step_fails_it():
    # the logprob plant ("trainer") is tests/test_gpu_check_script.py's, through gpu_check.sh
    rc, out = _check("step")
    assert rc == 1 and not out["ok"], out
    assert out["step_moved_frac"] == 0.0 and out["logprobs_after_worst_ratio"] == 0.0, out  # only the step check sees it
