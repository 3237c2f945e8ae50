"""DAPO's dynamic sampling (``algorithm.dynamic_sampling``): a step trains on prompt groups whose rewards vary.

A group whose samples all scored the same reward has advantage exactly 0 under every estimator
(grpo, dr_grpo, rloo): it adds no policy gradient, only cost (and, under token-mean aggregation, it
dilutes the others' loss). After a step's batch is scored, such groups are **dropped** and the batch
is **refilled** with further prompts from the data cursor (``RolloutQueue.refill``: the prompts after
everything admitted so far, generated now under the generator's weights), exactly as many as are
missing, so every prompt consumed is trained or dropped and none is generated only to be discarded.
Refill rounds repeat until the step has ``prompts_per_step`` varying groups or ``max_refill_rounds``
rounds are spent.

A step still short after its rounds is **padded** back to ``prompts_per_step`` groups with its
dropped groups (the first ones consumed; advantage 0), so every step's batch keeps the shape the
validator checked (``trainer.minibatches`` and ``trainer.dp`` split whole groups): the padding trains
as the step would have without dynamic sampling. The first such step is logged (one WARNING per run);
every step counts them in ``batch/padded_groups``.

Each step's row of metrics.jsonl has ``batch/dropped_groups`` (groups consumed and not trained),
``batch/refill_rounds`` and ``batch/padded_groups`` (0 when off). ``<run folder>/dynamic_sampling.jsonl``
records, per step, every group consumed: its prompt index in the step (the ``p`` of the sample ids
``s<step>p<index>k<sample>``), its position in the prompt stream, its rewards and its fate
(``trained``, ``padding``, ``dropped``). Over a run each stream position appears there exactly once.

Resume: a refill runs inside one step (after the preemptible wait for the step's batch, with the
preemption deferred like reward and training), so no checkpoint holds one; a kill during it resumes
from a checkpoint written before the step, whose cursor precedes the refill's prompts, and the file is
rewound with metrics.jsonl (:meth:`DynamicSampling.rewind`): the step is played again from the same
prompts, nothing lost or repeated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from megarl.controller.rollouts import RolloutQueue, StepRollouts
from megarl.controller.run import DYNAMIC_SAMPLING_RECORD
from megarl.rollout import Sample
from megarl.utils.faults import pause_point
from megarl.utils.metrics import PhaseTimer, append_jsonl, rewind_jsonl

log = logging.getLogger("megarl")

RECORD_FILE = DYNAMIC_SAMPLING_RECORD  # a run file (controller/run.py): --overwrite deletes it, a fresh start sees it

# scores (tasks of the step's prompt indices, samples) -> (scored samples, reward counts): the loop's reward call
Scorer = Callable[[list, list[Sample]], tuple[list[Sample], dict[str, float]]]


def all_equal(group: list[Sample]) -> bool:
    """Every sample of the group scored the same reward: every estimator's advantage is exactly 0."""
    return len({s.reward for s in group}) == 1


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    """The samples (ordered by group then sample) split into their prompt groups, in order."""
    out: dict[int, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.group_id, []).append(s)
    return list(out.values())


class DynamicSampling:
    """Drops all-equal groups from a step's batch and refills it from the cursor; records each step."""

    def __init__(self, *, enabled: bool, max_refill_rounds: int, prompts_per_step: int, run_dir: Path):
        self.enabled, self.max_rounds, self.per_step = enabled, max_refill_rounds, prompts_per_step
        self.path = Path(run_dir) / RECORD_FILE
        self.warned = False

    def rewind(self, step: int) -> None:
        """Keep the records of steps up to ``step`` (the checkpoint resumed from; 0: a fresh run)."""
        rewind_jsonl(self.path, step)

    def select(self, step: int, batch: StepRollouts, rollouts: RolloutQueue, score: Scorer, trainer_version: int,
               timer: PhaseTimer, reward_counts: dict[str, float]) -> tuple[list[Sample], dict[str, float], dict]:
        """(the samples to train, batch/* metrics, this step's record for :meth:`log`)
        from its scored ``batch``; with dynamic sampling off, the batch as it is. The refills' reward
        counts (reward/timeouts, reward/errors, reward/worker_deaths) are added to ``reward_counts``."""
        metrics = {"batch/dropped_groups": 0.0, "batch/refill_rounds": 0.0, "batch/padded_groups": 0.0}
        if not self.enabled:
            return batch.samples, metrics, {}
        tasks = list(batch.tasks)  # by prompt index: the batch's, then each refill's (the reward reads answers here)
        position = dict(zip(range(batch.first_index, batch.first_index + len(batch.positions)), batch.positions))
        kept, dropped = self._split(batch.samples)
        rounds = 0
        while len(kept) < self.per_step and rounds < self.max_rounds:
            rounds += 1
            log.info("dynamic_sampling: step %d has %d of %d groups with varying rewards; refill round %d: %d further "
                     "prompt(s) from stream position %d", step, len(kept), self.per_step, rounds,
                     self.per_step - len(kept), rollouts.next_prompt)
            pause_point(f"refill@{step}")  # fault tests: a kill here lands while a refill is under way
            with timer.phase("generate"):
                more = rollouts.refill(step, self.per_step - len(kept), first_index=len(tasks),
                                       trainer_version=trainer_version)
            tasks += more.tasks
            position.update(zip(range(more.first_index, more.first_index + len(more.positions)), more.positions))
            samples, counts = score(tasks, more.samples)
            for key, value in counts.items():
                if key.startswith("reward/"):  # counts of samples or processes; turn metrics stay the batch's
                    reward_counts[key] = reward_counts.get(key, 0) + value
            varying, equal = self._split(samples)
            kept, dropped = kept + varying, dropped + equal
        padding, dropped = dropped[:self.per_step - len(kept)], dropped[self.per_step - len(kept):]
        if padding and not self.warned:
            self.warned = True
            log.warning("dynamic_sampling: step %d has %d of controller.prompts_per_step=%d groups with varying "
                        "rewards after algorithm.max_refill_rounds=%d refill round(s); it trains padded with %d "
                        "all-equal group(s) (advantage 0); later such steps are not logged, counted in "
                        "batch/padded_groups", step, len(kept), self.per_step, rounds, len(padding))
        trained = sorted(kept + padding, key=lambda g: g[0].prompt_index)
        fate = {id(g): "trained" for g in kept} | {id(g): "padding" for g in padding} | {id(g): "dropped" for g in dropped}
        record = {"step": step, "refill_rounds": rounds, "groups": [
            {"index": g[0].prompt_index, "prompt": position[g[0].prompt_index], "rewards": [s.reward for s in g],
             "fate": fate[id(g)]} for g in sorted(kept + padding + dropped, key=lambda g: g[0].prompt_index)]}
        metrics.update({"batch/dropped_groups": float(len(dropped)), "batch/refill_rounds": float(rounds),
                        "batch/padded_groups": float(len(padding))})
        return [s for g in trained for s in g], metrics, record

    def log(self, record: dict) -> None:
        """Append one step's record (written with the step's trained samples; nothing when off)."""
        if record:
            with self.path.open("a") as fh:
                append_jsonl(fh, record)

    @staticmethod
    def _split(samples: list[Sample]) -> tuple[list[list[Sample]], list[list[Sample]]]:
        groups = groups_of(samples)
        return [g for g in groups if not all_equal(g)], [g for g in groups if all_equal(g)]


__all__ = ["DynamicSampling", "RECORD_FILE", "all_equal", "groups_of"]
