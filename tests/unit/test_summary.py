"""Busy/idle accounting and the run summary (megarl.controller.summary), the step line, the ETA and
metrics.png (megarl/utils/metrics.py, megarl/controller/run.py), on hand-worked steps."""

import math
from pathlib import Path

import pytest

from megarl.controller.summary import ExecutorActivity, hidden_fraction, summarize, summary_lines

REPO = Path(__file__).resolve().parents[2]


class _Gen:
    """The generator's cumulative counters as a test sets them (activity() is all it reads)."""

    def __init__(self):
        self.busy, self.load = 0.0, 0.0

    def activity(self):
        return {"busy_s": self.busy, "load_s": self.load}


def test_activity_is_the_difference_over_the_step():
    gen = _Gen()
    act = ExecutorActivity(gen)
    gen.busy = 7.0  # before the step: an eval, not counted
    act.begin()
    gen.busy, gen.load = 10.0, 0.5
    m = act.end({"time/step": 6.0, "time/train": 2.5, "time/sync": 0.5, "time/generate": 3.0})
    assert m == {"exec/trainer_busy_s": 3.0, "exec/trainer_idle_s": 3.0, "exec/generator_busy_s": 3.0,
                 "exec/generator_load_s": 0.5, "exec/generator_idle_s": 2.5}


def _row(step, gen_wait, reward, train, sync, gen_busy):
    total = gen_wait + reward + train + sync
    return {"time/step": total, "time/generate": gen_wait, "time/reward": reward, "time/train": train,
            "time/sync": sync, "time/idle": 0.0, "exec/generator_busy_s": gen_busy,
            "exec/trainer_busy_s": train + sync, "exec/trainer_idle_s": gen_wait + reward,
            "exec/generator_load_s": sync, "exec/generator_idle_s": total - gen_busy - sync}


def test_synchronous_steps_print_the_most_async_could_gain():
    """Lag 0: generation 6 s, then reward 0.5 + train 3 + sync 0.5 = 4 s in turn: a 10 s step. Those
    phases ran uncontended, so the ratio is printed, as the bound: (6 + 4) / max(6, 4) = 10/6 = 1.67x.
    Nothing overlapped: achieved 10/10 = 1.0x, hidden (6 + 4 - 10) / 4 = 0."""
    rows = [_row(s, 6.0, 0.5, 3.0, 0.5, 6.0) for s in range(3)]
    s = summarize(rows, max_policy_lag=0, lag_choice="synchronous, max_policy_lag 0 (auto: shared cores)")
    assert s["step_s"] == 10.0 and s["serial_step_s"] == 10.0 and s["t_gen_s"] == 6.0 and s["t_ctrl_s"] == 4.0
    assert s["overlap_achieved"] == 1.0 and s["hidden_frac"] == 0.0 and s["mode"] == "synchronous"
    assert s["sync_over_async_at_most"] == pytest.approx(10 / 6) == s["overlap_bound"]
    lines = summary_lines(s)
    assert lines[0] == "summary: mode synchronous, max_policy_lag 0 (auto: shared cores)"
    assert "ratio at most 1.67x" in lines[3] and "megarl bench step" in lines[3]


def test_overlapped_steps_print_overlap_not_a_ratio():
    """Lag 1: 4 s of generation ran while the controller scored, trained and synced (4 s); 1 s was
    left exposed: a step of 1 + 0.5 + 3 + 0.5 = 5 s does 4 + 4 = 8 s of work -> overlap 1.6x of a
    bound 8/4 = 2.0x; (4 + 4 - 5) / 4 = 75% of the shorter side hidden. Busy times measured beside
    each other give no sync/async ratio."""
    rows = [_row(s, 1.0, 0.5, 3.0, 0.5, 4.0) for s in range(4)] + [{"eval/accuracy": 0.5}]
    s = summarize(rows, max_policy_lag=1)
    assert s["steps"] == 4 and s["step_s"] == 5.0 and s["serial_step_s"] == 8.0 and s["mode"] == "async"
    assert s["overlap_achieved"] == pytest.approx(1.6) and s["overlap_bound"] == pytest.approx(2.0)
    assert s["hidden_frac"] == pytest.approx(0.75)
    assert "sync_over_async_at_most" not in s and "lag_choice" not in s
    lines = summary_lines(s)
    assert lines[0] == "summary: mode async, max_policy_lag 1"
    assert "overlap achieved 1.60x of a bound 2.00x" in lines[3] and "75% of the shorter side hidden" in lines[3]
    assert "ratio" in lines[3] and "needs `megarl bench step`" in lines[3] and "ratio at most" not in " ".join(lines)


