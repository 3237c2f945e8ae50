"""The staleness gate: admission control and the policy-lag bound of the asynchronous loop.

DESIGN "Async and off-policy": every token carries the policy version that generated it; the
trainer at version ``v`` trains on a sample only if ``v - min(its token versions) <=
max_policy_lag``; and the controller keeps at most ``(max_policy_lag + v + 1) * batch_size -
(accepted + running)`` more samples outstanding (AReaL's admission rule), where ``accepted``
counts every sample accepted for training since the job began (trained or waiting in the buffer)
and ``running`` every sample submitted to the generator and not yet back. Since ``v`` steps have
consumed ``v * batch_size`` samples, the rule says: no more than ``(max_policy_lag + 1)`` batches
are ever generated ahead of the trainer, which is what keeps most samples inside the lag bound.

A sample that is nevertheless too old (partial rollouts resumed late, a slow replica) is never
trained on and never silently dropped: it is counted (``rejected_stale``) and handed back to the
caller to regenerate, so long problems are not systematically discarded.

The loop (``megarl.controller.rollouts.RolloutQueue``) admits whole batches: ``fill`` submits the
next batch while ``admission_capacity`` leaves room for one, and ``take`` re-checks ``policy_lag``
on every sample before training, regenerating a group that is too old. ``StalenessGate`` is the
same rule per sample, with its counters and ``state_dict``, for a loop that admits samples one by
one (streaming admission; not used by the batch loop)::

    gate = StalenessGate(cfg.controller.max_policy_lag, batch_size=prompts_per_step * n_samples)
    n = gate.capacity(trainer.version)              # samples that may be submitted now
    generator.submit(next_prompts(n)); gate.admit(n, trainer.version)
    ok, again = gate.filter(generator.poll(), trainer.version)   # back from the generator

``max_policy_lag: 0`` is the synchronous baseline with the same code: capacity is one batch per
version and every trained token comes from the trainer's current version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

S = TypeVar("S")


def admission_capacity(max_policy_lag: int, batch_size: int, version: int, accepted: int,
                       running: int) -> int:
    """``(max_policy_lag + version + 1) * batch_size - (accepted + running)``, never negative:
    how many samples may be submitted now."""
    return max(0, (max_policy_lag + version + 1) * batch_size - (accepted + running))


def policy_lag(versions: Sequence[int], trainer_version: int) -> int:
    """How many versions the oldest token of a sample is behind the trainer. A sample with no
    tokens has lag 0 (nothing in it is stale). A token newer than the trainer is a bookkeeping
    error and raises."""
    if not versions:
        return 0
    newest, oldest = max(versions), min(versions)
    if newest > trainer_version:
        raise ValueError(f"a token of policy version {newest} is newer than the trainer's version "
                         f"{trainer_version}: versions are out of step")
    return int(trainer_version) - int(oldest)


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

    def cancel(self, n: int = 1) -> None:
        """``n`` admitted samples will not come back (aborted, or lost with a dead engine and not
        resubmitted): release their slots."""
        if not 0 <= n <= self.running:
            raise ValueError(f"cancel({n}) with {self.running} sample(s) running")
        self.running -= n

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

    # ----------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, int]:
        """The counters, for the controller's checkpoint (JSON-serializable)."""
        return {"max_policy_lag": self.max_policy_lag, "batch_size": self.batch_size,
                "running": self.running, "accepted": self.accepted, "rejected_stale": self.rejected_stale}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters. The batch size must match (``accepted`` counts samples of past
        batches); ``max_policy_lag`` may change between runs (the config's wins). ``running``
        is restored as saved: the loop either resubmits the in-flight samples it checkpointed or
        releases them with :meth:`cancel`."""
        if int(state["batch_size"]) != self.batch_size:
            raise ValueError(f"staleness state was saved with batch_size={state['batch_size']}, "
                             f"this job has {self.batch_size}: admission counts would be wrong")
        for key in ("running", "accepted", "rejected_stale"):
            if int(state[key]) < 0:
                raise ValueError(f"staleness state: {key}={state[key]} is negative")
        self.running = int(state["running"])
        self.accepted = int(state["accepted"])
        self.rejected_stale = int(state["rejected_stale"])
