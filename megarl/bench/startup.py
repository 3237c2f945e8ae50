"""Benchmark: a job's start-up, trainer and generator one after the other vs together, side by side.

What ``megarl train`` does before its first step, timed alone: the config's trainer (Megatron ranks:
import, process group, model + optimizer) and generator (vLLM replicas: import, engine, weights),
started as the controller starts them (megarl/executors/base.py: ``start_together``):

- **sequential**: the trainer is launched and awaited, then the generator (what every job did before
  they started together, and what ``cluster.share_devices`` still does);
- **together**: both are launched, then each is awaited.

The modes alternate (sequential, together, sequential, ...) for ``--trials`` rounds, so the machine's
noise hits both alike. Per mode: the median seconds until both are ready, and when each one was
(from the first launch). ``ratio`` = sequential's median / together's: what a job's start-up (and
every requeue's) gains. On one 2-core machine the two start-ups share the cores; on GPU nodes they
do not, and the ratio tends to (trainer + generator) / max(trainer, generator).

Writes bench_startup.json and bench_startup.png under ``--out``.

    megarl bench startup configs/quickstart.yaml [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from megarl.bench.step import check_config, config_arg

MODES = ("sequential", "together")


def start_once(cfg, model_dir: Path, run_dir: Path, mode: str) -> dict:
    """Start the trainer and the generator of ``cfg`` in ``mode``, close them; seconds from the first
    launch until each was ready, and until both were."""
    from megarl.executors.base import start_in_turn, start_together
    from megarl.generator.executor import GeneratorExecutor
    from megarl.trainer.executor import TrainerExecutor
    from megarl.utils.procs import parse_cpu_list

    trainer = TrainerExecutor(cfg.trainer, cfg.algorithm, model_dir, total_steps=cfg.controller.steps, run_dir=run_dir,
                              cpus=parse_cpu_list(cfg.cluster.trainer_cpus) or None)
    generator = GeneratorExecutor(cfg.generator, model_dir)
    start = start_together if mode == "together" else start_in_turn
    with ExitStack() as stack:
        ready = start(stack, {"trainer": trainer, "generator": generator})
    return {"mode": mode, "both_s": max(ready.values()), "trainer_s": ready["trainer"],
            "generator_s": ready["generator"]}


def mode_stats(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in ("both_s", "trainer_s", "generator_s")} | {
        "runs": runs}


def plot(result: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the start-up bench")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 2.8))
    for row, mode in enumerate(MODES):
        m = result[mode]
        if mode == "sequential":  # the generator is launched when the trainer is ready
            spans = [(0.0, m["trainer_s"], "tab:blue"),
                     (m["trainer_s"], m["generator_s"] - m["trainer_s"], "tab:orange")]
        else:
            spans = [(0.0, m["trainer_s"], "tab:blue"), (0.0, m["generator_s"], "tab:orange")]
        for i, (start, width, color) in enumerate(spans):
            ax.barh(row + (i - 0.5) * 0.35, width, left=start, height=0.33, color=color,
                    label=("trainer", "generator")[i] if row == 0 else None)
        ax.text(m["both_s"], row, f" {m['both_s']:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(MODES)), MODES)
    ax.set_xlabel("seconds from the first launch until ready (medians)")
    ax.set_title(f"start-up: sequential / together = {result['ratio']:.2f}x ({result['trials']} trial(s) each)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(prog="megarl bench startup", description=__doc__.split("\n")[0])
    config_arg(p)
    p.add_argument("overrides", nargs="*", help="dotted overrides (section.key=value)")
    p.add_argument("--trials", type=int, default=3, help="sequential+together rounds (default 3)")
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args()
    check_config(p, a.config)
    from megarl.config import load_config
    from megarl.config.job import resolve_model
    from megarl.controller.startup import prepare_process, setup_logging

    cfg = load_config(a.config, a.overrides)
    setup_logging()
    prepare_process(cfg)  # cluster.device before torch is imported, as `megarl train` does
    model_dir = resolve_model(cfg.model.path)
    out = Path(a.out)
    t0 = time.monotonic()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="megarl-bench-startup-") as tmp:  # the ranks' logs: not kept
        for trial in range(a.trials):
            for mode in MODES:
                print(f"[{time.strftime('%H:%M:%S')}] {mode} start {trial + 1}/{a.trials}", flush=True)
                runs[mode].append(start_once(cfg, model_dir, Path(tmp) / f"{mode}-{trial}", mode))
    result = {"config": a.config, "overrides": a.overrides, "trials": a.trials,
              **{m: mode_stats(r) for m, r in runs.items()}}
    result["ratio"] = result["sequential"]["both_s"] / result["together"]["both_s"]
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["bench_wall_s"] = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_startup.json").write_text(json.dumps(result, indent=1) + "\n")
    for m in MODES:
        print(f"{m:10s}: both ready in {result[m]['both_s']:.1f}s (trainer at {result[m]['trainer_s']:.1f}s, "
              f"generator at {result[m]['generator_s']:.1f}s; medians of {a.trials})")
    print(f"ratio sequential/together {result['ratio']:.2f}x")
    plot(result, out / "bench_startup.png")
    print(f"wrote {out / 'bench_startup.json'} and {out / 'bench_startup.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
