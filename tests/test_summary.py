"""Busy/idle accounting and the run summary (megarl.controller.summary), on hand-worked steps."""

import math

import pytest

from megarl.controller.summary import ExecutorActivity, summarize, summary_lines


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


def test_synchronous_steps_have_ratio_one():
    """Lag 0: the generator is busy exactly while the controller waits for it."""
    rows = [_row(s, 4.0, 0.5, 3.0, 0.5, 4.0) for s in range(3)]
    s = summarize(rows, max_policy_lag=0)
    assert s["step_s"] == 8.0 and s["serial_step_s"] == 8.0 and s["sync_over_async"] == 1.0
    assert math.isclose(s["overlap_bound"], (4.0 + 3.5) / 4.0)


def test_overlapped_steps():
    """Lag 1: 4 s of generation ran while the trainer trained, 1 s was left exposed: a step of
    1 + 0.5 + 3 + 0.5 = 5 s does 4 + 0.5 + 3 + 0.5 = 8 s of work in turn -> 1.6x."""
    rows = [_row(s, 1.0, 0.5, 3.0, 0.5, 4.0) for s in range(4)] + [{"eval/accuracy": 0.5}]
    s = summarize(rows, max_policy_lag=1)
    assert s["steps"] == 4 and s["step_s"] == 5.0 and s["serial_step_s"] == 8.0
    assert s["sync_over_async"] == pytest.approx(1.6)
    lines = summary_lines(s)
    assert "async (max_policy_lag 1)" in lines[0] and "ratio 1.60x" in lines[2]


def test_no_steps_no_summary():
    assert summarize([{"eval/accuracy": 0.1}], 0) == {} and summary_lines({}) == []
