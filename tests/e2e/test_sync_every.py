"""sync.every K on the real stack (Megatron trainer, vLLM generator, DDMA) with the tiny model: pushes
after steps K, 2K, ... and the last, tokens stamped with the version the generator holds, the lag
bound kept, and a run stopped between two pushes resumes on the same cadence.

The definition (megarl/controller/staleness.py): the generator holds pushed_version(v) = K*floor(v/K)
while the trainer is at v; batches of steps up to pushed_version(step - 1) + max_policy_lag + 1 are
admitted. With K = 2 and max_policy_lag = 1 (= K - 1), worked by hand from it:

  step            1    2    3    4    5 (last)
  trainer ver.    0    1    2    3    4         (step s trains at version s - 1)
  batch admitted  1,2  -    3,4  -    5         (at fill(s): up to pushed_version(s - 1) + 2)
  token version   0    0    2    2    4         (the pushed version when the batch was admitted; the
                                                 next push needs that batch trained first)
  pushed after    no   yes  no   yes  yes

Every token of step s has version exactly K*floor((s-1)/K), lag (s-1) mod K: a function of the step,
not of timing. Planted breaks seen failing (then restored): pushing every step (push_due returning
True) fails the sync/pushed row and step 4's versions (3, not 2); admission counting from the
trainer's version instead of the generator's (rollouts.fill with step - 1 for held) admits batch 3
at version 0, trained at version 2: lag 2 > 1, regenerated (lag/regenerated_groups 1, versions 1);
counting the cadence from the resume ((step - first step) % K) pushes after step 5 only, failing
sync/pushed at step 4.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K, LAG, STEPS = 2, 1, 5


def _cmd(model_dir: Path, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
            f"model.path={model_dir}", f"logging.out_dir={out_dir}", f"controller.steps={STEPS}",
            f"sync.every={K}", f"controller.max_policy_lag={LAG}", "controller.eval_every=0",
            "trainer.checkpoint_interval=100", "sync.probe_every=1", "algorithm.entropy_coef=0.01"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sync_every_2_pushes_on_its_cadence_and_resumes_between_pushes(tiny_llama_dir, tmp_path):
    run = tmp_path / "tiny-test"
    log_path = tmp_path / "first.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        # held after step 3's line until the signal: stopped between the pushes after steps 2 and 4
        job = subprocess.Popen(_cmd(tiny_llama_dir, tmp_path), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env=dict(env, MEGARL_FAULT_PAUSE="step_logged@3=120"))
    try:
        deadline = time.monotonic() + 400
        while job.poll() is None and time.monotonic() < deadline and f"step 3/{STEPS} |" not in log_path.read_text():
            time.sleep(0.1)
        assert job.poll() is None, log_path.read_text()[-3000:]
        job.send_signal(signal.SIGTERM)
        code = job.wait(120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert code == 128 + signal.SIGTERM, log_path.read_text()[-3000:]
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    state = json.loads((ckpt / "controller_state.json").read_text())
    assert state["policy_version"] == 3
    # stopped with batch 4 admitted ahead (fill(3): up to pushed_version(2) + 1 + 1 = 4), batch 5 not
    assert list(state["rollouts"]["pending"]) == ["4"] and state["rollouts"]["next_step"] == 5

    again = subprocess.run(_cmd(tiny_llama_dir, tmp_path), capture_output=True, text=True, timeout=600, cwd=REPO,
                           env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # the cadence is by absolute step, across the resume: after 2 and 4, and the last step 5
    assert [r["sync/pushed"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 1.0]
    # run 1: 0 until the push after step 2; the resume pushes its weights (3) at start; then 4, 5
    assert [r["sync/generator_version"] for r in rows] == [0.0, 2.0, 2.0, 4.0, 5.0]
    for r in rows:
        assert r["lag/regenerated_groups"] == 0.0 and r["lag/max"] <= LAG
        if r["sync/pushed"]:
            assert r["sync/verified"] == 1.0 and r["sync/probe_gap"] < 1e-3  # fp32 bound (weight_sync.py)

    trained = {r["step"]: r["samples"] for r in _jsonl(run / "trained_samples.jsonl")}
    assert sorted(trained) == [1, 2, 3, 4, 5]
    ids = [s["id"] for ss in trained.values() for s in ss]
    assert len(ids) == STEPS * 4 * 2 and len(set(ids)) == len(ids)  # prompts_per_step x n_samples, each once
    for step, samples in trained.items():
        # steps 1-3 and 5 as the table says. Step 4's batch was generated before the stop from version 2
        # (finished in the engine long before the held step's signal), or, had it been cut, continued
        # under the resumed weights, version 3: either way within the bound of trainer version 3.
        want = {1: {0}, 2: {0}, 3: {2}, 4: {2, 3}, 5: {4}}[step]
        for s in samples:
            if s["tokens"]:
                assert set(s["versions"]) <= want, (step, s)
                assert (step - 1) - s["versions"][0] <= LAG, (step, s)


def test_sync_every_config_errors_are_one_line_naming_the_knob(tiny_llama_dir):
    """A lag below K - 1 could never train a batch (each would be regenerated forever); an eval between
    pushes would measure old weights; K < 1 is no period. Each is refused at load, naming the knob."""
    import pytest

    from megarl.config import ConfigError, load_config

    base = [f"model.path={tiny_llama_dir}", "controller.eval_every=0"]
    cases = [(["sync.every=3", "controller.max_policy_lag=1"],
              "controller.max_policy_lag=1: with sync.every=3 the generator holds weights up to 2 version(s) behind "
              "the trainer between pushes, so no batch would ever be fresh enough to train; set "
              "controller.max_policy_lag=2 or more, or sync.every=2"),
             (["sync.every=2", "controller.max_policy_lag=1", "controller.eval_every=3"],
              "controller.eval_every=3: not a multiple of sync.every=2"),
             (["sync.every=0"], "sync.every=0: must be >= 1")]
    for overrides, want in cases:
        with pytest.raises(ConfigError) as e:
            load_config(str(REPO / "configs" / "tiny_test.yaml"), base + overrides)
        assert any(p.startswith(want) and "\n" not in p for p in e.value.problems), e.value.problems
    # the bound K - 1 itself, and eval_every a multiple of K, load
    cfg = load_config(str(REPO / "configs" / "tiny_test.yaml"),
                      base + ["sync.every=3", "controller.max_policy_lag=2", "controller.eval_every=6"])
    assert cfg.sync.every == 3
