"""The staleness rule (megarl.controller.staleness): admission capacity and the lag bound, with
values computed by hand from DESIGN's formulas.

``StalenessGate`` below is the rule per sample, with its counters and checkpoint, as a loop that
admits samples one by one would keep it. It is the reference the batch loop is held against:
``RolloutQueue.fill`` must admit, step by step, exactly the batches this gate admits."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import TypeVar

import pytest

from megarl.controller.rollouts import RolloutQueue
from megarl.controller.staleness import admission_capacity, policy_lag
from megarl.rollout import Sample

S = TypeVar("S")


class StalenessGate:
    """Admission control and the lag bound for samples of ``batch_size`` per trainer step.

    Counters: ``running`` (submitted, not back), ``accepted`` (accepted for training since the
    job began; a buffered sample that goes stale before training is taken off again),
    ``rejected_stale`` (samples found too old and sent back for regeneration, cumulative)."""

    def __init__(self, max_policy_lag: int, batch_size: int):
        if max_policy_lag < 0:
            raise ValueError(f"max_policy_lag={max_policy_lag} must be >= 0")
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be > 0")
        self.max_policy_lag = int(max_policy_lag)
        self.batch_size = int(batch_size)
        self.running = 0
        self.accepted = 0
        self.rejected_stale = 0

    # ----------------------------------------------------------------------- admission
    def capacity(self, version: int, accepted: int | None = None, running: int | None = None) -> int:
        """Samples that may be admitted at trainer version ``version`` (default counts: this
        gate's own)."""
        return admission_capacity(self.max_policy_lag, self.batch_size, version,
                                  self.accepted if accepted is None else accepted,
                                  self.running if running is None else running)

    def admit(self, n: int, version: int) -> None:
        """Record ``n`` samples submitted to the generator at trainer version ``version``;
        raises if that is more than :meth:`capacity` allows."""
        if n < 0:
            raise ValueError(f"admit({n}): n must be >= 0")
        room = self.capacity(version)
        if n > room:
            raise ValueError(f"admit({n}) at version {version}: only {room} sample(s) may be outstanding "
                             f"(max_policy_lag={self.max_policy_lag}, batch_size={self.batch_size}, "
                             f"accepted={self.accepted}, running={self.running})")
        self.running += n

    # ----------------------------------------------------------------------- the lag bound
    def trainable(self, versions: Sequence[int], trainer_version: int) -> bool:
        """Whether a sample with these per-token versions may be trained at ``trainer_version``."""
        return policy_lag(versions, trainer_version) <= self.max_policy_lag

    def accept(self, sample_versions: Sequence[int], trainer_version: int, *, buffered: bool = False) -> bool:
        """Book one sample and say whether it is trainable at ``trainer_version``.

        ``buffered=False``: the sample just came back from the generator (it leaves ``running``;
        trainable -> ``accepted``). ``buffered=True``: an accepted sample re-checked when the
        trainer takes it (the trainer may have moved on meanwhile); if stale it leaves
        ``accepted``. A stale sample counts in ``rejected_stale``: the caller must regenerate it
        (and :meth:`admit` it again)."""
        ok = self.trainable(sample_versions, trainer_version)
        if buffered:
            if self.accepted <= 0:
                raise ValueError("accept(buffered=True) but no sample is accepted")
            if not ok:
                self.accepted -= 1
        else:
            if self.running <= 0:
                raise ValueError("accept() of a sample that was never admitted (running is 0)")
            self.running -= 1
            if ok:
                self.accepted += 1
        if not ok:
            self.rejected_stale += 1
        return ok

    def filter(self, samples: Iterable[S], trainer_version: int, *, buffered: bool = False,
               versions_of: Callable[[S], Sequence[int]] | None = None) -> tuple[list[S], list[S]]:
        """``(trainable, to_regenerate)`` of ``samples`` (objects with ``.versions``, or
        ``versions_of(sample)``), booked as :meth:`accept` does; order is kept. Every sample is
        in exactly one of the two lists: the second is to be resubmitted, never dropped."""
        get = versions_of or (lambda s: s.versions)
        keep: list[S] = []
        again: list[S] = []
        for s in samples:
            (keep if self.accept(get(s), trainer_version, buffered=buffered) else again).append(s)
        return keep, again


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


def test_the_reference_refuses_misbooking():
    """A self-check of the reference (no megarl code): it refuses what would make the comparisons below
    book wrongly, so they cannot pass on a miscounted gate."""
    gate = StalenessGate(0, 2)
    with pytest.raises(ValueError, match="never admitted"):
        gate.accept([0], 0)
    with pytest.raises(ValueError, match="no sample is accepted"):
        gate.accept([0], 0, buffered=True)
    with pytest.raises(ValueError):
        gate.admit(-1, 0)
    with pytest.raises(ValueError):
        StalenessGate(-1, 2)
    with pytest.raises(ValueError):
        StalenessGate(0, 0)


class _Engines:
    """A generator that answers at once, every token from the weights it holds when submitted."""

    def __init__(self):
        self.version, self.admitted, self._done, self._groups = 0, [], [], itertools.count()

    def submit(self, prompts, n_samples=None, max_new_tokens=None, prompt_indices=None, sampling=None,
               round_token_budget=None) -> list[int]:
        groups = []
        for index in prompt_indices:
            g = next(self._groups)
            groups.append(g)
            self._done += [Sample([1], [2, 3], [0.0, 0.0], [self.version] * 2, "stop", group_id=g, sample_index=k,
                                  prompt_index=index) for k in range(n_samples)]
        self.admitted.append(len(prompts) * n_samples)
        return groups

    def collect(self, min_samples=None, timeout_s=None) -> list[Sample]:
        out, self._done = self._done, []
        assert out, "a wait for samples that no submitted group will produce"  # the queue lost a group
        return out

    def poll(self) -> list[Sample]:
        """Finished, not yet read (RolloutQueue.state_dict)."""
        out, self._done = self._done, []
        return out

    def snapshot(self, groups) -> dict:
        return {}  # every group finished at submit: no partial rollout

    def restore(self, state, groups) -> dict[int, int]:
        """As GeneratorExecutor.restore: each checkpointed group gets an id of this engine."""
        return {g: next(self._groups) for g in groups}


class _Prompts:
    def batch(self, index: int, size: int):
        return [SimpleNamespace(answer="1")] * size, [[1, 100 + index]] * size


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_batch_loop_admits_what_the_per_sample_gate_admits(lag):
    per_step, n, steps = 2, 3, 6
    batch = per_step * n
    engines = _Engines()
    queue = RolloutQueue(engines, _Prompts(), prompts_per_step=per_step, n_samples=n, max_policy_lag=lag,
                         last_step=steps)
    gate, batches = StalenessGate(lag, batch), 0
    for step in range(1, steps + 1):
        version = step - 1  # the trainer's, while it waits for this step's batch
        queue.fill(step)
        admitted_now = []
        while batches < steps and gate.capacity(version) >= batch:
            gate.admit(batch, version)
            admitted_now.append(batch)
            batches += 1
        assert engines.admitted == admitted_now, (step, engines.admitted, admitted_now)
        engines.admitted = []
        _, _, samples, lag_metrics = queue.take(step, version)
        assert len(samples) == batch and lag_metrics["lag/max"] <= lag
        keep, again = gate.filter(samples, version)
        assert len(keep) == batch and again == []
        engines.version = step  # trained: the engines get weights v = step
    assert batches == steps


@pytest.mark.parametrize("every,lag", [(1, 0), (2, 1), (2, 2), (3, 2), (3, 4)])
def test_sync_every_admits_from_the_generators_version(every, lag):
    """sync.every K: the engines get weights only after steps K, 2K, ... (push_due), admission counts from
    the version they hold (pushed_version). Every sample is then within the lag bound (none regenerated),
    and a batch's tokens carry the version pushed when it was admitted: the last push at or before
    version max(0, step - 1 - lag) (admitted as soon as pushed_version(s - 1) + lag + 1 reached it).
    Planted: held = step - 1 in RolloutQueue.fill (the trainer's version) regenerates groups at K = 2,
    lag 1 (batch 3 admitted at version 0, trained at 2), failing the regenerated count."""
    from megarl.controller.staleness import push_due, pushed_version

    per_step, n, steps = 2, 2, 9
    engines = _Engines()
    queue = RolloutQueue(engines, _Prompts(), prompts_per_step=per_step, n_samples=n, max_policy_lag=lag,
                         last_step=steps, sync_every=every)
    for step in range(1, steps + 1):
        version = step - 1
        assert engines.version == pushed_version(version, every) or step == 1
        queue.fill(step)
        _, _, samples, lag_metrics = queue.take(step, version)
        admitted_at = next(s for s in range(1, step + 1) if pushed_version(s - 1, every) + lag + 1 >= step)
        assert {v for s in samples for v in s.versions} == {pushed_version(admitted_at - 1, every)}, step
        assert lag_metrics["lag/max"] <= lag and queue.regenerated == 0
        if push_due(step, steps, every):
            engines.version = step
    assert [s for s in range(1, steps + 1) if push_due(s, steps, every)] == \
        sorted({*range(every, steps + 1, every), steps})


class _OtherPrompts(_Prompts):
    def batch(self, index: int, size: int):
        return [SimpleNamespace(answer="1")] * size, [[2, 100 + index]] * size


def test_queue_state_round_trips_through_a_json_checkpoint():
    """RolloutQueue.state_dict (the controller's part of a checkpoint) into a new queue on new engines:
    the batch admitted ahead comes back with its finished samples (none generated again), the data
    cursor continues where it stood, and a checkpoint of another prompt stream is refused."""
    per_step, n = 2, 3
    queue = RolloutQueue(_Engines(), _Prompts(), prompts_per_step=per_step, n_samples=n, max_policy_lag=1,
                         last_step=6)
    queue.fill(1)  # lag 1: steps 1 and 2 admitted
    queue.take(1, 0)
    state = json.loads(json.dumps(queue.state_dict()))  # as the checkpoint file holds it

    engines = _Engines()
    resumed = RolloutQueue(engines, _Prompts(), prompts_per_step=per_step, n_samples=n, max_policy_lag=1,
                           last_step=6)
    assert resumed.load_state_dict(state) == {"batches": 1, "finished": per_step * n, "unfinished": 0}
    _, prompt_ids, samples, _ = resumed.take(2, 1)
    assert prompt_ids == [[1, 101]] * per_step  # step 2's prompts: stream batch 1
    assert sorted(s.uid for s in samples) == sorted(f"s2p{p}k{k}" for p in range(per_step) for k in range(n))
    assert engines.admitted == []  # trained as generated, none submitted again
    resumed.fill(2)
    assert engines.admitted == [per_step * n] and resumed.pending[3][1] == [[1, 102]] * per_step  # the cursor went on

    with pytest.raises(ValueError, match="prompts differ"):
        RolloutQueue(_Engines(), _OtherPrompts(), prompts_per_step=per_step, n_samples=n, max_policy_lag=1,
                     last_step=6).load_state_dict(state)

