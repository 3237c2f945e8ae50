"""Run outputs people read: the per-step phase line, metrics.jsonl, TensorBoard, and a PNG plot."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

PHASES = ("generate", "reward", "train", "sync", "idle")


class PhaseTimer:
    """Wall-clock seconds per phase of one step; the remainder of the step counts as idle."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds = {p: 0.0 for p in PHASES}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0  # a role's own phase too

    def finish(self) -> dict[str, float]:
        total = time.monotonic() - self.start
        busy = sum(v for k, v in self.seconds.items() if k != "idle")
        self.seconds["idle"] += max(0.0, total - busy)
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": total}


# (metrics key, label, format, unit) of the step line's tail; EVAL_LABELS also make the baseline eval's
# line (run.py), so a held-out number reads the same before training and after
EVAL_LABELS = (("eval/accuracy", "eval acc", ".3f", ""), ("eval/format_rate", "eval fmt", ".2f", ""),
               ("eval/truncated_frac", "eval trunc", ".2f", ""))
STEP_LABELS = (("reward/mean", "reward", ".3f", ""), ("gen/mean_length", "len", ".1f", " tokens"),
               ("gen/truncated_frac", "trunc", ".2f", ""), ("train/loss", "loss", ".4f", ""),
               ("train/grad_norm", "gnorm", ".3f", ""), *EVAL_LABELS, ("train/loss/mismatch", "mismatch", ".4f", ""),
               ("gen/tokens_per_s", "gen", ".0f", " tok/s"), ("lag/mean", "lag", ".2f", " versions"))
# work after the step's timer (not in time/step), shown beside it so the line accounts for the wall time
AFTER_STEP = (("eval/seconds", "eval"), ("checkpoint/seconds", "ckpt"))


def labelled(metrics: dict, labels=STEP_LABELS) -> list[str]:
    """`label value[ unit]` for each of ``labels``' metrics that ``metrics`` holds as a finite number."""
    out = []
    for key, label, fmt, unit in labels:
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            out.append(f"{label} {metrics[key]:{fmt}}{unit}")
    return out


def phase_line(step: int, total_steps: int, metrics: dict) -> str:
    """`step 3/20 | 9.1s = generate 5.2 + reward 0.3 + train 3.1 + sync 0.4 + idle 0.1 | eval 2.0s | ckpt 4.1s
    | busy ... | reward 0.41 ...` (eval and ckpt: only on a step that had them)"""
    # a role's own phase (a distillation teacher's "teacher") stands before idle
    extra = [k[5:] for k in metrics if k.startswith("time/") and k[5:] not in PHASES and k != "time/step"]
    order = [*PHASES[:-1], *extra, PHASES[-1]]
    t = {p: metrics.get(f"time/{p}", 0.0) for p in order}
    parts = " + ".join(f"{p} {t[p]:.1f}" for p in order)
    after = "".join(f" | {label} {metrics[key]:.1f}s" for key, label in AFTER_STEP if key in metrics)
    busy = ""
    if "exec/trainer_busy_s" in metrics:
        wall = max(metrics.get("time/step", 0.0), 1e-9)
        busy = (f" | busy trainer {100 * metrics['exec/trainer_busy_s'] / wall:.0f}% generator "
                f"{100 * metrics['exec/generator_busy_s'] / wall:.0f}%")
    return (f"step {step}/{total_steps} | {metrics.get('time/step', 0.0):.1f}s = {parts}{after}{busy} | "
            + " | ".join(labelled(metrics)))


def append_jsonl(fh, row: dict) -> None:
    """One row appended to an open JSONL log and made durable (fsync: a few ms, against steps of
    seconds), so that a checkpoint saved after it never finds its step's row lost by a node crash."""
    fh.write(json.dumps(row) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def rewind_jsonl(path: Path, step: int) -> set[int]:
    """A resume from the step-``step`` checkpoint: keep ``path``'s rows of steps up to it, written
    atomically; the steps kept. A line that does not parse (the last one, cut or zero-filled by a
    crash mid-append) is dropped with one WARNING instead of stopping every resume."""
    from megarl.utils.checkpoint_store import write_text_atomic

    if not path.is_file():
        return set()
    keep, torn, steps = [], 0, set()
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if not isinstance(row, dict):
            torn += 1
        elif row.get("step", 0) <= step:
            keep.append(line)
            steps.add(row.get("step", 0))
    if torn:
        log.warning("%s: %d line(s) that do not parse (cut by a crash while written) dropped", path, torn)
    write_text_atomic(path, "".join(line + "\n" for line in keep))
    return steps


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The numbers of ``metrics`` as floats (a metrics row: booleans and other values left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLogger:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | Path, *, jsonl: bool = True, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._fh = self.jsonl_path.open("a") if jsonl else None
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except Exception as exc:  # noqa: BLE001 - metrics must never stop training
                log.warning("TensorBoard disabled (%s); metrics still go to %s", exc, self.jsonl_path)

    def log(self, step: int, metrics: dict) -> None:
        scalars = scalar_metrics(metrics)
        if self._fh:
            append_jsonl(self._fh, {"step": step, **scalars})
        if self._tb:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def reopen(self) -> None:
        """Reopen metrics.jsonl after it was rewritten in place (a resume's rewind)."""
        if self._fh:
            self._fh.close()
            self._fh = self.jsonl_path.open("a")

    def close(self) -> None:
        if self._fh:
            self._fh.close()
        if self._tb:
            self._tb.close()


# the y unit of a plotted metric (docs/loop.md's metrics table): by exact name, then by prefix / suffix
PLOT_UNITS = {"gen/mean_length": "tokens", "gen/tokens": "tokens", "gen/tokens_per_s": "tokens per s",
              "reward/mean": "reward", "eval/accuracy": "fraction", "lag/mean": "versions", "lag/max": "versions"}


def plot_unit(key: str) -> str:
    """The unit of metric ``key`` on a plot's y axis ("" where none is known, e.g. a loss)."""
    if key in PLOT_UNITS:
        return PLOT_UNITS[key]
    if key.startswith("time/") or key.endswith(("_s", "/seconds")):
        return "s"
    if key.endswith(("_frac", "_rate")):
        return "fraction"
    return ""


def plot_metrics(jsonl_path: str | Path, png_path: str | Path,
                 keys: tuple[str, ...] = ("reward/mean", "eval/accuracy", "train/loss", "time/step"),
                 title: str = "") -> Path | None:
    """One panel per key over steps (integer ticks, the y unit where known), ``title`` (the run's name)
    above them; returns the PNG path, or None without matplotlib / data."""
    rows = [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]
    keys = tuple(k for k in keys if any(k in r for r in rows))
    if not rows or not keys:
        return None
    from megarl.utils.plots import pyplot, save

    plt = pyplot(f"metrics are in {jsonl_path}")
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    cols = min(len(keys), 4)
    rows_n = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3 * rows_n), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 1.5
        ax.set_ylabel(plot_unit(key))
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return save(fig, png_path, dpi=100)
