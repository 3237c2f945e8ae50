"""Benchmark: one config's step time, synchronous vs asynchronous, on the same machine in one run.

Modes (each a real ``megarl train`` job of ``controller.steps`` steps; runs alternate sync, async,
sync, ... for ``--trials`` rounds so the machine's noise hits both alike):

- **sync**: ``max_policy_lag: 0``; every phase in turn on all of the machine (trainer unpinned,
  generator bound to every core): the colocated, synchronous baseline.
- **async**: ``max_policy_lag: --lag`` (default 1); the machine split between the executors
  (``--trainer-cpus`` for the trainer, ``--generator-cpus`` for the engine).

Per mode (medians over the counted steps; the first step of each run is a warm-up): step time with
its phases (exposed generate = time the controller waited for rollouts, reward, train, sync, idle),
each executor's busy and idle seconds, generated tokens/s, time to ``--target-reward`` (cumulative
step time until a step's mean reward reaches it). Then (``compare``):

- **speedup** = the sync layout's phases in turn over async's step,
  ``(T_gen(all cores) + T_reward + T_train(all cores) + T_sync) / T_step(async)``, each phase the sync
  run's median (in sync mode the generate wait is the whole generation, on every core): the choice a
  user faces on this machine. ``ratio`` = sync's median step / async's median step (the same,
  measured as whole steps, idle and bookkeeping included) is printed beside it.
- **overlap** of the async run's own phases (busy times measured beside each other, so they say
  how well the loop overlapped, not what a mode gains): with T_gen = generator busy and T_ctrl =
  reward + train + sync, achieved ``(T_gen + T_ctrl) / T_step`` of a bound ``(T_gen + T_ctrl) /
  max(T_gen, T_ctrl)``, and ``hidden_frac`` = ``(T_gen + T_ctrl - T_step) / min(T_gen, T_ctrl)``: the
  share of the shorter side's work that ran hidden behind the other (train-bound: 1 - exposed wait /
  T_gen; below 100% whenever the loop waited for rollouts). The former "% of the overlap bound",
  ``max(T_gen, T_train) / T_step``, was ~100% by construction for a train-bound step (the trainer's
  busy time is on the step's path) and is no longer reported.

Writes bench_step.json and a PNG.

    megarl bench step configs/bench_step.yaml [--trials 2] [--out runs/bench]

The config is the first argument (default ``configs/bench_step.yaml``, a source checkout's, relative
to the folder the bench runs in; an installed megarl has no ``configs/``: pass one). The jobs run in
that same folder, so a relative ``--out`` is the same folder for the bench and its jobs.

``--quick`` checks the bench end to end in about a minute (pass ``--model`` a tiny HF folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = "configs/bench_step.yaml"
QUICK = ["controller.steps=3", "controller.prompts_per_step=4", "generator.n_samples=2", "generator.max_new_tokens=8",
         "generator.dtype=float32", "data.eval_size=4", "trainer.micro_batch_size=4"]


def mode_overrides(mode: str, a: argparse.Namespace) -> list[str]:
    if mode == "sync":
        return ["controller.max_policy_lag=0", "cluster.trainer_cpus=", f"generator.threads_bind={a.all_cpus}"]
    return [f"controller.max_policy_lag={a.lag}", f"cluster.trainer_cpus={a.trainer_cpus}",
            f"generator.threads_bind={a.generator_cpus}"]


def run_once(a: argparse.Namespace, mode: str, trial: int, extra: list[str]) -> dict:
    name = f"{mode}-{trial}"
    out = Path(a.out) / "bench_step_runs"
    cmd = [sys.executable, "-m", "megarl", "train", a.config, f"name={name}", f"logging.out_dir={out}",
           *extra, *mode_overrides(mode, a), *a.overrides]
    print(f"[{time.strftime('%H:%M:%S')}] {mode} run {trial + 1}/{a.trials}: {' '.join(cmd[3:])}", flush=True)
    return run_train_job(cmd, out, name, f"bench_step: the {mode} run")


def run_train_job(cmd: list[str], out: Path, name: str, what: str) -> dict:
    """Run one ``megarl train`` job (``cmd``, whose run folder is ``out/name``) with its log in
    ``out/name.log``; its metrics rows that timed a step, the job's wall (s, start-up included) and
    the log path. A failed job ends the bench naming ``what`` and the log's last lines."""
    log_path = out / f"{name}.log"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"{what} failed (exit {code}); last lines of {log_path}:\n{tail}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/step" in r]
    wall = time.monotonic() - t0
    print(f"    {len(rows)} steps in {wall:.0f}s (job wall, start-up included)", flush=True)
    return {"rows": rows, "wall_s": wall, "log": str(log_path)}


