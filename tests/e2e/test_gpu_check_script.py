"""tools/gpu_check.sh's control flow, on CPU (MEGARL_GPU_CHECK_DRY=1: the same steps against CPU
stand-ins; nothing here proves anything about a GPU): a planted failure exits non-zero without
skipping the other steps, the JSON is written after every step and when the script is killed, and the
overall deadline turns a step that cannot fit into a recorded failure."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path, **extra):
    return dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, MEGARL_GPU_CHECK_DRY="1", **extra)


def _run(tmp_path, timeout=300, **extra):
    p = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh")], cwd=REPO, env=_env(tmp_path, **extra),
                       capture_output=True, text=True, timeout=timeout)
    return p, json.loads((tmp_path / "gpu_check.json").read_text())


def test_planted_failure_fails_the_check_and_the_other_steps_still_run(tmp_path):
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="fp8,nccl", MEGARL_GPU_CHECK_PLANT="fp8")
    assert p.returncode != 0, p.stdout + p.stderr
    steps = {s["step"]: s for s in doc["steps"]}
    assert doc["state"] == "done" and doc["ok"] is False
    assert steps["fp8"]["ok"] is False and "1 codes" in json.dumps(steps["fp8"]["result"])
    assert steps["nccl"]["ok"] is True  # ran after the failure
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="nccl")  # nothing planted: exit 0
    assert p.returncode == 0 and doc["ok"] is True, p.stdout + p.stderr


def test_json_written_when_killed_and_the_deadline_is_kept(tmp_path):
    proc = subprocess.Popen(["bash", str(REPO / "tools" / "gpu_check.sh")], cwd=REPO,
                            env=_env(tmp_path, MEGARL_GPU_CHECK_STEPS="ipc"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (tmp_path / "gpu_check.ipc.log").exists():
        time.sleep(0.5)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["state"] == "killed" and doc["killed_during"] == "ipc" and doc["ok"] is False
    # a deadline too short for a step: recorded as skipped, the check fails
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="fp8,ipc", MEGARL_GPU_CHECK_DEADLINE_S="20")
    steps = {s["step"]: s for s in doc["steps"]}
    assert p.returncode != 0 and doc["ok"] is False and doc["seconds"] <= 40
    assert steps["ipc"]["ok"] is False and "deadline" in (steps["ipc"]["note"] or "")


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["ipc", "trainer", "megatron", "ipc_8b"])
def test_planted_failure_in_each_step_kind(tmp_path, plant):
    """The transport (ipc) and the trainer (trainer, megatron) kinds; the kernel kind (fp8) is in the
    default suite."""
    p, doc = _run(tmp_path, timeout=600, MEGARL_GPU_CHECK_STEPS=plant, MEGARL_GPU_CHECK_PLANT=plant,
                  MEGARL_GPU_CHECK_IPC_CASES="bf16")
    assert p.returncode != 0, p.stdout + p.stderr
    step, = [s for s in doc["steps"] if s["step"] == plant]
    assert step["ok"] is False
    if plant in ("ipc", "ipc_8b"):  # the planted wrong byte, caught by the checksums and the exact comparison
        assert "differs from the plan" in json.dumps(step["result"])
    else:  # the planted logprob offset (10x the bound), not a crash
        key = "megatron_tp1" if plant == "megatron" else "megarl_trainer"
        assert step["result"][key]["logprobs_before_worst_ratio"] > 9


@pytest.mark.slow
def test_the_8b_width_ipc_step_bounds_each_workers_landing_tables(tmp_path):
    """ipc_8b (issue 46): the fp8 sync at Llama-3.1-8B's layer width, TP2 -> TP2, lands exactly with each
    worker's landing tables (index_bytes) under 16 MiB, where per-element indices took 16 B an element."""
    p, doc = _run(tmp_path, timeout=600, MEGARL_GPU_CHECK_STEPS="ipc_8b")
    assert p.returncode == 0 and doc["ok"], p.stdout + p.stderr
    step, = doc["steps"]
    res = step["result"]["cuda_ipc_width_8b"]
    assert res["ok"] and res["landed"] == 2 and res["problems"] == []  # one sync in the dry run, two workers
    for t in res["tables"].values():
        # a TP2 worker of a 4096 x 14336 layer + 32000-row vocab: 1 layer's and the embeddings' halves
        assert t["elements"] > 200_000_000
        assert 0 < t["index_bytes"] < res["index_bound"] == 16 << 20
        assert t["per_element_bytes_before"] == 16 * t["elements"] > 1000 * t["index_bytes"]


