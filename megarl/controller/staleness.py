"""Admission control and the policy-lag bound of the asynchronous loop (the staleness rule).

DESIGN "Async and off-policy": every token carries the policy version that generated it; the
trainer at version ``v`` trains on a sample only if ``v - min(its token versions) <=
max_policy_lag``; and the controller keeps at most ``(max_policy_lag + v + 1) * batch_size -
(accepted + running)`` more samples outstanding (AReaL's admission rule), where ``accepted``
counts every sample accepted for training since the job began (trained or waiting in the buffer)
and ``running`` every sample submitted to the generator and not yet back. Since ``v`` steps have
consumed ``v * batch_size`` samples, the rule says: no more than ``(max_policy_lag + 1)`` batches
are ever generated ahead of the trainer, which is what keeps most samples inside the lag bound.

A sample that is nevertheless too old (partial rollouts resumed late, a slow replica) is never
trained on and never silently dropped: it is counted and handed back to be regenerated, so long
problems are not systematically discarded.

The loop (``megarl.controller.rollouts.RolloutQueue``) admits whole batches: ``fill`` submits the
next batch while ``admission_capacity`` leaves room for one, and ``take`` re-checks ``policy_lag``
on every sample before training, regenerating a group that is too old. tests/test_staleness.py
keeps the rule per sample (a gate with its counters, as a streaming loop would admit) and checks
that the batch loop admits exactly what it admits.

``max_policy_lag: 0`` is the synchronous baseline with the same code: capacity is one batch per
version and every trained token comes from the trainer's current version.
"""

from __future__ import annotations

from collections.abc import Sequence


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
