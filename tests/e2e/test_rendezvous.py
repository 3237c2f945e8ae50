"""`megarl launch local`: the Slurm launcher's role map and task commands, run as local processes
(controller + 2 external trainer ranks, dp 2, and one external TP1 vLLM replica, all attaching to
the controller over TCP). A tiny job trains to the end; killing one external rank stops the job naming it,
with no process left. About 45 s each on 2 cores."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
# Bounds: a tiny 2-step job took 43 s end to end on 2 shared cores (measured); 300 s leaves room for a
# loaded machine and stays below trainer.start_timeout_s / step_timeout_s (300 / 600 s, their defaults),
# so a hang shows as a failed test, not as the suite's timeout.
JOB_TIMEOUT_S = 300
# cluster.teardown_timeout_s for these jobs: the controller reports a dead rank at its next command
# (a tiny step is ~1 s), so 20 s is far more than it needs, and keeps a failing test short.
TEARDOWN_S = 20


def _cmd(model_dir: Path, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megarl", "launch", "local", str(REPO / "configs" / "tiny_test.yaml"),
            f"model.path={model_dir}", f"logging.out_dir={out}", "trainer.dp=2", "controller.eval_every=0",
            "trainer.checkpoint_interval=0", "algorithm.entropy_coef=0.01", f"cluster.teardown_timeout_s={TEARDOWN_S}",
            *overrides, "--log-dir", str(out / "tasks")]


def _pids(launcher_out: str) -> dict[str, int]:
    """The launcher's `started <task>: pid N` lines."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (.+?): pid (\d+)", launcher_out)}


def _gone(pids, timeout_s: float = 15.0) -> list[int]:
    """The pids still alive after up to ``timeout_s`` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_local_rendezvous_runs_a_tiny_job(tiny_llama_dir, tmp_path):
    out = subprocess.run(_cmd(tiny_llama_dir, tmp_path, "controller.steps=2"), capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S, cwd=REPO)
    tasks = tmp_path / "tasks"
    ctrl = (tasks / "controller.log").read_text()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + ctrl[-3000:]
    assert "MEGARL_WORLD_SIZE=3 (trainer 2 + generator 1)" in out.stdout
    pids = _pids(out.stdout)
    assert set(pids) == {"controller", "trainer rank 0", "trainer rank 1", "generator replica 0"}
    for r in (0, 1):  # each rank is its own OS process that attached over TCP
        assert f"trainer: rank {r} attached from pid {pids[f'trainer rank {r}']}" in ctrl
    assert f"generator: replica 0 attached from pid {pids['generator replica 0']}" in ctrl
    assert "2 rank(s) ready (tp 1 x pp 1 x dp 2)" in ctrl
    rows = [json.loads(line) for line in (tmp_path / "tiny-test" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["gen/samples"] == 8 and math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert r["sync/bytes_sent"] > 0  # DDMA from both external ranks into the controller's engine
    for r in (0, 1):
        assert "step (seq" in (tmp_path / "tiny-test" / "logs" / f"trainer_rank{r}.log").read_text()
    assert not _gone(pids.values())


def test_killed_external_rank_stops_the_job_naming_it(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "launcher.out"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(_cmd(tiny_llama_dir, tmp_path, "controller.steps=200"), stdout=f,
                                stderr=subprocess.STDOUT, cwd=REPO)
    metrics = tmp_path / "tiny-test" / "metrics.jsonl"
    family: set[int] = set()
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.2)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert metrics.exists(), "no step finished in time"
        family = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}  # tasks, engine, helpers
        victim = _pids(log_path.read_text())["trainer rank 1"]
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    launcher = log_path.read_text()
    ctrl = (tmp_path / "tasks" / "controller.log").read_text()
    assert code != 0, launcher[-3000:]
    assert "trainer rank 1 was killed by signal SIGKILL" in launcher, launcher[-3000:]  # the launcher names it too
    # the controller names the rank (global and coordinates, pid and host) and the cause
    assert re.search(rf"trainer rank 1 \(tp 0, pp 0, dp 1; pid {victim} on \S+\) lost its connection", ctrl), \
        ctrl[-3000:]
    assert not _gone(family | {proc.pid}), "processes left behind"
