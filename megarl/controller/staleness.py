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
on every sample before training, regenerating a group that is too old. tests/unit/test_staleness.py
keeps the rule per sample (a gate with its counters, as a streaming loop would admit) and checks
that the batch loop admits exactly what it admits.

``max_policy_lag: 0`` is the synchronous baseline with the same code: capacity is one batch per
version and every trained token comes from the trainer's current version.

``sync.every: K`` (the sync period): weights are pushed after steps K, 2K, ... (and the last), so the
generator holds ``pushed_version(v, K) = K * floor(v / K)`` while the trainer is at ``v``, and every
token is stamped with that version. The lag bound is unchanged (trainer version - token version <=
max_policy_lag, in versions = steps), and the admission rule reads the *generator's* version, not the
trainer's: batches of steps up to ``pushed_version(v) + max_policy_lag + 1`` generate. The batch of
step ``t`` is trained at version ``t - 1`` and its oldest token is at least the version admitted at,
``>= t - 1 - max_policy_lag``, so no admitted batch is ever stale. The batch of the step about to
train is admissible only if ``max_policy_lag >= K - 1`` (its tokens can be K - 1 versions old:
between pushes the generator falls behind by one version a step), which the loader checks. With K = 1
the generator's version is the trainer's and the rule is the one above. ``K`` = L + 1 gives "one
generation, K updates": after each push K batches generate from the same weights and train at lags
0 .. K - 1 (the forward lag of VACO arXiv 2603.01365 sec. 5.3, here one version per step).

A resume pushes the resumed weights (version v) at start, newer than ``pushed_version(v)``: the rule
above then admits as a run that never stopped would (so the data stream and the push cadence, by
absolute step, continue) and every bound still holds, but the batches generated before the next push
come from version v instead of ``pushed_version(v)`` (the older weights are in no checkpoint), so
with ``controller.deterministic`` a resume is bit-exact only at a checkpoint on a push step
(``trainer.checkpoint_interval`` a multiple of K).
"""

from __future__ import annotations

from collections.abc import Sequence


def admission_capacity(max_policy_lag: int, batch_size: int, version: int, accepted: int,
                       running: int) -> int:
    """``(max_policy_lag + version + 1) * batch_size - (accepted + running)``, never negative:
    how many samples may be submitted now."""
    return max(0, (max_policy_lag + version + 1) * batch_size - (accepted + running))


def pushed_version(version: int, every: int) -> int:
    """The version the generator holds while the trainer is at ``version`` in a run that pushes after
    every ``every``-th step (sync.every): the last multiple of ``every`` (the start's push is version 0)."""
    return version - version % every


def push_due(step: int, last_step: int, every: int) -> bool:
    """Whether the weights are pushed after ``step``: every ``every``-th step of the run, and the last
    one (the final eval and whatever serves the weights next see the trained ones)."""
    return step % every == 0 or step == last_step


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
