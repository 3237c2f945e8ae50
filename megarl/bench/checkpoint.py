"""Benchmark: the step time with and without trainer.async_save, side by side in one run.

Two modes, each a real ``megarl train`` job of ``controller.steps`` steps that checkpoints every
``--interval`` steps (default 1), alternating sync, async, sync, ... for ``--trials`` rounds so the
machine's noise hits both alike:

- **sync**: ``trainer.async_save=false``: a save writes every shard before the step ends;
- **async**: ``trainer.async_save=true``: a save takes its snapshot and the next step runs while a
  background writer persists it (the next save waits only if that write is still going).

Per mode (medians over the steps after the first, a warm-up): the step with its save (``time/step``,
taken before the save, plus ``checkpoint/seconds``), ``checkpoint/seconds``
(what a save cost the step: the whole write in sync mode, the snapshot in async mode), and the wall
of the job. ``ratio`` = sync's median step / async's median step (the same work per step, so the
gain of not waiting for the write); ``save_ratio`` = sync's median save / async's.

Writes bench_checkpoint.json and bench_checkpoint.png under ``--out``.

    megarl bench checkpoint configs/bench_step.yaml trainer.params_dtype=float32 controller.steps=4 [--trials 1]

The config is the first argument, as for ``megarl bench step`` (default ``configs/bench_step.yaml``,
relative to the folder the bench runs in).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from megarl.bench.step import check_config, config_arg, run_train_job  # one job runner for both benches


def run_once(a: argparse.Namespace, mode: str, trial: int) -> dict:
    name = f"ckpt-{mode}-{trial}"
    out = Path(a.out) / "bench_checkpoint_runs"
    cmd = [sys.executable, "-m", "megarl", "train", "--overwrite", a.config, f"name={name}", f"logging.out_dir={out}",
           f"trainer.checkpoint_interval={a.interval}", f"trainer.async_save={'true' if mode == 'async' else 'false'}",
           *a.overrides]  # --overwrite: a rerun of the bench starts each job over
    print(f"[{time.strftime('%H:%M:%S')}] {mode} run {trial + 1}/{a.trials}: {' '.join(cmd[4:])}", flush=True)
    return run_train_job(cmd, out, name, f"bench_checkpoint: the {mode} run")


def mode_stats(runs: list[dict]) -> dict:
    counted = [r for run in runs for r in run["rows"][1:]]  # each run's first step: warm-up
    if not counted:
        raise SystemExit("bench_checkpoint: no step after the warm-up; set controller.steps >= 2")
    saves = [r["checkpoint/seconds"] for r in counted if "checkpoint/seconds" in r]
    # time/step is taken before the save; a step as the run lives it is the step plus what its save cost
    cycle = [r["time/step"] + r.get("checkpoint/seconds", 0.0) for r in counted]
    return {"steps": len(counted), "step_s": cycle, "step_median_s": statistics.median(cycle),
            "phases_median_s": statistics.median(r["time/step"] for r in counted),
            "save_median_s": statistics.median(saves) if saves else 0.0, "saves": len(saves),
            "train_median_s": statistics.median(r.get("time/train", 0.0) for r in counted),
            "wall_s": [run["wall_s"] for run in runs]}


def plot(result: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the checkpoint bench")
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    modes = ("sync", "async")
    ax.bar(modes, [result[m]["step_median_s"] for m in modes], color=("tab:gray", "tab:blue"), label="step")
    ax.bar(modes, [result[m]["save_median_s"] for m in modes], color="tab:red", alpha=0.7,
           label="save's cost to the step")
    ax.set_ylabel("median (s)")
    ax.set_title(f"step sync/async = {result['ratio']:.2f}x; save {result['save_ratio']:.1f}x", fontsize=9)
    ax.legend(fontsize=7)
    for m, color in zip(modes, ("tab:gray", "tab:blue")):
        bx.plot(result[m]["step_s"], marker="o", color=color, label=m)
    bx.set_xlabel("counted step")
    bx.set_ylabel("step time (s)")
    bx.legend(fontsize=8)
    save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(prog="megarl bench checkpoint", description=__doc__.split("\n")[0])
    config_arg(p)
    p.add_argument("overrides", nargs="*", help="dotted overrides for both modes (section.key=value)")
    p.add_argument("--trials", type=int, default=1, help="sync+async rounds (default 1)")
    p.add_argument("--interval", type=int, default=1, help="trainer.checkpoint_interval of both modes (steps, default 1)")
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args()
    check_config(p, a.config)
    t0 = time.monotonic()
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for trial in range(a.trials):
        for mode in ("sync", "async"):
            runs[mode].append(run_once(a, mode, trial))
    result = {"config": a.config, "overrides": a.overrides, "trials": a.trials, "interval": a.interval,
              **{m: mode_stats(r) for m, r in runs.items()}}
    result["ratio"] = result["sync"]["step_median_s"] / result["async"]["step_median_s"]
    result["save_ratio"] = result["sync"]["save_median_s"] / max(result["async"]["save_median_s"], 1e-9)
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["bench_wall_s"] = time.monotonic() - t0
    out = Path(a.out)
    (out / "bench_checkpoint.json").write_text(json.dumps(result, indent=1) + "\n")
    for m in ("sync", "async"):
        print(f"{m:5s}: step {result[m]['step_median_s']:.2f}s (train {result[m]['train_median_s']:.2f}s), "
              f"save costs the step {result[m]['save_median_s']:.2f}s, {result[m]['steps']} counted steps")
    print(f"ratio sync/async step {result['ratio']:.2f}x; save {result['save_ratio']:.1f}x")
    plot(result, out / "bench_checkpoint.png")
    print(f"wrote {out / 'bench_checkpoint.json'} and {out / 'bench_checkpoint.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