def mode_stats(runs: list[dict], target: float) -> dict:
    rows = [r for run in runs for r in run["rows"][1:]]  # the first step of every run is a warm-up
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
    reached = []
    for run in runs:
        t, hit = 0.0, None
        for r in run["rows"]:
            t += r["time/step"]
            if hit is None and r.get("reward/mean", -1.0) >= target:
                hit = t
        reached.append(hit)
    step_s = med("time/step")
    return {
        "steps_counted": len(rows), "step_s": [r["time/step"] for r in rows], "step_median_s": step_s,
        "phases": {"generate_s": med("time/generate"), "reward_s": med("time/reward"), "train_s": med("time/train"),
                   "sync_s": med("time/sync"), "idle_s": med("time/idle")},
        "busy": {"trainer_s": med("exec/trainer_busy_s"), "generator_s": med("exec/generator_busy_s"),
                 "generator_load_s": med("exec/generator_load_s")},
        "idle": {"trainer_s": med("exec/trainer_idle_s"), "generator_s": med("exec/generator_idle_s")},
        "tokens_per_s": statistics.median(r["gen/tokens"] / r["time/step"] for r in rows),
        "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
        "time_to_target_reward_s": reached,
    }


def compare(sync: dict, asyn: dict) -> dict:
    """The bench's verdict from both modes' ``mode_stats`` (pure; see the module docstring)."""
    ph = sync["phases"]
    sync_phases = ph["generate_s"] + ph["reward_s"] + ph["train_s"] + ph["sync_s"]
    step = asyn["step_median_s"]
    t_gen = asyn["busy"]["generator_s"]
    t_ctrl = asyn["phases"]["reward_s"] + asyn["phases"]["train_s"] + asyn["phases"]["sync_s"]
    short = min(t_gen, t_ctrl)
    return {"sync_layout_phases_s": sync_phases, "speedup": sync_phases / step,
            "ratio": sync["step_median_s"] / step,
            "t_gen_s": t_gen, "t_ctrl_s": t_ctrl,
            "overlap_bound": (t_gen + t_ctrl) / max(t_gen, t_ctrl, 1e-9),
            "achieved_overlap": (t_gen + t_ctrl) / step,
            "hidden_frac": min(1.0, max(0.0, (t_gen + t_ctrl - step) / short)) if short > 0 else 0.0}


def report_lines(result: dict) -> list[str]:
    """The verdict as printed (after the per-mode lines)."""
    ph = result["sync"]["phases"]
    return [
        f"speedup sync/async = {result['speedup']:.2f}x: the sync layout's phases in turn (generate "
        f"{ph['generate_s']:.2f} + reward {ph['reward_s']:.2f} + train {ph['train_s']:.2f} + sync {ph['sync_s']:.2f} "
        f"= {result['sync_layout_phases_s']:.2f}s, every core per phase) over async's median step "
        f"{result['async']['step_median_s']:.2f}s; median steps {result['sync']['step_median_s']:.2f}s / "
        f"{result['async']['step_median_s']:.2f}s = {result['ratio']:.2f}x",
        f"async overlap: {result['achieved_overlap']:.2f}x of a bound {result['overlap_bound']:.2f}x for its own phases "
        f"(generator busy {result['t_gen_s']:.2f}s, reward + train + sync {result['t_ctrl_s']:.2f}s); "
        f"{100 * result['hidden_frac']:.0f}% of the shorter side hidden behind the other (how well the loop "
        f"overlapped; the speedup above is what it bought)",
    ]


def config_arg(p: argparse.ArgumentParser) -> None:
    """The positional config of the benches that run ``megarl train`` jobs (step, checkpoint)."""
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                   help=f"the jobs' YAML config (default {DEFAULT_CONFIG}, a source checkout's, relative to this folder)")


def check_config(p: argparse.ArgumentParser, config: str) -> None:
    """A config that is not a file ends the bench before any job starts, naming the argument."""
    if not Path(config).is_file():
        default = " (the default, a source checkout's configs/)" if config == DEFAULT_CONFIG else ""
        p.error(f"config {config}{default} not found from {Path.cwd()}: pass the config YAML as the first "
                f"argument")