def test_train_bound_step_hides_less_than_all_of_its_generation():
    """The quickstart's async shape: generator 11 s busy, controller 45.5 s, but the loop waited 2 s
    for rollouts: step 47.5 s. Hidden (11 + 45.5 - 47.5) / 11 = 9/11 = 82%, although the step is
    within 5% of max(T_gen, T_ctrl) (the old "fraction of the bound" read 96%)."""
    assert hidden_fraction(11.0, 45.5, 47.5) == pytest.approx(9 / 11)
    assert hidden_fraction(11.0, 45.5, 45.5) == 1.0            # all of it hidden
    assert hidden_fraction(11.0, 45.5, 60.0) == 0.0            # worse than in turn: clipped
    assert hidden_fraction(0.0, 4.0, 4.0) == 0.0               # nothing to hide
    assert hidden_fraction(6.0, 4.0, 7.0) == pytest.approx(0.75)  # generation-bound: 3 of the 4 s hidden


def test_no_steps_no_summary():
    assert summarize([{"eval/accuracy": 0.1}], 0) == {} and summary_lines({}) == []


def test_run_folder_logs_the_mode_at_start_and_writes_it_in_the_summary(tmp_path, caplog):
    """The quickstart's auto lag on a CPU resolves to 0 in the loader; the run folder says so when it
    opens, and summary.json / the summary lines carry the choice and the lag-0 bound (hand-worked:
    generator 6 s, controller 4 s -> at most 10/6 = 1.67x)."""
    import json
    from pathlib import Path

    from megarl.config import load_config
    from megarl.controller.run import RunFolder

    qs = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    cfg = load_config(qs, ["cluster.device=cpu", f"logging.out_dir={tmp_path}", "logging.tensorboard=false"])
    with caplog.at_level("INFO", logger="megarl"):
        with RunFolder(cfg, n_eval=4) as run:
            for step in (1, 2, 3):
                run.log(step, 3, _row(step, 6.0, 0.5, 3.0, 0.5, 6.0))
            run.finish(3)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "mode: synchronous, max_policy_lag 0 (auto: cluster.trainer_cpus is empty" in text
    assert "summary: mode synchronous, max_policy_lag 0 (auto" in text and "ratio at most 1.67x" in text
    s = json.loads((tmp_path / cfg.name / "summary.json").read_text())
    assert s["mode"] == "synchronous" and s["lag_choice"] == cfg.controller.lag_choice
    assert s["sync_over_async_at_most"] == pytest.approx(10 / 6)


def test_step_timings_keep_what_summarize_reads_and_nothing_else():
    """The controller keeps each step's timings for the end-of-run summary in a compact column store
    (a whole metrics dict per step grew its RSS linearly in a 1000-step soak): the summary from it
    equals the summary from the full rows, a metric a step lacked stays missing, other keys are dropped."""
    from megarl.controller.summary import SUMMARY_KEYS, StepTimings

    full = [{"time/step": 10.0 + i, "time/generate": 2.0, "time/train": 7.0 + i, "time/sync": 0.5,
             "exec/generator_busy_s": 2.0 + i, "train/loss": 0.1 * i, "gen/tokens": 100.0} for i in range(5)]
    full[2].pop("exec/generator_busy_s")  # summarize falls back to time/generate for this step
    kept = StepTimings()
    for r in full:
        kept.add(r)
    assert len(kept) == 5
    rows = kept.rows()
    assert "exec/generator_busy_s" not in rows[2] and rows[3]["exec/generator_busy_s"] == 5.0
    assert all(set(r) <= set(SUMMARY_KEYS) for r in rows)
    assert summarize(rows, 0) == summarize(full, 0)
    assert summarize(rows, 0)["t_gen_s"] == 3.0  # the median of 2, 3, 2 (the fallback), 5, 6


def test_a_teacher_and_a_critic_are_phases_of_the_step_and_of_the_controller_side():
    """Lag 0 with a distillation teacher (1 s scoring) and a critic (1.5 s values + update): generation 6 s,
    then reward 0.5 + train 3 + sync 0.5 + teacher 1 + critic 1.5 = 6.5 s in turn: a 12.5 s step. The roles'
    work is the controller side's (it waits for them), so t_ctrl = 6.5 and the bound (6 + 6.5) / 6.5 = 1.92x;
    the step line adds up with them (without them it would read 10.5 s of an unexplained 12.5 s step)."""
    rows = []
    for s in range(3):
        r = _row(s, 6.0, 0.5, 3.0, 0.5, 6.0)
        r.update({"time/teacher": 1.0, "time/critic": 1.5, "time/step": r["time/step"] + 2.5})
        rows.append(r)
    s = summarize(rows, max_policy_lag=0)
    assert s["step_s"] == 12.5 and s["time_teacher"] == 1.0 and s["time_critic"] == 1.5 and s["t_ctrl_s"] == 6.5
    assert s["sync_over_async_at_most"] == pytest.approx(12.5 / 6.5)
    lines = summary_lines(s)
    assert lines[1] == ("summary: 3 steps; median step 12.50s; phase medians: generate 6.00s, reward 0.50s, "
                        "train 3.00s, sync 0.50s, teacher 1.00s, critic 1.50s, idle 0.00s")
    assert "reward + train + sync + teacher + critic 6.50s" in lines[3]
    # a job without them: neither in the line (the earlier tests' steps)
    plain = summary_lines(summarize([_row(0, 6.0, 0.5, 3.0, 0.5, 6.0)], max_policy_lag=0))
    assert "teacher" not in plain[1] and "reward + train + sync 4.00s" in plain[3]


