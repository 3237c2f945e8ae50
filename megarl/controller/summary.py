"""What each executor did per step, and the run summary: busy/idle seconds, the sync/async ratio.

Per step (``ExecutorActivity``), from the interval the step's PhaseTimer covers:

- trainer busy = train + sync (its ranks send the weights) seconds; idle = the rest of the step
  (waiting for rollouts and rewards);
- generator busy = seconds its replicas spent inside engine steps (``GeneratorExecutor.activity``,
  measured in the replica processes, averaged over replicas), load = seconds loading weights,
  idle = the rest (no admitted work: waiting for the trainer's next weights or batch).

The run summary (``summarize``) compares the median step with the step a synchronous run doing the
same work in turn would take, ``generator busy + reward + train + sync`` (phase times of this run):
their ratio is the speedup the overlap bought. At ``max_policy_lag: 0`` it is ~1 by construction
(the phases run in turn). It is an estimate from one run: on a shared host the async split also
slows each phase (fewer cores each), which ``megarl bench step`` measures with both modes side by
side.
"""

from __future__ import annotations

import statistics
from typing import Any


class ExecutorActivity:
    """Busy/idle seconds of trainer and generator over each step's timed interval."""

    def __init__(self, generator: Any):
        self.generator = generator
        self._start = generator.activity()

    def begin(self) -> None:
        """Call when the step's timer starts (work between steps, e.g. evals, is not counted)."""
        self._start = self.generator.activity()

    def end(self, times: dict[str, float]) -> dict[str, float]:
        """``times``: the step's ``PhaseTimer.finish()``; returns the ``exec/*`` metrics."""
        now = self.generator.activity()
        wall = times["time/step"]
        trainer_busy = times.get("time/train", 0.0) + times.get("time/sync", 0.0)
        gen_busy = max(0.0, now["busy_s"] - self._start["busy_s"])
        gen_load = max(0.0, now["load_s"] - self._start["load_s"])
        self._start = now
        return {"exec/trainer_busy_s": trainer_busy, "exec/trainer_idle_s": max(0.0, wall - trainer_busy),
                "exec/generator_busy_s": gen_busy, "exec/generator_load_s": gen_load,
                "exec/generator_idle_s": max(0.0, wall - gen_busy - gen_load)}


def summarize(rows: list[dict[str, float]], max_policy_lag: int) -> dict[str, float]:
    """Medians over the steps' metrics rows (steps without timings are skipped)."""
    rows = [r for r in rows if "time/step" in r]
    if not rows:
        return {}
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    out = {"steps": float(len(rows)), "max_policy_lag": float(max_policy_lag), "step_s": med("time/step")}
    for key in ("time/generate", "time/reward", "time/train", "time/sync", "time/idle", "exec/trainer_busy_s",
                "exec/trainer_idle_s", "exec/generator_busy_s", "exec/generator_load_s", "exec/generator_idle_s"):
        out[key.replace("/", "_")] = med(key)
    serial = [r.get("exec/generator_busy_s", r.get("time/generate", 0.0)) + r.get("time/reward", 0.0)
              + r.get("time/train", 0.0) + r.get("time/sync", 0.0) for r in rows]
    out["serial_step_s"] = statistics.median(serial)
    out["sync_over_async"] = out["serial_step_s"] / max(out["step_s"], 1e-9)
    gen, train = out["exec_generator_busy_s"], out["time_train"] + out["time_sync"]
    out["overlap_bound"] = (gen + train) / max(gen, train, 1e-9)
    return out


def summary_lines(s: dict[str, float]) -> list[str]:
    """The run summary as a person reads it."""
    if not s:
        return []
    pct = lambda key: 100.0 * s[key] / max(s["step_s"], 1e-9)  # noqa: E731
    mode = "synchronous (max_policy_lag 0)" if s["max_policy_lag"] == 0 else f"async (max_policy_lag {s['max_policy_lag']:.0f})"
    return [
        f"summary: {s['steps']:.0f} steps, {mode}; median step {s['step_s']:.2f}s = generate-wait "
        f"{s['time_generate']:.2f} + reward {s['time_reward']:.2f} + train {s['time_train']:.2f} + sync "
        f"{s['time_sync']:.2f} + idle {s['time_idle']:.2f}",
        f"summary: trainer busy {pct('exec_trainer_busy_s'):.0f}% (idle {s['exec_trainer_idle_s']:.2f}s waiting "
        f"for rollouts); generator busy {pct('exec_generator_busy_s'):.0f}%, loading weights "
        f"{s['exec_generator_load_s']:.2f}s, idle {s['exec_generator_idle_s']:.2f}s",
        f"summary: sync/async step-time ratio {s['sync_over_async']:.2f}x: the same work in turn (generator busy + "
        f"reward + train + sync) takes {s['serial_step_s']:.2f}s per step; overlap bound "
        f"{s['overlap_bound']:.2f}x (measure both modes side by side with `megarl bench step`)",
    ]


__all__ = ["ExecutorActivity", "summarize", "summary_lines"]