def test_megatron_check_runs_its_cpu_reference_with_cuda_hidden(monkeypatch):
    """With a GPU visible, the CPU reference child kept CUDA on, so megarl's CPU compat layer stayed off
    and it died on a device mismatch before comparing anything."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("gpu_megatron_check", REPO / "tools" / "gpu_megatron_check.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd[cmd.index("--child") + 1], kw.get("env")))
        return types.SimpleNamespace(returncode=1, stderr="stopped by the test", stdout="")

    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["gpu_megatron_check.py"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert tool.main() == 1
    dev, env = calls[0]
    assert dev == "cpu" and env is not None and env["CUDA_VISIBLE_DEVICES"] == ""


def test_the_gpu_marked_tests_are_a_step_of_the_one_call(tmp_path):
    """The gpu-marked tests (they skip themselves on CPU: this checks the step's command and its record; the
    trainer_scale step's own flow is tests/e2e/test_gpu_trainer_check.py's)."""
    p, doc = _run(tmp_path, timeout=600, MEGARL_GPU_CHECK_STEPS="gpu_tests")
    steps = {s["step"]: s for s in doc["steps"]}
    assert p.returncode == 0 and doc["ok"], p.stdout + p.stderr
    assert list(steps) == ["gpu_tests"] and steps["gpu_tests"]["ok"] is True, steps
    log = (tmp_path / "gpu_check.gpu_tests.log").read_text()
    assert re.search(r"\d+ skipped", log), log[-2000:]  # collected and skipped here, run on a GPU


def test_the_nccl_step_lands_through_the_cuda_path_like_the_host_path(tmp_path):
    """nccl's device_copies (issue 46): a worker's sync packed and landed by the transport's CUDA path (folded
    blocks; on a GPU at Llama-3.2-1B's shape, here on host tensors at a small one) equals its host path (a
    memcpy per run) byte for byte, with far fewer copies than runs; a planted wrong byte fails the step."""
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="nccl")
    assert p.returncode == 0 and doc["ok"], p.stdout + p.stderr
    step, = doc["steps"]
    res = step["result"]["device_copies"]
    assert res["ok"] and res["exact"] and res["device"] == "cpu"
    # the small shape's o_proj and down_proj come 256 rows (runs) per sender, layer and side, a block each; the
    # other parameters' single runs a copy each: 10x is what the rows alone make of any layout with >= 10 rows
    assert 0 < res["copies"] < res["runs"] / 10
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="nccl", MEGARL_GPU_CHECK_PLANT="nccl")
    assert p.returncode != 0 and doc["ok"] is False
    assert doc["steps"][0]["result"]["device_copies"]["exact"] is False


def test_the_bench_step_times_syncs_with_and_without_checksums(tmp_path):
    """bench (issue 46): at sync.verify_every=2 the odd syncs after the first carry no checksums (their
    verify time is 0) and the even ones do; the goal is the unchecked sync's ratio to a d2d copy of the
    same bytes (reported on CPU, enforced on a GPU), and the 1B's parameters at width 64 give the fixed
    cost. A planted miss fails the step."""
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="bench")
    assert p.returncode == 0 and doc["ok"], p.stdout + p.stderr
    step, = doc["steps"]
    res, (narrow,) = step["result"]["bench_cuda_ipc"], step["result"]["also"]
    assert res["model"] == "small" and res["goal_enforced"] is False and res["ok"]
    for r in (res, narrow):
        assert r["verified"]["syncs"] == r["unverified"]["syncs"] == 3
        assert r["verified"]["verify_s"] > 0 and r["unverified"]["verify_s"] == 0
        # an unchecked sync reads the landed bytes no second time: the worker digests nothing
        assert r["verified"]["worker_digests"] > 0 and r["unverified"]["worker_digests"] == 0
        assert r["ratio"] == r["unverified"]["ratio"] == pytest.approx(
            r["bytes"] / r["unverified"]["sync_seconds"] / 1e9 / r["d2d_copy_GBps"])
        assert r["meets_goal"] == (r["ratio"] >= r["goal_ratio"] == 0.5)
    assert res["bytes"] == 305960448 and narrow["model"] == "1b_narrow" and narrow["bytes"] < 2 << 20
    p, doc = _run(tmp_path, MEGARL_GPU_CHECK_STEPS="bench", MEGARL_GPU_CHECK_PLANT="bench")
    assert p.returncode != 0 and doc["ok"] is False and doc["steps"][0]["ok"] is False
