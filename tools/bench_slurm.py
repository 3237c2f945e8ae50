"""Benchmark: the tiny job on a real Slurm cluster (tests/harness/slurm_cluster.py, 4 nodes on this host) vs the
same job under `megarl launch local`, and what a preemption costs. One run, side by side:

- **sbatch -> first step**: seconds from ``sbatch launch/slurm/train.sbatch`` to the first row of
  metrics.jsonl (scheduling, srun, Megatron ranks and vLLM start, the v0 sync and probe);
- **median step** on Slurm (2 trainer nodes, dp 2, + 1 generator node, DDMA gloo across nodes) and
  under ``megarl launch local`` (the same role map as local processes), and their ratio;
- **preemption**: ``scancel --batch --signal=USR1`` (what ``#SBATCH --signal=B:USR1@s`` sends before the
  time limit; the launcher passes it on to the controller and requeues the job itself) after 2 steps: seconds from the signal to the controller's checkpoint and to the
  first run's exit, steps lost (trained sample ids against every step's expected ids), and seconds
  from the requeued job's start to its first resumed step. Slurm holds a requeued job ~120 s
  (Reason=BeginTime); the bench releases it at once and reports the hold apart.

Needs root (slurmd, munged, /etc/hosts). Writes bench_slurm.json and bench_slurm.png.

    .venv/bin/python tools/bench_slurm.py [--steps 6] [--out runs/...]
    megarl bench slurm
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.slurm_cluster import SlurmCluster, ensure_installed  # noqa: E402

PROMPTS, SAMPLES = 4, 2  # configs/tiny_test.yaml


def _overrides(model: Path, out: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [f"model.path={model}", "cluster.device=cpu", f"logging.out_dir={out}", f"name={name}",
            "controller.max_policy_lag=1", "controller.eval_every=0", f"controller.steps={steps}", *extra]


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(pred, timeout_s: float, what: str, poll_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f}s")


def _median_step(rows: list[dict]) -> float:
    return statistics.median(r["time/step"] for r in rows[1:])  # the first step warms up


def slurm_run(c: SlurmCluster, model: Path, out: Path, steps: int) -> dict:
    config = str(REPO / "configs" / "tiny_test.yaml")
    out.mkdir(parents=True, exist_ok=True)  # Slurm does not create --output's folder
    t0 = time.monotonic()
    job = c.sbatch(["--nodes=3", "--gpus-per-node=2", f"--output={out}/slurm-%j.out",
                    str(REPO / "launch/slurm/train.sbatch"), config,
                    *_overrides(model, out, "slurm", steps, "trainer.dp=2", "cluster.trainer_nodes=2")], cwd=REPO)
    run = out / "slurm"
    _wait(lambda: _rows(run), 600, "first step on Slurm")
    first = time.monotonic() - t0
    st = c.wait(job, 600)
    return {"job": job, "state": st["state"], "sbatch_to_first_step_s": first,
            "median_step_s": _median_step(_rows(run)), "steps": len(_rows(run))}


def local_run(model: Path, out: Path, steps: int) -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "megarl", "launch", "local", str(REPO / "configs" / "tiny_test.yaml"),
                             *_overrides(model, out, "local", steps, "trainer.dp=2"), "--trainer-nodes", "2",
                             "--log-dir", str(out / "local-tasks")], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    run = out / "local"
    _wait(lambda: _rows(run) or proc.poll() is not None, 600, "first step under launch local")
    first = time.monotonic() - t0
    code = proc.wait(600)
    return {"exit": code, "launch_to_first_step_s": first, "median_step_s": _median_step(_rows(run)),
            "steps": len(_rows(run))}


def preemption_run(c: SlurmCluster, model: Path, out: Path, steps: int) -> dict:
    config = str(REPO / "configs" / "tiny_test.yaml")
    out.mkdir(parents=True, exist_ok=True)
    job = c.sbatch(["--nodes=2", "--gpus-per-node=2", f"--output={out}/slurm-%j.out",
                    str(REPO / "launch/slurm/train.sbatch"), config,
                    *_overrides(model, out, "preempt", steps, "trainer.checkpoint_interval=100",
                                "generator.round_token_budget=4")], cwd=REPO)
    run = out / "preempt"
    _wait(lambda: len(_rows(run)) >= 2, 600, "2 steps before the preemption")
    t_sig = time.monotonic()
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job)], env=c.env(), check=True, timeout=60)
    st = _wait(lambda: (s := c.state(job))["restarts"] >= 1 and s, 300, "the job to be requeued")
    t_exit = time.monotonic() - t_sig
    hold = st["reason"] == "BeginTime"
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=c.env(), capture_output=True,
                   timeout=60)
    _wait(lambda: c.state(job)["state"] == "RUNNING", 300, "the requeued job to start")
    t_start = time.monotonic()
    m = _wait(lambda: re.search(r"preempted: checkpoint of step (\d+) in place ([\d.]+)s after the signal",
                                (out / f"slurm-{job}.out").read_text(errors="replace")), 60, "the checkpoint line")
    saved = int(m.group(1))
    _wait(lambda: any(r["step"] == saved + 1 for r in _rows(run)), 600, "the first resumed step")
    resume_s = time.monotonic() - t_start
    final = c.wait(job, 600)
    trained = [json.loads(line) for line in (run / "trained_samples.jsonl").read_text().splitlines() if line]
    ids = [s["id"] for row in trained for s in row["samples"]]
    expected = {f"s{t}p{p}k{k}" for t in range(1, steps + 1) for p in range(PROMPTS) for k in range(SAMPLES)}
    text = (out / f"slurm-{job}.out").read_text(errors="replace")
    return {"job": job, "state": final["state"], "restarts": final["restarts"], "saved_at_step": saved,
            "signal_to_checkpoint_s": float(m.group(2)), "signal_to_requeued_s": t_exit,
            "requeue_hold_released": hold, "requeued_start_to_resumed_step_s": resume_s,
            "steps_lost": len({i.split("p")[0] for i in expected - set(ids)}),
            "samples_trained_twice": len(ids) - len(set(ids)), "self_requeued": "requeued: it restarts" in text}


def plot(result: dict, path: Path) -> Path | None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the Slurm bench")
    if plt is None:
        return None
    s, lo, p = result["slurm"], result["local"], result["preemption"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(["Slurm (3 nodes)", "launch local"], [s["median_step_s"], lo["median_step_s"]], color=["#4c72b0", "#999"])
    a.set_ylabel("median step (s)")
    a.set_title(f"tiny job, dp 2 + 1 replica: {result['slurm_vs_local']:.2f}x")
    names = ["signal->checkpoint", "signal->requeued", "restart->resumed step"]
    b.barh(names, [p["signal_to_checkpoint_s"], p["signal_to_requeued_s"], p["requeued_start_to_resumed_step_s"]],
           color="#dd8452")
    b.set_xlabel("seconds")
    b.set_title(f"preemption: {p['steps_lost']} step(s) lost")
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps of each job (default 6)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench_slurm"),
                    help="where bench_slurm.json / .png go (default runs/bench_slurm; the committed figures are in docs/)")
    a = ap.parse_args(argv)
    ensure_installed()  # first: without Slurm (not root, no apt-get) it ends in one line at once
    from megarl.models.tiny import make_tiny_hf_checkpoint

    work = Path(tempfile.mkdtemp(prefix="megarl-bench-slurm-"))
    model = make_tiny_hf_checkpoint(work / "tiny", "llama", seed=0)
    with SlurmCluster(work / "cluster", nodes=4) as c:
        slurm = slurm_run(c, model, work / "a", a.steps)
        print(f"slurm: {slurm}", flush=True)
        local = local_run(model, work / "b", a.steps)
        print(f"local: {local}", flush=True)
        preempt = preemption_run(c, model, work / "c", a.steps)
        print(f"preemption: {preempt}", flush=True)
    result = {"command": "megarl bench slurm " + " ".join(argv or sys.argv[1:]), "steps": a.steps,
              "slurm": slurm, "local": local, "preemption": preempt,
              "slurm_vs_local": slurm["median_step_s"] / local["median_step_s"]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_slurm.json").write_text(json.dumps(result, indent=1) + "\n")
    png = plot(result, out / "bench_slurm.png")
    print(f"sbatch -> first step {slurm['sbatch_to_first_step_s']:.0f}s; median step Slurm {slurm['median_step_s']:.2f}s "
          f"vs launch local {local['median_step_s']:.2f}s ({result['slurm_vs_local']:.2f}x); preemption: checkpoint "
          f"{preempt['signal_to_checkpoint_s']:.1f}s after the signal, requeued {preempt['signal_to_requeued_s']:.0f}s "
          f"after it, {preempt['steps_lost']} step(s) lost, resumed step {preempt['requeued_start_to_resumed_step_s']:.0f}s "
          f"after the restart; {out / 'bench_slurm.json'}{', ' + str(png) if png else ''}")
    return 0


if __name__ == "__main__":
    from megarl.utils.errors import run_main

    sys.exit(run_main(main, "megarl bench slurm"))  # SlurmUnavailable & co: one line, the table's exit code
