"""Generator supervision (megarl/generator/supervision.py): a replica SIGKILLed, or SIGSTOPped, while
it decodes in the middle of `megarl train` is replaced in place and the job goes on: every step is
trained once, no sample twice, exit 0; and the restart budget / knob checks.

The kill lands where the name says: replica 1 holds at the fault pause point
``replica_decoding@r1v1`` (megarl/utils/faults.py) after an engine step that left requests
unfinished under weights v1, and logs 'decoding N request(s)'; the test signals it only after reading
that line, and checks N >= 1. Two replicas, one core each (``generator.threads_bind=0;1``), as the
2-core machine's other multi-engine tests bind them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.generator.config import GeneratorConfig
from megarl.generator.supervision import RestartBudget

REPO = Path(__file__).resolve().parents[1]
PAUSE_S = 5  # the replica holds this long at the pause point: shorter than the heartbeat timeout below,
             # so only the SIGSTOP (not the pause) makes the SIGSTOPped replica look frozen
HEARTBEAT_S = 15  # generator.heartbeat_timeout_s of these runs (a decoding replica reports every 5 s)
DECODING = re.compile(r"replica 1 \(pid (\d+)\): decoding (\d+) request\(s\) at v1")


def _wait_for_line(path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    """Poll ``path`` until a line matches (the replica is decoding), the run ends, or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            m = pattern.search(path.read_text(errors="replace"))
            if m:
                return m
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before replica 1 logged that it decodes at v1")
        time.sleep(0.05)
    pytest.fail(f"no line matching {pattern.pattern!r} in {path} within {timeout_s}s")


def _run_with_fault(model_dir: Path, tmp_path: Path, sig: int) -> tuple[str, Path, int]:
    """`megarl train` (2 steps, 2 replicas); ``sig`` to replica 1 while it decodes at v1. Returns the
    run's output, its folder and the number of requests the replica held."""
    logs = tmp_path / "genlogs"
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
           f"model.path={model_dir}", f"logging.out_dir={tmp_path}", "controller.steps=2", "controller.eval_every=0",
           "trainer.checkpoint_interval=0", "generator.replicas=2", "generator.threads_bind=0;1",
           f"generator.log_dir={logs}", f"generator.heartbeat_timeout_s={HEARTBEAT_S}",
           "generator.request_timeout_s=120", "sync.probe_every=1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGARL_FAULT_PAUSE=f"replica_decoding@r1v1={PAUSE_S}")
    out_path = tmp_path / "train.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            m = _wait_for_line(logs / "generator_replica1.log", DECODING, proc, timeout_s=300)
            pid, held = int(m.group(1)), int(m.group(2))
            os.kill(pid, sig)
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = out_path.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    return text, tmp_path / "tiny-test", held


def _check_run_went_on(text: str, run: Path, held: int, cause: str) -> None:
    assert held >= 1  # the replica was decoding when the signal landed
    restarted = re.findall(r"generator: replica 1 restarted \(cause: (.*)\): pid \d+ -> \d+, weights v(\d+), "
                           r"(\d+) request\(s\) re-issued; recovered in ([\d.]+)s", text)
    assert len(restarted) == 1, text[-4000:]
    why, version, reissued, seconds = restarted[0]
    assert cause in why and version == "1" and int(reissued) >= 1, restarted
    print(f"replica 1 recovered in {seconds}s ({why})")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["gen/replica_restarts"] == 1.0
    trained = [json.loads(line) for line in (run / "trained_samples.jsonl").read_text().splitlines()]
    steps = [rec["step"] for rec in trained]
    assert sorted(set(steps)) == [1, 2] and all(steps.count(s) == 1 for s in (1, 2)), steps  # each step once
    ids = [s["id"] for rec in trained for s in rec["samples"]]
    assert len(ids) == len(set(ids)) == 2 * 4 * 2  # steps x prompts x samples, none twice
    for rec in trained:  # versions stay true: step s trains on samples of weights v(s - 1)
        assert all(s["versions"] == [rec["step"] - 1] * 2 for s in rec["samples"] if s["tokens"]), rec


def test_replica_sigkilled_while_decoding_is_restarted(tiny_llama_dir, tmp_path):
    text, run, held = _run_with_fault(tiny_llama_dir, tmp_path, signal.SIGKILL)
    _check_run_went_on(text, run, held, "killed by signal SIGKILL")


def test_replica_sigstopped_while_decoding_is_restarted(tiny_llama_dir, tmp_path):
    text, run, held = _run_with_fault(tiny_llama_dir, tmp_path, signal.SIGSTOP)
    _check_run_went_on(text, run, held, "made no progress")


def test_restart_budget_counts_within_the_window():
    budget = RestartBudget(max_restarts=2, window_s=100)
    assert budget.allow(0, "killed by signal 9", now=0) is None
    assert budget.allow(0, "frozen", now=50) is None
    assert budget.allow(1, "other replica", now=60) is None  # counted per replica
    refused = budget.allow(0, "killed again", now=90)
    assert refused and "failed 3 time(s)" in refused and "killed by signal 9; frozen; killed again" in refused
    assert budget.allow(1, "late", now=300) is None  # older failures left the window


@pytest.mark.parametrize("key,value,words", [("heartbeat_timeout_s", 5.0, "must exceed 5 s"),
                                             ("max_restarts", -1, "must be >= 0"),
                                             ("restart_window_s", 0.0, "must be > 0")])
def test_supervision_knobs_are_validated(key, value, words):
    problems = GeneratorConfig(**{key: value}).problems(on_cpu=True)
    assert any(f"generator.{key}=" in p and words in p for p in problems), problems
