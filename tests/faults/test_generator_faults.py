"""Generator supervision (megarl/generator/supervision.py): in the middle of one `megarl train` run
(3 steps, 2 replicas), replica 1 is SIGKILLed while it decodes under weights v1 and replica 0 is
SIGSTOPped while it decodes under v2. Each is replaced in place (the stopped one once it has said
nothing for generator.heartbeat_timeout_s) and the job goes on: every step trained once, no sample
twice, every sample's versions those of the weights it was generated with, exit 0. One run for both
faults keeps the file inside its time budget (a run with a restart took ~110 s here).

Each signal lands where the test says: the replica holds at the fault pause point
``replica_decoding@r<R>v<V>`` (megarl/utils/faults.py) after an engine step that left requests
unfinished, and logs 'decoding N request(s)'; the test signals it only after reading that line, and
checks N >= 1. Two replicas, one core each (``generator.threads_bind=0;1``), as the 2-core machine's
other multi-engine tests bind them.
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

REPO = Path(__file__).resolve().parents[2]
PAUSE_S = 5  # a replica holds this long at its pause point: shorter than the heartbeat timeout, so only
             # the SIGSTOP (not the pause) makes the stopped replica look frozen
HEARTBEAT_S = 15  # generator.heartbeat_timeout_s of the run (a decoding replica reports every 5 s)
STEPS = 3
FAULTS = ((1, 1, signal.SIGKILL, "was killed by signal SIGKILL"),  # (replica, version, signal, cause logged)
          (0, 2, signal.SIGSTOP, "made no progress for"))


def _wait_for_line(path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    """Poll ``path`` until a line matches (the replica is decoding), the run ends, or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            m = pattern.search(path.read_text(errors="replace"))
            if m:
                return m
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before {path.name} said {pattern.pattern!r}")
        time.sleep(0.05)
    pytest.fail(f"no line matching {pattern.pattern!r} in {path} within {timeout_s}s")


@pytest.fixture(scope="module")
def faulted_run(tiny_llama_dir, tmp_path_factory):
    """The run with both faults: (its output, its folder, requests each signalled replica held)."""
    tmp = tmp_path_factory.mktemp("faulted")
    logs = tmp / "genlogs"
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
           f"model.path={tiny_llama_dir}", f"logging.out_dir={tmp}", f"controller.steps={STEPS}",
           "controller.eval_every=0", "trainer.checkpoint_interval=0", "generator.replicas=2",
           "generator.threads_bind=0;1", f"generator.log_dir={logs}", f"generator.heartbeat_timeout_s={HEARTBEAT_S}",
           "generator.request_timeout_s=120", "sync.probe_every=1"]
    pauses = ",".join(f"replica_decoding@r{r}v{v}={PAUSE_S}" for r, v, _, _ in FAULTS)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGARL_FAULT_PAUSE=pauses)
    held = {}
    with open(tmp / "train.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            for r, v, sig, _ in FAULTS:
                decoding = re.compile(rf"replica {r} \(pid (\d+)\): decoding (\d+) request\(s\) at v{v}")
                m = _wait_for_line(logs / f"generator_replica{r}.log", decoding, proc, timeout_s=300)
                os.kill(int(m.group(1)), sig)
                held[r] = int(m.group(2))
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = (tmp / "train.out").read_text(errors="replace")
    assert rc == 0, text[-4000:]
    return text, tmp / "tiny-test", held


@pytest.mark.parametrize("replica,version,sig,cause", FAULTS, ids=["SIGKILL", "SIGSTOP"])
def test_a_failed_replica_is_restarted_and_the_job_goes_on(faulted_run, replica, version, sig, cause):
    text, run, held = faulted_run
    assert held[replica] >= 1  # it was decoding when the signal landed
    restarted = re.findall(rf"generator: replica {replica} restarted \(cause: (.*)\): pid \d+ -> \d+, "
                           rf"weights v(\d+), (\d+) request\(s\) re-issued; recovered in ([\d.]+)s", text)
    assert len(restarted) == 1, text[-4000:]
    why, loaded, reissued, seconds = restarted[0]
    assert cause in why and int(loaded) == version and int(reissued) >= 1, restarted
    print(f"replica {replica} ({sig.name}) recovered in {seconds}s: {why}")


def test_every_step_trained_once_and_no_sample_twice(faulted_run):
    text, run, _ = faulted_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["gen/replica_restarts"] == len(FAULTS)
    trained = [json.loads(line) for line in (run / "trained_samples.jsonl").read_text().splitlines()]
    steps = [rec["step"] for rec in trained]
    assert steps == list(range(1, STEPS + 1)), steps  # each step once
    ids = [s["id"] for rec in trained for s in rec["samples"]]
    assert len(ids) == len(set(ids)) == STEPS * 4 * 2  # steps x prompts x samples, none twice
    for rec in trained:  # versions stay true: at lag 0, step s trains on samples of weights v(s - 1)
        assert all(s["versions"] == [rec["step"] - 1] * 2 for s in rec["samples"] if s["tokens"]), rec


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


def test_an_attached_replica_that_freezes_stops_the_job_naming_it(tiny_llama_dir, tmp_path, monkeypatch):
    """Attach mode (Slurm): a replica srun started cannot be restarted from here, but one that freezes
    must still be found by the heartbeat detector, not generator.request_timeout_s (600 s here) after
    the other replicas' progress stops. The replica runs as srun would run it (attached_replica_main in
    its own process, connecting to the executor's port); it is SIGSTOPped while it decodes."""
    from megarl.config import load_config
    from megarl.executors.attach import channel_port_var
    from megarl.generator.errors import GeneratorEngineDied
    from megarl.generator.executor import GeneratorExecutor
    from megarl.utils.dist import free_tcp_port

    port, key = free_tcp_port(), "megarl-test-key"
    monkeypatch.setenv(channel_port_var("generator"), str(port))
    monkeypatch.setenv("MEGARL_AUTHKEY", key)
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_dir}", f"generator.heartbeat_timeout_s={HEARTBEAT_S}",
        "generator.request_timeout_s=600", "generator.max_new_tokens=48"]).generator
    code = ("from megarl.generator.engine import attached_replica_main; "
            f"attached_replica_main(0, controller=('127.0.0.1', {port}), authkey={key.encode()!r}, job_id='', "
            "connect_timeout_s=300, threads_bind=None, cuda_devices=None)")
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGARL_FAULT_PAUSE=f"replica_decoding@r0v0={PAUSE_S}")
    with open(tmp_path / "replica.out", "w") as out:
        replica = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                   env=env)
    try:
        with GeneratorExecutor(cfg, tiny_llama_dir, launcher="slurm", log_dir=tmp_path / "gen") as gen:
            gen.submit([[1, 100 + i, 200, 300] for i in range(4)], n_samples=1)
            decoding = re.compile(r"replica 0 \(pid (\d+)\): decoding (\d+) request\(s\) at v0")
            m = _wait_for_line(tmp_path / "gen" / "generator_replica0.log", decoding, replica, timeout_s=300)
            assert int(m.group(1)) == replica.pid and int(m.group(2)) >= 1
            os.kill(replica.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(GeneratorEngineDied, match=r"replica 0 .*made no progress for \d+s while holding "
                                                          r"\d+ request\(s\) \(frozen"):
                gen.collect(timeout_s=HEARTBEAT_S + 120)  # past this, the detector did not fire
            assert time.monotonic() - t0 < HEARTBEAT_S + 120
    finally:
        replica.kill()
        replica.wait(timeout=30)