def main() -> int:
    p = argparse.ArgumentParser(prog="megarl bench step", description=__doc__.split("\n")[0])
    config_arg(p)
    p.add_argument("overrides", nargs="*", help="dotted overrides for both modes (section.key=value)")
    p.add_argument("--trials", type=int, default=2, help="sync+async rounds (default 2)")
    p.add_argument("--lag", type=int, default=1, help="max_policy_lag of the async mode (default 1)")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    half = max(1, len(cpus) // 2)
    p.add_argument("--all-cpus", default=_cpu_text(cpus), help="cores of the sync mode's engine (default: all)")
    p.add_argument("--trainer-cpus", default=_cpu_text(cpus[:half]), help="async: trainer cores (default: first half)")
    p.add_argument("--generator-cpus", default=_cpu_text(cpus[half:] or cpus),
                   help="async: generator cores (default: second half)")
    p.add_argument("--target-reward", type=float, default=0.3, help="for time-to-target (mean reward of a step)")
    p.add_argument("--model", default=None, help="model.path override (e.g. a tiny HF folder with --quick)")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 trial of 3 tiny steps per mode")
    a = p.parse_args()
    check_config(p, a.config)
    extra = [f"model.path={a.model}"] if a.model else []
    if a.quick:
        extra += QUICK
        a.trials = 1
    t0 = time.monotonic()
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for trial in range(a.trials):
        for mode in ("sync", "async"):
            runs[mode].append(run_once(a, mode, trial, extra))
    result = {"config": a.config, "overrides": a.overrides + extra, "trials": a.trials, "lag": a.lag,
              "cpus": {"sync": a.all_cpus, "async_trainer": a.trainer_cpus, "async_generator": a.generator_cpus},
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "bench_wall_s": None,
              **{m: mode_stats(r, a.target_reward) for m, r in runs.items()}}
    result.update(compare(result["sync"], result["async"]))
    result["bench_wall_s"] = time.monotonic() - t0
    out = Path(a.out)
    (out / "bench_step.json").write_text(json.dumps(result, indent=1) + "\n")
    for mode in ("sync", "async"):
        m, ph = result[mode], result[mode]["phases"]
        print(f"{mode:5s}: step {m['step_median_s']:.2f}s = generate(exposed) {ph['generate_s']:.2f} + reward "
              f"{ph['reward_s']:.2f} + train {ph['train_s']:.2f} + sync {ph['sync_s']:.2f} + idle {ph['idle_s']:.2f} | "
              f"busy trainer {m['busy']['trainer_s']:.2f}s generator {m['busy']['generator_s']:.2f}s | "
              f"{m['tokens_per_s']:.1f} tok/s | reward {m['reward_mean']:.3f}")
    for line in report_lines(result):
        print(line)
    print(f"bench took {result['bench_wall_s'] / 60:.1f} min")
    plot(result, out / "bench_step.png")
    print(f"wrote {out / 'bench_step.json'} and {out / 'bench_step.png'}")
    return 0


def plot(result: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the step bench")
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    modes, left = ("sync", "async"), [0.0, 0.0]
    colors = {"generate_s": "tab:blue", "reward_s": "tab:green", "train_s": "tab:red", "sync_s": "tab:purple",
              "idle_s": "tab:gray"}
    for key, color in colors.items():
        vals = [result[m]["phases"][key] for m in modes]
        ax.barh(modes, vals, left=left, color=color, label=key[:-2])
        left = [l + v for l, v in zip(left, vals)]
    ax.set_xlabel("median step (s); generate = exposed wait")
    ax.set_title(f"speedup sync/async = {result['speedup']:.2f}x (sync layout's phases / async step); async "
                 f"hid {100 * result['hidden_frac']:.0f}% of its shorter side", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    for m, color in zip(modes, ("tab:gray", "tab:blue")):
        bx.plot(result[m]["step_s"], marker="o", color=color, label=m)
    bx.set_xlabel("counted step")
    bx.set_ylabel("step time (s)")
    bx.legend(fontsize=8)
    save(fig, path)


def _cpu_text(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


if __name__ == "__main__":
    from megarl.utils.errors import run_main

    sys.exit(run_main(main, "megarl bench step"))  # a failure: one line, the exit code of its class
