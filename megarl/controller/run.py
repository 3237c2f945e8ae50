"""The run folder people read: config.yaml, metrics.jsonl + TensorBoard, the per-step phase line
with progress, eval_samples.jsonl (held-out replies), trained_samples.jsonl (the id, tokens' CRC
and policy versions of every sample each step trained on), metrics.png, summary.json (the run
summary: the mode and why, phase medians, executors' busy/idle, overlap, and at lag 0 the most an
async run could gain), and the reward-hacking watch."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from megarl.config import ConfigError, to_dict
from megarl.config.schema import MegaRLConfig
from megarl.controller.state import RESUME_KEYS, resume_keys
from megarl.controller.summary import StepTimings
from megarl.utils.checkpoint_store import META, delete_all, list_checkpoints, step_folders, step_of
from megarl.utils.metrics import append_jsonl, rewind_jsonl

log = logging.getLogger("megarl")

# Panels of metrics.png: what a person checks first, learning and the signs of a gamed reward.
PLOT_KEYS = ("reward/mean", "eval/accuracy", "eval/format_rate", "gen/truncated_frac", "gen/mean_length",
             "train/loss", "time/step")
EVAL_SAMPLES_KEPT = 16  # held-out replies written per eval (replies)


class RunFolder:
    """``<logging.out_dir>/<name>/``: everything a run writes besides checkpoints."""

    def __init__(self, cfg: MegaRLConfig, n_eval: int):
        import yaml

        from megarl.utils.metrics import MetricsLogger

        self.cfg = cfg
        self.path = Path(cfg.logging.out_dir) / cfg.name
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        log.info("run folder %s", self.path.resolve())
        log.info("mode: %s", cfg.controller.lag_choice or f"max_policy_lag {cfg.controller.max_policy_lag}")
        self.metrics = MetricsLogger(self.path, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard)
        self.n_eval = n_eval
        self._evals: list[tuple[float, float]] = []  # (mean training reward since the last eval, accuracy)
        self._rewards: list[float] = []  # training reward of each step since the last eval
        self._timings = StepTimings()  # this process's steps, for the summary
        self._first_step = self._last_step = 0  # the steps this process trained (first > 1: it resumed)
        self._t0: float | None = None  # when that step began: the ETA's clock (start-up is not step time)
        self.samples_path = self.path / "trained_samples.jsonl"
        self._logged: set[int] = set()  # the steps metrics.jsonl kept at a resume's rewind

    def rewind(self, step: int) -> None:
        """Resuming from the step-``step`` checkpoint: forget what later steps of the killed run
        wrote (they trained weights that were never saved), so every step appears once."""
        for path in (self.samples_path, self.path / "eval_samples.jsonl"):
            rewind_jsonl(path, step)
        self._logged = rewind_jsonl(self.metrics.jsonl_path, step)
        self.metrics.reopen()

    def restore_row(self, step: int, row: dict | None) -> None:
        """After :meth:`rewind`: write step ``step``'s metrics row saved with its checkpoint (``row``),
        when the killed run was stopped between that save and the row's log (loop.py logs it after)."""
        if row is None or step in self._logged or not self.cfg.logging.jsonl:
            return
        self.metrics.log(step, row)
        log.info("resume: step %d's metrics row, not logged before the job stopped, written from its checkpoint", step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """One line per trained step: each sample's id, completion CRC, length and versions."""
        with self.samples_path.open("a") as fh:
            append_jsonl(fh, {"step": step, "samples": rows})

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.metrics.close()

    def log(self, step: int, total: int, metrics: dict) -> None:
        """Record one training step; print its phase line; watch for a gamed reward at evals."""
        from megarl.utils.metrics import phase_line

        if "reward/mean" in metrics and self.cfg.controller.eval_every:  # the window _watch compares; none without evals
            self._rewards.append(metrics["reward/mean"])
        if "eval/accuracy" in metrics:
            self._watch(metrics["eval/accuracy"])
        self.metrics.log(step, metrics)
        self._timings.add(metrics)
        self._last_step = step
        if self._t0 is None:  # this process's first step: the clock starts when its timer did (before its eval, save)
            self._first_step = step
            self._t0 = time.monotonic() - sum(metrics.get(k, 0.0) for k in ("time/step", "eval/seconds",
                                                                              "checkpoint/seconds"))
        if step % self.cfg.logging.log_every == 0 or step == total or "eval/accuracy" in metrics:
            log.info("%s %s", self._progress(step, total), phase_line(step, total, metrics))

    def _progress(self, step: int, total: int, width: int = 20) -> str:
        """`[#####---------------] 25% ETA 3m05s`: from this process's mean step since its first began
        (evals and saves included, the executors' start not)."""
        done = len(self._timings)
        left = total - step
        eta = (time.monotonic() - (self._t0 or time.monotonic())) / max(done, 1) * left
        filled = int(width * step / max(total, 1))
        return f"[{'#' * filled}{'-' * (width - filled)}] {100 * step / max(total, 1):3.0f}% ETA {_duration(eta)}"

    def log_eval(self, step: int, total: int, metrics: dict) -> None:
        """The baseline evaluation before any training step (labelled as in the step lines)."""
        from megarl.utils.metrics import EVAL_LABELS, labelled

        self._evals.append((float("nan"), metrics["eval/accuracy"]))
        self.metrics.log(step, metrics)
        took = f" | eval {metrics['eval/seconds']:.1f}s" if "eval/seconds" in metrics else ""
        log.info("step %d/%d (before training)%s | %s", step, total, took, " | ".join(labelled(metrics, EVAL_LABELS)))

    def write_eval_samples(self, step: int, rows: list[dict]) -> None:
        with (self.path / "eval_samples.jsonl").open("a") as fh:
            for row in rows[:EVAL_SAMPLES_KEPT]:
                fh.write(json.dumps({"step": step, **row}) + "\n")

    def _watch(self, accuracy: float) -> None:
        """Warn when the training reward rose while strict held-out accuracy fell: against the
        previous eval and against the first (baseline accuracy, first window's reward)."""
        from megarl.controller.evaluation import hacking_warning

        reward = sum(self._rewards) / len(self._rewards) if self._rewards else float("nan")
        self._rewards = []
        self._evals.append((reward, accuracy))
        if len(self._evals) < 3:  # baseline + first window: nothing to compare the reward with yet
            return
        first_reward = self._evals[1][0]
        for prev_reward, prev_acc in ((first_reward, self._evals[0][1]), self._evals[-2]):
            warning = hacking_warning(prev_reward, reward, prev_acc, accuracy, self.n_eval)
            if warning:
                log.warning(warning)
                return

    def finish(self, steps: int) -> None:
        from megarl.controller.summary import summarize, summary_lines
        from megarl.utils.metrics import plot_metrics

        summary = summarize(self._timings.rows(), self.cfg.controller.max_policy_lag, self.cfg.controller.lag_choice)
        if summary:
            # which steps it covers: this process's (after a resume, not the whole run's; metrics.jsonl has all)
            resumed = self._first_step - 1
            summary.update({"covers": "session" if resumed > 0 else "run", "first_step": float(self._first_step),
                            "last_step": float(self._last_step),
                            "run_steps": float(steps), "resumed_at": float(resumed)})
            (self.path / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            for line in summary_lines(summary):
                log.info("%s", line)
        plot = plot_metrics(self.metrics.jsonl_path, self.path / "metrics.png", keys=PLOT_KEYS, title=self.cfg.name)
        log.info("done: %d steps; metrics in %s%s", steps, self.metrics.jsonl_path, f", plot {plot}" if plot else "")


# ------------------------------------------------------------------------------ rerun semantics
# What a run writes that a second run would append to or mix with (besides its checkpoints).
DYNAMIC_SAMPLING_RECORD = "dynamic_sampling.jsonl"  # algorithm.dynamic_sampling's per-step record
RUN_FILES = ("metrics.jsonl", "trained_samples.jsonl", "eval_samples.jsonl", DYNAMIC_SAMPLING_RECORD)
RUN_EXTRAS = ("summary.json", "metrics.png", "tensorboard")  # deleted with them on overwrite


class RunFolderConflict(ConfigError):
    """A rerun that would mix two runs in one run folder, or resume another model's or data's
    checkpoint: refused before anything starts, in one line (exit 2, like any config error)."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.problems = [message]


def claim_run_folder(cfg: MegaRLConfig) -> Path | None:
    """Decide, before anything starts, what this run does with its run folder; the one verified step
    folder it resumes from (config/job.py ``ResolvedJob.resume_dir``), or None: start over.

    * A checkpoint to resume from ('auto', the default, finds the newest complete one): resume, and
      say so (the step, the run folder); refused, naming the key, when the checkpoint was written
      for another model.path or data.train_path.
    * Starting over (--fresh / trainer.resume_from=null, or nothing to resume) in a folder that
      holds an earlier run's files: refused in one line naming the folder and the ways on, unless
      logging.overwrite, which deletes them first. A new or empty folder just starts."""
    from megarl.controller.state import FILE, pin_resume, run_checkpoint_root

    path = Path(cfg.logging.out_dir) / cfg.name
    asked = cfg.trainer.resume_from
    step_dir = pin_resume(cfg, path)
    if step_dir is not None:
        _refuse_other_run(cfg, step_dir, FILE, path)
        step = _checkpoint_step(step_dir)
        left = cfg.controller.steps - step
        log.info("resume: %s holds a checkpoint at step %d (%s): resuming at step %d of %d%s (trainer.resume_from=%s; "
                 "`megarl train --overwrite` starts over in it)", path, step, step_dir, step, cfg.controller.steps,
                 "" if left > 0 else ": nothing left to train", asked)
        return step_dir
    root = run_checkpoint_root(cfg)
    found = [name for name in RUN_FILES if (path / name).is_file() and (path / name).stat().st_size]
    found += [str(p.relative_to(path) if p.is_relative_to(path) else p) for p in step_folders(root)]
    if not found:
        return None
    if not cfg.logging.overwrite:
        # only the ways that work: a rerun without --fresh resumes only a complete checkpoint, which
        # 'auto' just found none of (e.g. a job stopped before its first save)
        if asked not in (None, ""):
            how, resume = "no complete checkpoint to resume from", ""
        else:
            how = "this run starts over (--fresh / trainer.resume_from=null)"
            resume = "resume it (rerun without --fresh), " if list_checkpoints(root) else ""  # saved (unverified)
        raise RunFolderConflict(
            f"run folder {path} holds an earlier run ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}) and "
            f"{how}: starting over there would mix two runs. To go on, {resume}rerun with --overwrite to start over "
            f"in it (logging.overwrite=true: deletes its metrics, samples and checkpoints), or give this run another "
            f"name= (e.g. name={cfg.name}-2)")
    for name in (*RUN_FILES, *RUN_EXTRAS):
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    delete_all(root)  # step folders, stray save folders, `latest` (megarl/utils/checkpoint_store.py)
    log.warning("logging.overwrite: deleted the earlier run's files in %s (%s); starting over", path, ", ".join(found))
    return None


def close_finished_run(cfg: MegaRLConfig, step_dir: Path) -> bool:
    """A rerun whose checkpoint ``step_dir`` (claim_run_folder's) is at controller.steps or later has
    nothing to train: True, having done only what a resume does to the run folder (drop the rows of
    steps after it; write back its metrics row when the job stopped between its save and the row's
    log, and redraw metrics.png then), so the caller exits 0 before any executor, sync or probe starts
    (they took ~47 s, and with trainer.dp=8 ran out of GPU memory, to train nothing)."""
    from megarl.controller.state import load_controller_state, own_checkpoint
    from megarl.utils.metrics import MetricsLogger, plot_metrics

    step = _checkpoint_step(step_dir)
    if step < cfg.controller.steps:
        return False
    path = Path(cfg.logging.out_dir) / cfg.name
    logged = rewind_jsonl(path / "metrics.jsonl", step)  # as RunFolder.rewind and DynamicSampling.rewind do
    for name in RUN_FILES[1:]:
        rewind_jsonl(path / name, step)
    try:
        state = load_controller_state(step_dir, policy_version=step, data_seed=cfg.data.seed)
    except ValueError as e:
        raise ConfigError([f"trainer.resume_from={cfg.trainer.resume_from!r}: {e}"]) from None
    row = (state or {}).get("metrics_row") if own_checkpoint(cfg, step_dir) else None  # another run's: not ours
    plot = ""
    if row is not None and step not in logged and cfg.logging.jsonl:  # RunFolder.restore_row
        metrics = MetricsLogger(path, jsonl=True, tensorboard=cfg.logging.tensorboard)
        metrics.log(step, row)
        metrics.close()
        log.info("resume: step %d's metrics row, not logged before the job stopped, written from its checkpoint", step)
        drawn = plot_metrics(metrics.jsonl_path, path / "metrics.png", keys=PLOT_KEYS, title=cfg.name)
        plot = f", plot {drawn}" if drawn else ""
    log.info("done: the run in %s is finished (step %d of %d); nothing to train, so nothing was started%s", path,
             step, cfg.controller.steps, plot)
    return True


def _checkpoint_step(step_dir: Path) -> int:
    try:
        return int(json.loads((step_dir / META).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return step_of(step_dir.name) or 0


def _refuse_other_run(cfg: MegaRLConfig, step_dir: Path, state_file: str, path: Path) -> None:
    """Refuse a checkpoint recorded for another model.path / data.train_path (its controller
    state's ``run``; for a checkpoint without it, the run folder's config.yaml)."""
    import yaml

    saved: dict = {}
    try:
        saved = json.loads((step_dir / state_file).read_text()).get("run") or {}
    except (OSError, ValueError):
        pass
    if not saved and (path / "config.yaml").is_file():
        try:
            old = yaml.safe_load((path / "config.yaml").read_text()) or {}
            saved = {k: str((old.get(k.split(".")[0]) or {}).get(k.split(".")[1])) for k in RESUME_KEYS
                     if (old.get(k.split(".")[0]) or {}).get(k.split(".")[1]) is not None}
        except (OSError, yaml.YAMLError, AttributeError):
            saved = {}
    now = resume_keys(cfg)
    for key in RESUME_KEYS:
        if key in saved and not _same_place(saved[key], now[key]):
            raise RunFolderConflict(
                f"run folder {path}: its checkpoint {step_dir.name} was trained with {key}={saved[key]}, this run "
                f"has {key}={now[key]}: resuming would continue another run. Use {key}={saved[key]} to resume it, "
                f"start over with --fresh --overwrite, or give this run another name= (e.g. name={cfg.name}-2)")


def _same_place(a: str, b: str) -> bool:
    """Equal values, or two spellings of one existing path."""
    if a == b:
        return True
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
