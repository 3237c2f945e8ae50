"""controller.deterministic: a job killed and resumed with trainer.resume_from=auto ends with the
same trainer weights, bit for bit, as one that never stopped.

The tiny async job of the kill matrix (lag 2, partial rollouts cut every 4 tokens, a checkpoint every
step, written in the background: trainer.async_save), 3 steps, deterministic: run once straight; once SIGKILLed (the controller) after step 2 is
logged and resumed from its step-2 checkpoint; and, as the negative control that shows the
comparison can fail, once straight with another generator.seed (these three at once, then the
resume). The final checkpoints' tensors (model and optimizer state, read from megatron's dist
checkpoint) are compared with torch.equal, and so are the trained samples (id, completion CRC,
versions). Without controller.deterministic the same kill + resume trained other tokens and gave
other weights (12 tensors differed, checked once by hand). About 2 min on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
COMMON = ("controller.deterministic=true", "controller.max_policy_lag=2", f"controller.steps={STEPS}",
          "controller.eval_every=0", "generator.round_token_budget=4", "trainer.checkpoint_interval=1",
          "algorithm.entropy_coef=0.01", "trainer.async_save=true")
# trainer.async_save: every run here writes its checkpoints in the background, so this test also shows
# that async checkpoints resume exactly (bit for bit) like synchronous ones; the synchronous save keeps
# its own resume tests (tests/e2e/test_checkpoint.py, tests/e2e/test_interrupt_resume.py, the kill matrix).
LATEST_S = 120.0  # for the step-2 background write to commit after step 2 is logged (s)


def _cmd(out_dir: Path, model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
            f"model.path={model_dir}", f"logging.out_dir={out_dir}", *COMMON, *extra]


def _start(out_dir: Path, model_dir: Path, *extra: str, log: str = "job.log") -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(_cmd(out_dir, model_dir, *extra), cwd=REPO, stdout=open(out_dir / log, "w"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _finish(proc: subprocess.Popen, out_dir: Path, log: str = "job.log") -> Path:
    try:
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert code == 0, (out_dir / log).read_text(errors="replace")[-3000:]
    return out_dir / "tiny-test"


def _final_tensors(run: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the last checkpoint (model and optimizer state), by flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = run / "checkpoints" / f"step_{STEPS:08d}"
    out = scratch / f"{run.parent.name}.pt"
    dcp_to_torch_save(str(step / "dist"), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("", torch.load(out, weights_only=False))
    assert flat, f"no tensors in {step / 'dist'}"
    return flat


def _samples(run: Path) -> dict[str, tuple]:
    """Every trained sample by id; a sample trained twice (or a step recorded twice) fails here, not
    silently collapsed by the dict."""
    rows = [json.loads(line) for line in (run / "trained_samples.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, STEPS + 1)), f"{run}: steps recorded {steps}"
    samples = [s for r in rows for s in r["samples"]]
    ids = [s["id"] for s in samples]
    assert len(ids) == len(set(ids)), f"{run}: a sample was trained twice"
    return {s["id"]: (s["crc32"], s["tokens"], tuple(s["versions"])) for s in samples}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:8]
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_a_killed_and_resumed_deterministic_run_ends_bit_identical(tiny_llama_dir, tmp_path):
    # The three first runs at once (a deterministic run's result does not depend on the load).
    jobs = {name: _start(tmp_path / name, tiny_llama_dir, *extra)
            for name, extra in (("killed", ()), ("straight", ()), ("seed1", ("generator.seed=1",)))}
    try:
        proc, run = jobs["killed"], tmp_path / "killed" / "tiny-test"
        deadline = time.monotonic() + 300
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):  # step 2 logged
            assert proc.poll() is None, f"the job ended before step 2\n{(tmp_path / 'killed' / 'job.log').read_text()}"
            assert time.monotonic() < deadline, "step 2 not logged within 300 s"
            time.sleep(0.05)
        # The step-2 checkpoint is written in the background: kill once it is committed (`latest`),
        # so the resume is from step 2 (a kill mid-write is the kill matrix's async point).
        latest = run / "checkpoints" / "latest"
        deadline = time.monotonic() + LATEST_S
        while not (latest.is_file() and latest.read_text().strip() == "step_00000002"):
            assert proc.poll() is None, f"the job ended before its step-2 checkpoint\n{(tmp_path / 'killed' / 'job.log').read_text()}"
            assert time.monotonic() < deadline, f"the step-2 checkpoint not committed within {LATEST_S:.0f} s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        assert not (run / "checkpoints" / f"step_{STEPS:08d}").exists(), "the job finished before the kill"
        straight = _finish(jobs["straight"], tmp_path / "straight")
        other_seed = _finish(jobs["seed1"], tmp_path / "seed1")
    finally:
        for p in jobs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
    resumed = _finish(_start(tmp_path / "killed", tiny_llama_dir, "trainer.resume_from=auto", log="resume.log"),
                      tmp_path / "killed", log="resume.log")
    # It resumed (from the step-2 checkpoint, the last the killed run completed), not started over.
    resume_log = (tmp_path / "killed" / "resume.log").read_text(errors="replace")
    assert "resuming from the step-2 checkpoint" in resume_log, resume_log[-3000:]

    for r in (straight, resumed):  # the checkpoints compared were written in the background
        meta = json.loads((r / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
        assert meta["async_save"] is True, meta.get("async_save")
    assert _samples(resumed) == _samples(straight), "the resumed run trained other samples"
    a, b = _final_tensors(straight, tmp_path), _final_tensors(resumed, tmp_path)
    differ = _differing(a, b)
    assert not differ, f"{len(differ)} of {len(a)} tensors differ after kill + resume: {differ[:6]}"
    # The negative control: the comparison can fail (another seed samples other tokens, trains other weights).
    assert _samples(other_seed) != _samples(straight)
    assert _differing(a, _final_tensors(other_seed, tmp_path)), "another generator.seed gave the same weights"


def test_deterministic_mode_is_a_documented_knob():
    from megarl.config.schema import ControllerConfig

    field = ControllerConfig.__dataclass_fields__["deterministic"]
    assert field.default is False and "Default false" in field.metadata["help"]