def test_summary_phases_are_medians_named_as_in_the_step_line():
    """Each phase is its own median, so the line does not write them as a sum of the median step: steps
    of 10, 11 and 30 s (median 11) whose generate waits are 6, 2, 2 s (median 2) and trains 3, 8, 27 s
    (median 8): 2 + 8 + ... is not 11. The names are the step line's ("generate", not "generate-wait")."""
    rows = [_row(0, 6.0, 0.5, 3.0, 0.5, 6.0), _row(1, 2.0, 0.5, 8.0, 0.5, 2.0), _row(2, 2.0, 0.5, 27.0, 0.5, 2.0)]
    lines = summary_lines(summarize(rows, max_policy_lag=0))
    assert lines[1] == ("summary: 3 steps; median step 11.00s; phase medians: generate 2.00s, reward 0.50s, "
                        "train 8.00s, sync 0.50s, idle 0.00s")
    assert summary_lines(summarize(rows[:1], max_policy_lag=0))[1].startswith("summary: 1 step; ")


def _run_folder(tmp_path, *overrides):
    from megarl.config import load_config
    from megarl.controller.run import RunFolder

    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      ["cluster.device=cpu", f"logging.out_dir={tmp_path}", "logging.tensorboard=false", *overrides])
    return cfg, RunFolder(cfg, n_eval=4)


def test_a_resumed_run_summary_says_it_covers_this_session(tmp_path, caplog, monkeypatch):
    """Resumed at step 3 of 5: this process trained steps 4 and 5. The summary says those are this
    session's, of the run's 5, and summary.json records which steps it covers; a run that started
    fresh covers the run. (metrics.png is titled with the run's name.)"""
    import json

    plotted = {}
    monkeypatch.setattr("megarl.utils.metrics.plot_metrics", lambda *a, **kw: plotted.update(kw))
    cfg, run = _run_folder(tmp_path, "controller.steps=5")
    with caplog.at_level("INFO", logger="megarl"), run:
        for step in (4, 5):
            run.log(step, 5, _row(step, 6.0, 0.5, 3.0, 0.5, 6.0))
        run.finish(5)
    text = [r.getMessage() for r in caplog.records]
    assert ("summary: 2 steps this session (steps 4-5 of the run's 5, resumed at step 3; earlier steps are in "
            "metrics.jsonl); median step 10.00s; phase medians: generate 6.00s,") in "\n".join(text)
    s = json.loads((tmp_path / cfg.name / "summary.json").read_text())
    assert (s["steps"], s["covers"], s["first_step"], s["last_step"], s["resumed_at"], s["run_steps"]) == \
        (2.0, "session", 4.0, 5.0, 3.0, 5.0)
    assert plotted["title"] == cfg.name == "quickstart"

    cfg, run = _run_folder(tmp_path / "fresh", "controller.steps=2")
    with run:
        for step in (1, 2):
            run.log(step, 2, _row(step, 6.0, 0.5, 3.0, 0.5, 6.0))
        run.finish(2)
    s = json.loads((tmp_path / "fresh" / cfg.name / "summary.json").read_text())
    assert (s["covers"], s["first_step"], s["last_step"], s["resumed_at"]) == ("run", 1.0, 2.0, 0.0)
    assert summary_lines(s)[1].startswith("summary: 2 steps; median step 10.00s")


