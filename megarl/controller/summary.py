"""What each executor did per step, and the run summary: busy/idle seconds, overlap, and a
sync/async ratio only where the phases behind it were measured uncontended.

Per step (``ExecutorActivity``), from the interval the step's PhaseTimer covers:

- trainer busy = train + sync (its ranks send the weights) seconds; idle = the rest of the step
  (waiting for rollouts and rewards);
- generator busy = seconds its replicas spent inside engine steps (``GeneratorExecutor.activity``,
  measured in the replica processes, averaged over replicas), load = seconds loading weights,
  idle = the rest (no admitted work: waiting for the trainer's next weights or batch).

The run summary (``summarize``) splits each step into the generator's work ``T_gen`` (busy seconds)
and the controller's path ``T_ctrl`` = reward + train + sync (the loop scores, trains and pushes
in turn; generation of later batches can run beside all three). Per step:

- ``overlap_achieved = (T_gen + T_ctrl) / T_step``: the work done in turn over the step; 1 = none
  of it overlapped; at most ``overlap_bound = (T_gen + T_ctrl) / max(T_gen, T_ctrl)``.
- ``hidden_frac = (T_gen + T_ctrl - T_step) / min(T_gen, T_ctrl)``, clipped to [0, 1]: the share
  of the shorter side's work that ran hidden behind the longer one. For a train-bound step it is
  ``1 - (exposed generate wait + idle) / T_gen``: below 1 whenever the loop waited for rollouts.
  (A "fraction of the bound" ``max(T_gen, T_ctrl) / T_step`` is ~1 by construction for such a step,
  since the trainer's busy time is on the step's own path: it is not reported.)

A **sync/async ratio** needs phases measured uncontended, as the synchronous layout runs them.
At ``max_policy_lag: 0`` they are (every phase has the whole machine, or its own resources, in
turn), and the summary prints what an async run could at most gain from them: ``overlap_bound``
(reached only if each executor kept this speed while the other works). An async run's busy times
were measured beside each other (on shared cores: contended, e.g. 11.1 s of generation on one core
against 3.3 s on two in ``docs/bench_step.json``), and nothing in it measures the synchronous
layout: its summary prints the overlap it achieved and leaves the speedup to ``megarl bench step``,
which runs both layouts side by side.
"""

from __future__ import annotations

import math
import statistics
from array import array
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


ROLE_PHASES = ("time/teacher", "time/critic")  # the optional roles' phases (loop.py), controller-side work
SUMMARY_KEYS = ("time/step", "time/generate", "time/reward", "time/train", "time/sync", "time/idle", *ROLE_PHASES,
                "exec/trainer_busy_s", "exec/trainer_idle_s", "exec/generator_busy_s", "exec/generator_load_s",
                "exec/generator_idle_s")  # every key summarize reads


class StepTimings:
    """The per-step numbers ``summarize`` needs, kept compactly for a run of any length: one
    float64 per key and step (88 bytes a step; a step's whole metrics dict, ~60 keys, is ~6.5 KB and
    grew the controller's RSS by 0.65 MB per 100 steps in a 1000-step soak, tools/soak.py)."""

    def __init__(self) -> None:
        self._cols = {key: array("d") for key in SUMMARY_KEYS}

    def __len__(self) -> int:
        return len(self._cols["time/step"])

    def add(self, metrics: dict[str, float]) -> None:
        for key, col in self._cols.items():
            col.append(float(metrics.get(key, math.nan)))  # NaN: the step had no such metric

    def rows(self) -> list[dict[str, float]]:
        """The steps as ``summarize`` takes them (a metric a step lacked is left out again)."""
        return [{k: v for k, v in zip(self._cols, values) if not math.isnan(v)} for values in zip(*self._cols.values())]


