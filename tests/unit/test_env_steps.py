"""An environment's reset() and step() are bounded (megarl/controller/turns.py `_bounded`): one that
never returns stops the job with EnvironmentStepTimeout (exit 4) naming the task and where it was
stuck, one that raises stops it with EnvironmentFailed (exit 8) naming the task; steps overlap only
when the environment says they may. No generator is needed: ``continue_rollouts`` with
``max_turns=1`` steps the given first replies once and samples nothing more."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.controller.turns import EnvironmentFailed, EnvironmentStepTimeout, continue_rollouts
from megarl.data.tasks import Task
from megarl.reward.environment import EnvState, StepResult
from megarl.rollout import Sample
from megarl.utils.errors import classify

TASKS = [Task(f"What is {i} + {i}?", str(2 * i)) for i in range(6)]
HANGS = 3  # the task whose step (or reset) never returns
# Bounds of these tests, not of the code: a bounded call returns within TIMEOUT_S plus one poll, so a
# call still running after DEADLINE_S can only be an unbounded wait (the planted break), however loaded.
TIMEOUT_S, DEADLINE_S = 2.0, 60.0


class Env:
    """Answers every reply with done and reward 1; the step (or reset) of task HANGS waits on ``release``,
    which nobody sets until the test ends: a tool that never returns."""

    name = "test-env"
    concurrent_steps = False

    def __init__(self, hang_in: str = "", fail_in: str = ""):
        self.hang_in, self.fail_in = hang_in, fail_in
        self.release = threading.Event()
        self.active = self.most_active = 0
        self.lock = threading.Lock()

    def _call(self, what: str, task) -> None:
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            time.sleep(0.01)  # long enough for parallel calls to overlap
            if task is TASKS[HANGS] and what == self.hang_in:
                self.release.wait()
            if task is TASKS[HANGS] and what == self.fail_in:
                raise ValueError("the tool's server said no")
        finally:
            with self.lock:
                self.active -= 1

    def reset(self, task):
        self._call("reset", task)
        return EnvState(task, [])

    def step(self, state, reply_ids):
        self._call("step", state.task)
        return StepResult(None, True, 1.0, {"correct": True})


class ConcurrentEnv(Env):
    concurrent_steps = True


class PairedEnv(ConcurrentEnv):
    """Each step waits for a second one to be inside step too (a barrier of 2): only steps that run at
    once can pass it; one at a time, the first would wait until the barrier's timeout breaks it."""

    def __init__(self):
        super().__init__()
        self.barrier = threading.Barrier(2, timeout=30)

    def step(self, state, reply_ids):
        self.barrier.wait()
        return super().step(state, reply_ids)


def _firsts():
    return [Sample([1, 2, 3], [4, 5], [-0.5, -0.5], [0, 0], "stop", group_id=i, prompt_index=i) for i in range(len(TASKS))]


def _run(env, timeout_s: float = TIMEOUT_S):
    """continue_rollouts on a thread of its own: (its result or exception, whether it returned in time)."""
    out = {}

    def target():
        try:
            out["value"] = continue_rollouts(None, env, TASKS, _firsts(), max_turns=1, max_new_tokens=4,
                                             max_model_len=64, step_timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["value"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    env.release.set()  # let an abandoned call end
    return out.get("value"), not t.is_alive()


@pytest.mark.parametrize("cls", [Env, PairedEnv])
def test_steps_that_return_score_every_rollout(cls):
    env = cls()
    value, returned = _run(env, timeout_s=60.0)
    assert returned and not isinstance(value, BaseException), value  # PairedEnv: its steps ran two at once
    assert [(s.reward, s.correct, s.turns, s.finish_reason) for s in value] == [(1.0, True, 1, "stop")] * len(TASKS)
    if cls is Env:  # one at a time unless the environment says its steps may overlap
        assert env.most_active == 1


@pytest.mark.parametrize("cls,hang_in", [(Env, "step"), (ConcurrentEnv, "step"), (Env, "reset")])
def test_a_call_that_never_returns_stops_the_job_naming_the_task_and_where(cls, hang_in):
    value, returned = _run(cls(hang_in=hang_in))
    assert returned, "continue_rollouts still waits on a hung environment"
    assert isinstance(value, EnvironmentStepTimeout), value
    text = str(value)
    assert f"reward.env='test-env': {hang_in}() for task 'What is 3 + 3?'" in text
    assert "reward.env_step_timeout_s" in text
    assert "in _call" in text and "self.release.wait()" in text  # the stuck thread's stack
    assert classify(value).code == 4  # megarl's own wait timed out


@pytest.mark.parametrize("cls,fail_in", [(Env, "step"), (ConcurrentEnv, "step"), (Env, "reset")])
def test_a_call_that_raises_stops_the_job_naming_the_task(cls, fail_in):
    value, returned = _run(cls(fail_in=fail_in))
    assert returned and isinstance(value, EnvironmentFailed), value
    assert str(value) == (f"reward.env='test-env': {fail_in}() raised ValueError: the tool's server said no "
                          f"(task 'What is 3 + 3?')")
    assert isinstance(value.__cause__, ValueError)  # the environment's own traceback goes to the log
    assert classify(value).code == 8
