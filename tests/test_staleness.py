"""The staleness gate (megarl.controller.staleness): admission capacity and the lag bound, with
values computed by hand from DESIGN's formulas."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megarl.controller.staleness import StalenessGate, admission_capacity, policy_lag


def test_capacity_formula_by_hand():
    # (lag + v + 1) * batch - (accepted + running)
    assert admission_capacity(0, 4, version=0, accepted=0, running=0) == 4
    assert admission_capacity(1, 4, version=0, accepted=0, running=0) == 8
    assert admission_capacity(2, 2, version=3, accepted=4, running=1) == (2 + 3 + 1) * 2 - 5 == 7
    assert admission_capacity(1, 8, version=5, accepted=40, running=8) == 56 - 48 == 8


def test_capacity_is_never_negative():
    assert admission_capacity(2, 2, version=0, accepted=10, running=5) == 0  # raw 6 - 15 = -9
    gate = StalenessGate(0, 4)
    assert gate.capacity(0, accepted=100, running=100) == 0
    gate.admit(4, 0)
    assert gate.capacity(0) == 0
    with pytest.raises(ValueError, match="only 0 sample"):
        gate.admit(1, 0)


def test_lag0_is_on_policy_one_batch_per_version():
    gate = StalenessGate(max_policy_lag=0, batch_size=4)
    assert gate.capacity(0) == 4
    gate.admit(4, 0)
    assert [gate.accept([0, 0, 0], 0) for _ in range(4)] == [True] * 4
    assert (gate.running, gate.accepted, gate.capacity(0)) == (0, 4, 0)
    # the trainer trains those 4 and moves to version 1: exactly one more batch may start
    assert gate.capacity(1) == 2 * 4 - 4 == 4
    gate.admit(4, 1)
    assert gate.accept([1, 1], 1) is True
    assert gate.accept([0, 1], 1) is False  # one token from version 0: lag 1 > 0
    assert gate.rejected_stale == 1 and gate.accepted == 5 and gate.running == 2


def test_lag1_runs_one_batch_ahead():
    gate = StalenessGate(max_policy_lag=1, batch_size=4)
    assert gate.capacity(0) == 8
    gate.admit(8, 0)
    for _ in range(4):
        assert gate.accept([0] * 3, 0)
    assert (gate.accepted, gate.running) == (4, 4)
    assert gate.capacity(0) == 0
    assert gate.capacity(1) == 3 * 4 - 8 == 4
    # partial rollouts spanning versions, judged by their oldest token
    assert gate.accept([0, 0, 1, 1], 1) is True    # lag 1
    assert gate.accept([0, 1], 2) is False         # lag 2 > 1
    assert gate.accept([1, 2, 2], 2) is True       # lag 1
    assert gate.accept([2], 2) is True             # lag 0
    assert (gate.accepted, gate.running, gate.rejected_stale) == (7, 0, 1)
    assert gate.capacity(2) == 4 * 4 - 7 == 9


def test_lag2_partial_rollouts():
    gate = StalenessGate(max_policy_lag=2, batch_size=2)
    assert gate.capacity(0) == 6
    gate.admit(3, 0)
    assert gate.capacity(0) == 3
    assert gate.accept([1, 1, 2, 3], 3) is True    # lag 2: at the bound
    assert gate.accept([0, 1, 2, 3], 3) is False   # lag 3
    assert gate.accept([3, 3], 3) is True
    assert (gate.accepted, gate.running, gate.rejected_stale) == (2, 0, 1)
    assert StalenessGate(1, 2).trainable([1, 1, 2, 3], 3) is False  # the same sample at lag 1


def test_policy_lag():
    assert policy_lag([3, 1, 2], 4) == 3      # the oldest token counts, in any order
    assert policy_lag([], 7) == 0             # no tokens: nothing is stale
    with pytest.raises(ValueError, match="newer than the trainer"):
        policy_lag([2, 5], 4)


def test_buffered_sample_going_stale_is_regenerated_and_frees_its_slot():
    gate = StalenessGate(max_policy_lag=1, batch_size=2)
    gate.admit(2, 0)
    assert gate.accept([0], 0) and gate.accept([0], 0)
    assert gate.capacity(1) == 3 * 2 - 2 == 4
    # the trainer reached version 2 before taking them: both too old now
    keep, again = gate.filter([SimpleNamespace(versions=[0], id="a"), SimpleNamespace(versions=[0, 1], id="b")],
                              2, buffered=True)
    assert keep == [] and [s.id for s in again] == ["a", "b"]
    assert (gate.accepted, gate.rejected_stale, gate.running) == (0, 2, 0)
    assert gate.capacity(2) == 4 * 2 - 0 == 8  # their slots are free for the regenerated ones


def test_filter_partitions_in_order_and_drops_nothing():
    gate = StalenessGate(max_policy_lag=1, batch_size=3)
    gate.admit(5, 0)
    samples = [{"id": i, "v": v} for i, v in enumerate([[2, 3], [1, 1], [3], [2], [0, 3]])]
    keep, again = gate.filter(samples, 3, versions_of=lambda s: s["v"])
    assert [s["id"] for s in keep] == [0, 2, 3] and [s["id"] for s in again] == [1, 4]
    assert (gate.accepted, gate.running, gate.rejected_stale) == (3, 0, 2)


def test_bookkeeping_errors():
    gate = StalenessGate(0, 2)
    with pytest.raises(ValueError, match="never admitted"):
        gate.accept([0], 0)
    with pytest.raises(ValueError, match="no sample is accepted"):
        gate.accept([0], 0, buffered=True)
    gate.admit(2, 0)
    gate.cancel(1)
    assert gate.running == 1 and gate.capacity(0) == 1
    with pytest.raises(ValueError):
        gate.cancel(2)
    with pytest.raises(ValueError):
        gate.admit(-1, 0)
    with pytest.raises(ValueError):
        StalenessGate(-1, 2)
    with pytest.raises(ValueError):
        StalenessGate(0, 0)


def test_state_round_trip():
    gate = StalenessGate(max_policy_lag=2, batch_size=4)
    gate.admit(10, 0)
    for versions in ([0], [0, 1], [0]):
        gate.accept(versions, 1)
    gate.accept([0], 3)  # stale at lag 3
    state = json.loads(json.dumps(gate.state_dict()))  # it goes into a JSON checkpoint
    assert state == {"max_policy_lag": 2, "batch_size": 4, "running": 6, "accepted": 3, "rejected_stale": 1}
    other = StalenessGate(max_policy_lag=2, batch_size=4)
    other.load_state_dict(state)
    assert other.state_dict() == gate.state_dict()
    assert other.capacity(1) == gate.capacity(1) == (2 + 1 + 1) * 4 - 9 == 7
    relaxed = StalenessGate(max_policy_lag=3, batch_size=4)  # the lag may change on resume
    relaxed.load_state_dict(state)
    assert relaxed.capacity(1) == 5 * 4 - 9 == 11
    with pytest.raises(ValueError, match="batch_size=4"):
        StalenessGate(max_policy_lag=2, batch_size=8).load_state_dict(state)