def summarize(rows: list[dict[str, float]], max_policy_lag: int, lag_choice: str = "") -> dict[str, Any]:
    """Medians over the steps' metrics rows (steps without timings are skipped). ``lag_choice``: the
    line ``controller.lag_choice`` holds (which mode ran and why)."""
    rows = [r for r in rows if "time/step" in r]
    if not rows:
        return {}
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    out: dict[str, Any] = {"steps": float(len(rows)), "max_policy_lag": float(max_policy_lag),
                           "mode": "synchronous" if max_policy_lag == 0 else "async", "step_s": med("time/step")}
    if lag_choice:
        out["lag_choice"] = lag_choice
    for key in SUMMARY_KEYS[1:]:
        out[key.replace("/", "_")] = med(key)
    gen = [r.get("exec/generator_busy_s", r.get("time/generate", 0.0)) for r in rows]
    ctrl = [sum(r.get(k, 0.0) for k in ("time/reward", "time/train", "time/sync", *ROLE_PHASES)) for r in rows]
    step = [r["time/step"] for r in rows]
    out["t_gen_s"], out["t_ctrl_s"] = statistics.median(gen), statistics.median(ctrl)
    out["serial_step_s"] = statistics.median(g + c for g, c in zip(gen, ctrl))
    out["overlap_achieved"] = statistics.median((g + c) / max(t, 1e-9) for g, c, t in zip(gen, ctrl, step))
    out["overlap_bound"] = statistics.median((g + c) / max(g, c, 1e-9) for g, c in zip(gen, ctrl))
    out["hidden_frac"] = statistics.median(hidden_fraction(g, c, t) for g, c, t in zip(gen, ctrl, step))
    if max_policy_lag == 0:  # phases measured uncontended: the most an async run could gain from them
        out["sync_over_async_at_most"] = out["overlap_bound"]
    return out


def hidden_fraction(t_gen: float, t_ctrl: float, t_step: float) -> float:
    """Share of the shorter side's work (generator busy, or reward + train + sync) that ran hidden
    behind the other: ``(t_gen + t_ctrl - t_step) / min(t_gen, t_ctrl)`` in [0, 1]."""
    short = min(t_gen, t_ctrl)
    if short <= 0:
        return 0.0
    return min(1.0, max(0.0, (t_gen + t_ctrl - t_step) / short))


def _steps_covered(s: dict[str, Any]) -> str:
    """`3 steps`, or after a resume (``covers`` "session", RunFolder.finish): the steps this process
    trained, of the run's total (metrics.jsonl holds them all)."""
    n = int(s["steps"])
    counted = f"{n} step{'' if n == 1 else 's'}"
    if s.get("covers") != "session":
        return counted
    first, last = int(s["first_step"]), int(s["last_step"])
    span = f"step {first}" if first == last else f"steps {first}-{last}"
    return (f"{counted} this session ({span} of the run's {int(s['run_steps'])}, resumed at step "
            f"{int(s['resumed_at'])}; earlier steps are in metrics.jsonl)")


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The run summary as a person reads it."""
    if not s:
        return []
    pct = lambda key: 100.0 * s[key] / max(s["step_s"], 1e-9)  # noqa: E731
    lag = int(s["max_policy_lag"])
    mode = s.get("lag_choice") or f"{s['mode']}, max_policy_lag {lag}"
    # the step line's phase names, a job's own roles' (a teacher's scoring, a critic's values and update)
    # before idle; each is its own median over the steps, so they need not add up to the median step
    roles = [k[5:] for k in ROLE_PHASES if s.get(k.replace("/", "_"))]
    phases = ", ".join(f"{p} {s[f'time_{p}']:.2f}s" for p in ("generate", "reward", "train", "sync", *roles, "idle"))
    work = "reward + train + sync" + "".join(f" + {r}" for r in roles)
    lines = [
        f"summary: mode {mode}",
        f"summary: {_steps_covered(s)}; median step {s['step_s']:.2f}s; phase medians: {phases}",
        f"summary: trainer busy {pct('exec_trainer_busy_s'):.0f}% (idle {s['exec_trainer_idle_s']:.2f}s waiting "
        f"for rollouts); generator busy {pct('exec_generator_busy_s'):.0f}%, loading weights "
        f"{s['exec_generator_load_s']:.2f}s, idle {s['exec_generator_idle_s']:.2f}s",
    ]
    if lag == 0:
        lines.append(
            f"summary: sync/async step-time ratio at most {s['sync_over_async_at_most']:.2f}x, from this run's "
            f"phases measured uncontended (generator {s['t_gen_s']:.2f}s, {work} {s['t_ctrl_s']:.2f}s) "
            f"fully overlapped; an async run reaches it only if each executor keeps this speed beside the other "
            f"(not on shared cores): `megarl bench step` measures both modes side by side")
    else:
        lines.append(
            f"summary: overlap achieved {s['overlap_achieved']:.2f}x of a bound {s['overlap_bound']:.2f}x "
            f"(generator {s['t_gen_s']:.2f}s + {work} {s['t_ctrl_s']:.2f}s of work in a "
            f"{s['step_s']:.2f}s step; {100 * s['hidden_frac']:.0f}% of the shorter side hidden). No sync/async "
            f"ratio: these busy times were measured beside each other, not as a synchronous run uses the machine; "
            f"the speedup needs `megarl bench step`")
    return lines


__all__ = ["ExecutorActivity", "ROLE_PHASES", "StepTimings", "SUMMARY_KEYS", "hidden_fraction", "summarize", "summary_lines"]
