"""`megarl bench generator|trainer` as a user runs them (subprocesses): help, and a --quick smoke
run on the tiny model that writes the JSON (with its ratio fields) and the PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore",
           PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _cli(*args, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl", "bench", *map(str, args)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("which", ["trainer", "generator", "sync"])
def test_bench_help(which):
    r = _cli(which, "--help", timeout=120)
    _ok(r)
    assert "--quick" in r.stdout and "--out" in r.stdout


def test_bench_unknown_is_usage_error():
    r = _cli("nope", timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_bench_trainer_quick(tiny_llama_dir, tmp_path):
    r = _cli("trainer", "--quick", "--model", tiny_llama_dir, "--out", tmp_path)
    _ok(r)
    assert "ratio" in r.stdout
    result = json.loads((tmp_path / "bench_trainer.json").read_text())
    for key in ("ratio", "ratio_median", "ours_tokens_per_s", "bare_tokens_per_s"):
        assert result[key] > 0, key
    assert result["config"]["quick"] and result["config"]["repeats"] == 2
    assert len(result["times_s"]["ours"]) == len(result["times_s"]["bare"]) == 2
    assert (tmp_path / "bench_trainer.png").stat().st_size > 1000


def test_bench_generator_quick(tiny_llama_dir, tmp_path):
    """vLLM (CPU) against transformers on the tiny model: about 20 s on 2 cores."""
    r = _cli("generator", "--quick", "--model", tiny_llama_dir, "--out", tmp_path)
    _ok(r)
    result = json.loads((tmp_path / "bench_generator.json").read_text())
    for key in ("ratio_best", "ratio_median"):
        assert result[key] > 0, key
    assert result["prompts"] == 2 and result["new_tokens"] == 8 and result["target"] == 3.0
    assert len(result["generator_tok_s"]) == 1 and list(result["transformers_tok_s"]) == ["float32"]
    # raw vLLM (LLM.generate, same engine args and sampling) ran beside it and decoded the same tokens
    assert len(result["raw_vllm_tok_s"]) == 1 and result["executor_over_raw_best"] > 0
    assert (tmp_path / "bench_generator.png").stat().st_size > 1000


def test_bench_sync_quick(tmp_path):
    # every method must land identical bytes (the bench exits non-zero otherwise)
    _ok(_cli("sync", "--quick", "--trials", "1", "--trainer", "2,1,1", "--out", tmp_path))
    result = json.loads((tmp_path / "sync.json").read_text())
    assert set(result["best_seconds"]) == {"ddma_zero_copy", "ddma_zero_copy_verify", "ddma_p2p",
                                           "gather_broadcast", "shm_push", "memcpy"}
    assert result["bytes_landed_per_worker"] > 0
    assert (tmp_path / "sync.png").stat().st_size > 1000


def test_bench_step_quick(tiny_llama_dir, tmp_path):
    """Both modes run as real `megarl train` jobs (sync on every core, async split), about 80 s."""
    _ok(_cli("step", "--quick", "--model", tiny_llama_dir, "--out", tmp_path))
    result = json.loads((tmp_path / "bench_step.json").read_text())
    for mode in ("sync", "async"):
        m = result[mode]
        assert m["steps_counted"] == 2, mode  # 3 steps, the first one a warm-up
        assert set(m["phases"]) == {"generate_s", "reward_s", "train_s", "sync_s", "idle_s"}
        assert m["busy"]["trainer_s"] > 0 and m["busy"]["generator_s"] > 0 and m["tokens_per_s"] > 0
    assert result["ratio"] > 0 and result["overlap_bound"] >= 1.0  # (a+b)/max(a,b) is in [1, 2]
    assert result["overlap_bound"] <= 2.0
    log = (tmp_path / "bench_step_runs" / "async-0.log").read_text()
    assert "trainer ranks pinned" in log  # the async mode really split the machine
    assert (tmp_path / "bench_step.png").stat().st_size > 1000