def test_eta_counts_steps_from_the_first_step_not_the_start_up(tmp_path, monkeypatch, caplog):
    """Executors took 1000 s to start; then steps of 10 s (step 1 also evaluated 4 s and saved 6 s). The
    ETA after step 1 of 3 is its 20 s x 2 steps left = 40 s (from the start-up: (1000 + 20) x 2 = 34 min);
    after step 2, (20 + 10) / 2 x 1 = 15 s."""
    import megarl.controller.run as run_mod

    clock = [5000.0]
    monkeypatch.setattr(run_mod.time, "monotonic", lambda: clock[0])
    _, run = _run_folder(tmp_path, "controller.steps=3", "logging.log_every=1")
    clock[0] += 1000.0 + 20.0  # the executors' start, then step 1 with its eval and save
    with caplog.at_level("INFO", logger="megarl"), run:
        run.log(1, 3, {**_row(1, 6.0, 0.5, 3.0, 0.5, 6.0), "eval/seconds": 4.0, "checkpoint/seconds": 6.0})
        clock[0] += 10.0
        run.log(2, 3, _row(2, 6.0, 0.5, 3.0, 0.5, 6.0))
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert "  33% ETA 0m40s step 1/3" in lines[0] and "  67% ETA 0m15s step 2/3" in lines[1], lines


def test_step_line_shows_eval_and_checkpoint_time_and_units():
    """A 10 s step followed by a 4.2 s eval and a 32.2 s save: both beside the phases (they are not in
    time/step), only on a step that had them; a length in tokens, a lag in versions, a rate in tok/s."""
    from megarl.utils.metrics import phase_line

    row = {**_row(3, 6.0, 0.5, 3.0, 0.5, 6.0), "eval/seconds": 4.2, "checkpoint/seconds": 32.19, "reward/mean": 0.5,
           "gen/mean_length": 8.0, "lag/mean": 0.25, "gen/tokens_per_s": 34.4, "eval/accuracy": 0.25,
           "eval/format_rate": 0.5, "eval/truncated_frac": 1.0}
    assert phase_line(3, 3, row) == (
        "step 3/3 | 10.0s = generate 6.0 + reward 0.5 + train 3.0 + sync 0.5 + idle 0.0 | eval 4.2s | ckpt 32.2s | "
        "busy trainer 35% generator 60% | reward 0.500 | len 8.0 tokens | eval acc 0.250 | eval fmt 0.50 | "
        "eval trunc 1.00 | gen 34 tok/s | lag 0.25 versions")
    plain = phase_line(2, 3, _row(2, 6.0, 0.5, 3.0, 0.5, 6.0))
    assert "| eval " not in plain and "ckpt" not in plain


def test_baseline_eval_line_uses_the_step_lines_labels(tmp_path, caplog):
    from megarl.utils.metrics import phase_line

    evals = {"eval/accuracy": 0.0, "eval/format_rate": 0.0, "eval/truncated_frac": 1.0, "eval/seconds": 1.25}
    _, run = _run_folder(tmp_path)
    with caplog.at_level("INFO", logger="megarl"), run:
        run.log_eval(0, 3, evals)
    (line,) = [r.getMessage() for r in caplog.records if "before training" in r.getMessage()]
    assert line == "step 0/3 (before training) | eval 1.2s | eval acc 0.000 | eval fmt 0.00 | eval trunc 1.00"
    assert line.split(" | ", 2)[2] in phase_line(2, 3, {**_row(2, 6.0, 0.5, 3.0, 0.5, 6.0), **evals})


def test_metrics_plot_has_whole_step_ticks_units_and_the_run_name(tmp_path, monkeypatch):
    import json

    import megarl.utils.plots as plots
    from megarl.utils.metrics import plot_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "time/step": 10.0 + s, "gen/mean_length": 8.0 * s,
                                        "train/loss": 0.1, "eval/format_rate": 0.5}) + "\n" for s in (1, 2, 3)))
    drawn = {}
    real_save = plots.save

    def save(fig, png, dpi=110):
        fig.canvas.draw()
        drawn["title"] = fig._suptitle.get_text() if fig._suptitle else ""
        drawn["axes"] = {ax.get_title(): (ax.get_ylabel(), list(ax.get_xticks())) for ax in fig.axes if ax.get_visible()}
        return real_save(fig, png, dpi)

    monkeypatch.setattr(plots, "save", save)
    keys = ("time/step", "gen/mean_length", "train/loss", "eval/format_rate")
    assert plot_metrics(path, tmp_path / "m.png", keys=keys, title="tiny-test") == tmp_path / "m.png"
    assert drawn["title"] == "tiny-test"
    assert {k: v[0] for k, v in drawn["axes"].items()} == {"time/step": "s", "gen/mean_length": "tokens",
                                                           "train/loss": "", "eval/format_rate": "fraction"}
    for key, (_, ticks) in drawn["axes"].items():
        assert ticks and all(t == int(t) for t in ticks), (key, ticks)


def test_matplotlib_info_stays_off_the_console(caplog):
    """megarl's console is at INFO: matplotlib's INFO ("generated new fontManager" on a first run) is not shown."""
    import logging

    from megarl.utils.plots import pyplot

    caplog.set_level(logging.INFO)  # the root as megarl's console sets it
    assert pyplot() is not None
    assert not logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.INFO)
    assert logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.WARNING)
