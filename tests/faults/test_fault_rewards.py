"""Reward faults: a reward function that hangs is cut at reward.timeout_s (scored wrong, counted,
the batch goes on); one that raises is counted, and too many in a batch stop the job with the
traceback; a scoring process killed mid-sample loses nothing. Test-local reward modules, loaded by
import path as users load theirs (reward.fn=module:function)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from megarl.reward import RewardConfig, RewardError, RewardPool
from megarl.rollout import Sample
from tests.harness.procs import alive

WRONG = -1.0


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    """A reward module on sys.path (inherited by the spawned scoring processes)."""
    (tmp_path / "faulty_reward.py").write_text(textwrap.dedent("""
        import time

        def judge(completion, gold, *, strict):
            if completion == "hang":
                time.sleep(3600)          # a pathological input: never returns
            if completion == "boom":
                raise ZeroDivisionError("a buggy reward on odd input")
            if completion == "slow":
                time.sleep(1.5)
            return completion.strip() == gold.strip()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "faulty_reward:judge"
    sys.modules.pop("faulty_reward", None)


def _score(pool, replies, gold="19"):
    return pool.score_texts(replies, [gold] * len(replies), ["stop"] * len(replies), [1] * len(replies))


def test_a_hanging_reward_is_cut_scored_wrong_counted_and_the_batch_goes_on(faulty):
    cfg = RewardConfig(fn=faulty, workers=2, timeout_s=1.0, wrong=WRONG, max_error_frac=0.5)
    with RewardPool(cfg, max_new_tokens=10) as pool:
        first_pids = set(pool.pids)
        got = _score(pool, ["19", "hang", "20", "boom", "19", "hang"])
        assert [s.reward for s in got] == [1.0, WRONG, WRONG, WRONG, 1.0, WRONG]
        assert pool.last_counts == {"reward/timeouts": 2, "reward/errors": 1, "reward/worker_deaths": 0}
        assert len(pool.pids) == 2 and set(pool.pids) != first_pids  # the cut processes were replaced
        # the next batch runs on the replacement processes, and counts start again
        assert [s.reward for s in _score(pool, ["19", "18"])] == [1.0, WRONG]
        assert pool.last_counts == {"reward/timeouts": 0, "reward/errors": 0, "reward/worker_deaths": 0}
        assert all(h["alive"] for h in pool.health())
    assert pool.pids == []


def test_score_returns_the_counts_for_the_step_metrics(faulty):
    samples = [Sample(prompt_ids=[1], completion_ids=[ord(c) for c in text], behav_logprobs=[0.0] * len(text),
                      versions=[0] * len(text), finish_reason="stop", prompt_index=0)
               for text in ("19", "hang", "boom", "19")]
    with RewardPool(RewardConfig(fn=faulty, workers=2, timeout_s=1.0, max_error_frac=0.5), 10) as pool:
        counts = pool.score(samples, ["19"], lambda ids: "".join(map(chr, ids)))
    assert counts == {"reward/timeouts": 1, "reward/errors": 1, "reward/worker_deaths": 0}
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0] and [s.correct for s in samples] == [
        True, False, False, True]


def test_too_many_errors_stop_the_job_with_the_traceback(faulty):
    with RewardPool(RewardConfig(fn=faulty, workers=1, timeout_s=5.0, max_error_frac=0.25), 10) as pool:
        _score(pool, ["boom", "19", "19", "19"])  # 1 of 4 = 0.25: not more than the bound, counted
        assert pool.last_counts["reward/errors"] == 1
        with pytest.raises(RewardError) as err:
            _score(pool, ["boom", "boom", "19", "19"])
    msg = str(err.value)
    assert "2 of 4 sample(s)" in msg and "reward.max_error_frac=0.25" in msg and faulty in msg
    assert "Traceback" in msg and "ZeroDivisionError: a buggy reward on odd input" in msg


def test_an_in_process_reward_that_raises_is_counted_too(monkeypatch):
    from megarl.reward import register_reward
    from megarl.reward import registry

    @register_reward("fault_test_in_process", in_process=True)
    def flaky(completion, gold, *, strict):
        if completion == "boom":
            raise ValueError("odd input")
        return completion == gold

    try:
        with RewardPool(RewardConfig(fn="fault_test_in_process", max_error_frac=0.0), 10) as pool:
            assert [s.reward for s in _score(pool, ["19", "20"])] == [1.0, 0.0]
            with pytest.raises(RewardError, match="(?s)1 of 2 sample.*ValueError: odd input"):
                _score(pool, ["19", "boom"])
    finally:
        registry._REWARDS.pop("fault_test_in_process", None)


def test_a_scoring_process_killed_mid_sample_loses_nothing(faulty):
    """The kill matrix's reward-worker point: SIGKILL while it scores; the sample is scored again on
    a fresh process, nothing is counted as an error, the death is counted, and the job goes on."""
    with RewardPool(RewardConfig(fn=faulty, workers=1, timeout_s=10.0), 10) as pool:
        assert [s.correct for s in _score(pool, ["19"])] == [True]  # the process is up and scoring
        (victim,) = pool.pids
        killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
        killer.start()
        try:
            got = _score(pool, ["slow"], gold="slow")
        finally:
            killer.cancel()
        assert [s.correct for s in got] == [True]
        assert pool.last_counts == {"reward/timeouts": 0, "reward/errors": 0, "reward/worker_deaths": 1}
        assert victim not in pool.pids and len(pool.pids) == 1


def test_a_scoring_process_killed_while_idle_is_replaced_at_the_next_batch(faulty):
    """Killed between batches (an OOM kill): the next batch's sample goes to a closed pipe, which must
    not stop the job; the death is counted and the sample scored on a fresh process."""
    with RewardPool(RewardConfig(fn=faulty, workers=1, timeout_s=10.0), 10) as pool:
        assert [s.correct for s in _score(pool, ["19"])] == [True]  # the process is up, now idle
        (victim,) = pool.pids
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while alive(victim) and time.monotonic() < deadline:  # dead (a zombie, not yet reaped)
            time.sleep(0.02)
        assert not alive(victim)
        assert [s.correct for s in _score(pool, ["19"])] == [True]
        assert pool.last_counts == {"reward/timeouts": 0, "reward/errors": 0, "reward/worker_deaths": 1}
        assert victim not in pool.pids and len(pool.pids) == 1


def test_max_error_frac_is_validated():
    bad = RewardConfig.__new__(RewardConfig)
    bad.__dict__.update(RewardConfig().__dict__, max_error_frac=1.5)
    (problem,) = bad.problems()
    assert problem.startswith("reward.max_error_frac=1.5 is out of range") and "fraction, 0..1" in problem


def test_a_reward_whose_import_kills_the_process_stops_the_job(tmp_path, monkeypatch):
    """A module that exits while being imported in a scoring process: bounded restarts, then one error."""
    (tmp_path / "dies_on_import.py").write_text(
        "import os, sys\nif os.environ.get('MEGARL_TEST_IN_WORKER'):\n    os._exit(3)\n"
        "def judge(completion, gold, *, strict):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MEGARL_TEST_IN_WORKER", "")
    try:
        with RewardPool(RewardConfig(fn="dies_on_import:judge", workers=1), 10) as pool:  # imported here: fine
            monkeypatch.setenv("MEGARL_TEST_IN_WORKER", "1")  # scoring processes spawned from now inherit it
            pool.close()
            with pytest.raises(RewardError, match="die while starting .*exited with code 3"):
                _score(pool, ["19"])
            assert pool.pids == []
    finally:
        sys.modules.pop("dies_on_import", None)
