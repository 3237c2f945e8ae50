"""Rollouts ahead of the trainer: the controller's channel to the generator, bounded by the policy lag.

``fill(step)`` keeps the batches of steps ``step .. step + max_policy_lag`` submitted, so at most
``max_policy_lag + 1`` batches are ever generated ahead of the trainer (the admission rule of
megarl/controller/staleness.py). While the trainer trains step ``s``, the generator works on the
later batches with the weights it has; weight updates land between decode steps, so a rollout's
tokens carry the versions that produced them. A batch generated for step ``s + k`` starts at weights
``s - 1`` or newer and is trained at trainer version ``s + k - 1``: lag at most ``k <= max_policy_lag``.
``max_policy_lag: 0`` submits one batch at a time: the synchronous, strictly on-policy baseline, with
the same code.

``take(step, version)`` waits for that step's groups and re-checks the bound on every sample
(``staleness.policy_lag``). A group with a token older than the bound (e.g. a partial rollout resumed
late) is never trained on and never dropped: its prompt is generated again, and it is counted.
Prompts of a step are a function of the step (``PromptSource.batch``), so after a resume the stream
continues with no prompt lost or repeated.
"""

from __future__ import annotations

import collections
import logging
import time

from megarl.controller.staleness import policy_lag

log = logging.getLogger("megarl")


class RolloutQueue:
    def __init__(self, generator, prompts, *, prompts_per_step: int, max_policy_lag: int, last_step: int):
        self.generator, self.prompts = generator, prompts
        self.per_step, self.lag, self.last_step = prompts_per_step, max_policy_lag, last_step
        self.n_samples = generator.cfg.n_samples
        self.pending: dict[int, tuple[list, list, list[int]]] = {}  # step -> (tasks, prompt ids, group ids)
        self.pool: dict[int, list] = collections.defaultdict(list)  # group id -> finished samples
        self.next_step: int | None = None
        self.submitted_at: dict[int, float] = {}
        self.regenerated = 0  # groups generated again because a sample was older than the bound

    def fill(self, step: int) -> None:
        """Submit every batch up to step ``step + max_policy_lag`` not yet submitted."""
        if self.next_step is None:
            self.next_step = step
        while self.next_step <= min(step + self.lag, self.last_step):
            tasks, prompt_ids = self.prompts.batch(self.next_step - 1, self.per_step)
            groups = self.generator.submit(prompt_ids, prompt_indices=list(range(len(prompt_ids))))
            self.pending[self.next_step] = (tasks, prompt_ids, list(groups))
            self.submitted_at[self.next_step] = time.monotonic()
            self.next_step += 1

    def take(self, step: int, trainer_version: int) -> tuple[list, list, list, dict[str, float]]:
        """(tasks, prompt ids, samples ordered by group then sample, lag metrics) of ``step``."""
        tasks, prompt_ids, groups = self.pending.pop(step)
        while True:
            self._wait_for(groups)
            stale = [g for g in groups if any(policy_lag(s.versions, trainer_version) > self.lag
                                              for s in self.pool[g])]
            if not stale:
                break
            self.regenerated += len(stale)
            log.warning("step %d: %d group(s) hold tokens older than max_policy_lag=%d; generating them again",
                        step, len(stale), self.lag)
            for g in stale:
                index = self.pool.pop(g)[0].prompt_index
                (new,) = self.generator.submit([prompt_ids[index]], prompt_indices=[index])
                groups[groups.index(g)] = new
        samples = [s for g in groups for s in sorted(self.pool.pop(g), key=lambda s: s.sample_index)]
        metrics = self._lag_metrics(samples, trainer_version)
        # submit -> all samples in hand: the generation time of a synchronous step; with lag > 0 an
        # upper bound (the batch may have finished while the trainer trained)
        metrics["gen/batch_latency_s"] = time.monotonic() - self.submitted_at.pop(step)
        return tasks, prompt_ids, samples, metrics

    def _wait_for(self, groups: list[int]) -> None:
        missing = lambda: sum(max(0, self.n_samples - len(self.pool[g])) for g in groups)  # noqa: E731
        while missing():
            for s in self.generator.collect(min_samples=1):
                self.pool[s.group_id].append(s)

    def _lag_metrics(self, samples, trainer_version: int) -> dict[str, float]:
        hist = collections.Counter(trainer_version - v for s in samples for v in s.versions)
        tokens = max(sum(hist.values()), 1)
        out = {"lag/max": float(max(hist, default=0)), "lag/mean": sum(k * n for k, n in hist.items()) / tokens,
               "lag/regenerated_groups": float(self.regenerated)}
        out.update({f"lag/tokens_{k}": float(hist.get(k, 0)) for k in range(self.lag + 1)})
        return out


__all__ = ["RolloutQueue"]
