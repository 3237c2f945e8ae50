"""Soak: a long tiny async job (lag 2, partial rollouts), and what its processes hold over time.

Runs ``megarl train configs/tiny_test.yaml`` on a tiny random model for ``--steps`` steps and samples
every process of the job (the controller and everything it started: trainer ranks, vLLM replicas,
scoring processes) after step ``--early``, every ``--every`` steps after it, and after step
``steps - 5``: resident memory (RSS), open file descriptors, and the job's shared-memory files in
/dev/shm; then, after the job ends, whether any /dev/shm file or process of it is left. Growth of
each process's RSS between the first and the last sample is the figure (issue 21's goal: under 5%);
its rate over the first and the second half of the samples tells a leak (the same rate in both
halves) from warm-up (a rate that falls towards 0). Writes soak.json and soak.png (RSS per process
against the step).

    .venv/bin/python tools/soak.py [--steps 200] [--early 20] [--every 0] [--out runs/...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def _portable_arg(arg: str) -> str:
    """A job argument for the committed JSON: its path value (after key=) without this machine's folders."""
    key, eq, value = arg.rpartition("=")
    if value.startswith("/"):
        from megarl.utils.paths import portable_path

        return f"{key}{eq}{portable_path(value)}"
    return arg


def _rows(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _sample(root: psutil.Process) -> dict[int, dict]:
    """pid -> {role, rss_mb, fds} for the controller and every descendant."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            with p.oneshot():
                cmd = " ".join(p.cmdline())
                role = ("controller" if p.pid == root.pid else "trainer/replica/scorer (spawned)"
                        if "multiprocessing" in cmd else cmd[:60])
                out[p.pid] = {"role": role, "ppid": p.ppid(), "rss_mb": p.memory_info().rss / 2**20,
                              "fds": p.num_fds()}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _rates(samples: dict, pid: int) -> dict:
    """RSS growth of ``pid`` in MB per 100 steps over the first and the second half of its samples
    (a leak keeps its rate; warm-up's falls towards 0). Empty with fewer than 3 samples."""
    pts = [(v["step"], v["procs"][pid]["rss_mb"]) for v in samples.values() if pid in v["procs"]]
    if len(pts) < 3:
        return {}
    mid = len(pts) // 2
    rate = lambda a, b: 100 * (b[1] - a[1]) / max(b[0] - a[0], 1)
    return {"mb_per_100_steps_first_half": round(rate(pts[0], pts[mid]), 3),
            "mb_per_100_steps_second_half": round(rate(pts[mid], pts[-1]), 3)}


def _plot(result: dict, path: Path) -> None:
    """RSS of every sampled process against the step (skipped without matplotlib)."""
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the soak's memory plot")
    if plt is None:
        return
    roles = {str(g["pid"]): g["role"] for g in result["per_process"]}
    fig, ax = plt.subplots(figsize=(7, 4))
    for pid, pts in result["rss_by_step"].items():
        if len(pts) > 1:
            base = pts[0][1]
            ax.plot([p[0] for p in pts], [100 * (p[1] / base - 1) for p in pts], marker="o", ms=3,
                    label=f"{roles.get(pid, pid)[:32]} ({base:.0f} MB)")
    ax.axhline(5, color="red", ls="--", lw=0.8, label="5% goal")
    ax.set_xlabel("step")
    ax.set_ylabel("RSS growth since the first sample (%)")
    ax.set_title(f"soak: {result['steps']} steps of the tiny async job")
    ax.legend(fontsize=7)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--early", type=int, default=20)
    ap.add_argument("--every", type=int, default=0, help="also sample every this many steps after --early "
                    "(0: only --early and steps - 5)")
    ap.add_argument("--out", default=str(REPO / "runs" / "soak"),
                    help="where soak.json / soak.png go (default runs/soak; the committed figures are in docs/)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from megarl.models.tiny import make_tiny_hf_checkpoint

    work = Path(tempfile.mkdtemp(prefix="megarl-soak-"))
    model = make_tiny_hf_checkpoint(work / "tiny", "llama", seed=0)
    shm_before = _shm()
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"), f"model.path={model}",
           f"logging.out_dir={work}", "name=soak", f"controller.steps={a.steps}", "controller.max_policy_lag=2",
           "generator.round_token_budget=4", "controller.eval_every=0", "trainer.checkpoint_interval=50",
           "logging.tensorboard=false"]
    t0 = time.monotonic()
    with open(work / "soak.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    metrics = work / "soak" / "metrics.jsonl"
    samples = {}
    points = [a.early, *(range(a.early + a.every, a.steps - 5, a.every) if a.every > 0 else ()), a.steps - 5]
    for i, at in enumerate(points):
        label = "early" if i == 0 else "late" if i == len(points) - 1 else f"step{at}"
        while _rows(metrics) < at and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
        samples[label] = {"step": _rows(metrics), "t_s": time.monotonic() - t0, "procs": _sample(root),
                          "shm_files": sorted(_shm() - shm_before)}
        print(f"{label}: step {samples[label]['step']}, {len(samples[label]['procs'])} processes, "
              f"{sum(p['rss_mb'] for p in samples[label]['procs'].values()):.0f} MB RSS", flush=True)
    code = proc.wait()
    time.sleep(2)
    after = {"exit": code, "shm_left": sorted(_shm() - shm_before),
             "alive": [pid for pid in samples.get("late", {}).get("procs", {}) if psutil.pid_exists(pid)
                       and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]}
    growth = []
    if "early" in samples and "late" in samples:
        for pid, e in samples["early"]["procs"].items():
            late = samples["late"]["procs"].get(pid)
            if late:
                growth.append({"pid": pid, "role": e["role"], "rss_early_mb": round(e["rss_mb"], 1),
                               "rss_late_mb": round(late["rss_mb"], 1),
                               "growth_pct": round(100 * (late["rss_mb"] / e["rss_mb"] - 1), 2),
                               "fds_early": e["fds"], "fds_late": late["fds"], **_rates(samples, pid)})
    result = {"command": " ".join(["tools/soak.py", *(argv or sys.argv[1:])]), "job": [_portable_arg(x) for x in cmd[3:]], "steps": a.steps,
              "wall_s": time.monotonic() - t0, "per_process": growth, "after": after,
              "shm_during": {k: v["shm_files"] for k, v in samples.items()}}
    result["rss_by_step"] = {str(pid): [[v["step"], round(v["procs"][pid]["rss_mb"], 1)] for v in samples.values()
                                        if pid in v["procs"]] for pid in samples.get("early", {}).get("procs", {})}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "soak.png")
    for g in growth:
        rates = (f", {g['mb_per_100_steps_first_half']:+.2f} then {g['mb_per_100_steps_second_half']:+.2f} MB "
                 f"per 100 steps" if "mb_per_100_steps_first_half" in g else "")
        print(f"pid {g['pid']:>7} {g['role'][:40]:<40} RSS {g['rss_early_mb']:8.1f} -> {g['rss_late_mb']:8.1f} MB "
              f"({g['growth_pct']:+.2f}%{rates}), fds {g['fds_early']} -> {g['fds_late']}")
    print(f"exit {code}; /dev/shm files left: {after['shm_left']}; processes left: {after['alive']}; "
          f"{out / 'soak.json'}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
