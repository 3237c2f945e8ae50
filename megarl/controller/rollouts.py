"""Rollouts ahead of the trainer: the controller's channel to the generator, bounded by the policy lag.

``fill(step)`` keeps the batches of steps ``step .. step + max_policy_lag`` submitted, so at most
``max_policy_lag + 1`` batches are ever generated ahead of the trainer (the admission rule of
megarl/controller/staleness.py). While the trainer trains step ``s``, the generator works on the
later batches with the weights it has; weight updates land between decode steps, so a rollout's
tokens carry the versions that produced them. A batch generated for step ``s + k`` starts at weights
``s - 1`` or newer and is trained at trainer version ``s + k - 1``: lag at most ``k <= max_policy_lag``.
``max_policy_lag: 0`` submits one batch at a time: the synchronous, strictly on-policy baseline, with
the same code. With ``sync.every: K`` the generator's version advances only at a push, and admission
counts from it (staleness.py: batches up to ``pushed_version(step - 1) + max_policy_lag + 1``).

``take(step, version)`` waits for that step's groups and re-checks the bound on every sample
(``staleness.policy_lag``). A group with a token older than the bound (e.g. a partial rollout resumed
late) is never trained on and never dropped: its prompt is generated again, and it is counted.
The prompt stream is read through one cursor, ``next_prompt`` (a position in ``PromptSource``'s fixed
order): each admitted batch takes the next ``prompts_per_step`` prompts, and a dynamic-sampling refill
(``refill``, megarl/controller/dynamic_sampling.py) takes the prompts after whatever was admitted
before it, generated under the weights the generator holds. Without refills step ``s`` reads positions
``(s - 1) * prompts_per_step ..``, as it always did. The cursor and every pending batch's first
position are in ``state_dict``, so after a resume the stream continues with no prompt lost or repeated.

``state_dict()`` is the controller's part of a checkpoint (written beside the trainer's): the data
cursor (``next_prompt``; checkpoints of older megarl lack it: ``(next_step - 1) * prompts_per_step``), the batches admitted ahead with their finished samples (tokens, logprobs, versions) and
their unfinished ones as partial rollouts (the rounds finished so far), and the counters.
``load_state_dict`` on resume puts them back: finished samples are trained exactly as they were
generated, partial ones continue under the resumed weights, so after a kill no sample is lost or
trained twice. Every trained sample has an id, ``s<step>p<prompt index>k<sample index>`` (a refill's
prompts continue the step's indices: ``prompts_per_step``, ``prompts_per_step + 1``, ...). A refill is
never in a checkpoint: it runs and finishes inside one step, after the preemptible wait for the step's
batch, and a kill during it resumes from a checkpoint written before the step, whose cursor precedes it.

``deterministic`` (controller.deterministic): each group is submitted with a seed key
(``s<step>p<prompt index>``, and a regeneration count when generated again), from which the
generator derives every round's seed (megarl/generator/executor.py), so the samples of a step are
the same in a run resumed from a checkpoint as in one that never stopped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, Sequence

from megarl.controller.prompts import PromptSource
from megarl.controller.staleness import admission_capacity, policy_lag, pushed_version
from megarl.data import Task
from megarl.executors.base import Generator
from megarl.rollout import Sample

log = logging.getLogger("megarl")


@dataclasses.dataclass
class StepRollouts:
    """What ``take`` and ``refill`` hand the loop: ``tasks[i]`` and ``prompt_ids[i]`` are prompt index
    ``first_index + i`` of the step, read from stream position ``positions[i]``; ``samples`` ordered by
    group then sample; ``lag_metrics`` (``take`` only)."""

    tasks: list[Task]
    prompt_ids: list[list[int]]
    samples: list[Sample]
    positions: list[int]
    first_index: int = 0
    lag_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def __iter__(self):
        """Unpacks as ``take`` returned before it had stream positions: (tasks, prompt ids, samples, lag metrics)."""
        return iter((self.tasks, self.prompt_ids, self.samples, self.lag_metrics))


class RolloutQueue:
    """The batches of the steps ahead, generating; ``n_samples`` per prompt (a GRPO group)."""

    def __init__(self, generator: Generator, prompts: PromptSource, *, prompts_per_step: int, n_samples: int,
                 max_policy_lag: int, last_step: int, deterministic: bool = False, sync_every: int = 1):
        self.generator, self.prompts = generator, prompts
        self.per_step, self.lag, self.last_step = prompts_per_step, max_policy_lag, last_step
        self.n_samples = n_samples
        self.sync_every = sync_every  # sync.every: the generator holds pushed_version(trainer version)
        self.deterministic = deterministic
        self.pending: dict[int, tuple[list[Task], list[list[int]], list[int]]] = {}  # step -> (tasks, ids, groups)
        self.first_prompt: dict[int, int] = {}  # step -> stream position of its batch's first prompt
        self.next_prompt: int | None = None  # the data cursor: stream position of the next prompt to admit
        self.pool: dict[int, list[Sample]] = collections.defaultdict(list)  # group id -> finished samples
        self.next_step: int | None = None
        self.submitted_at: dict[int, float] = {}
        self.regenerated = 0  # groups generated again because a sample was older than the bound

    def fill(self, step: int) -> None:
        """Submit every batch up to step ``pushed_version(step - 1) + max_policy_lag + 1`` (``step +
        max_policy_lag`` with sync.every 1) not yet submitted."""
        if self.next_step is None:
            self.next_step = step
        if self.next_prompt is None:  # a fresh run (or a checkpoint's cursor restored by load_state_dict)
            self.next_prompt = (self.next_step - 1) * self.per_step
        batch = self.per_step * self.n_samples
        # The admission rule (staleness.admission_capacity) at batch granularity, at the generator's
        # version p = pushed_version(step - 1) (= step - 1 with sync.every 1): (next_step - 1) batches
        # have been admitted since the job began (trained, buffered or running; a regenerated group
        # replaces one, it adds none), so there is room for another batch exactly while
        # next_step <= p + max_policy_lag + 1.
        held = pushed_version(step - 1, self.sync_every)
        while (self.next_step <= self.last_step and
               admission_capacity(self.lag, batch, held, accepted=(self.next_step - 1) * batch, running=0) >= batch):
            tasks, prompt_ids = self._prompts_at(self.next_prompt, self.per_step)
            indices = list(range(len(prompt_ids)))
            groups = self.generator.submit(prompt_ids, self.n_samples, prompt_indices=indices,
                                           **self._seeds(self.next_step, indices))
            self.pending[self.next_step] = (tasks, prompt_ids, list(groups))
            self.first_prompt[self.next_step] = self.next_prompt
            self.next_prompt += self.per_step
            self.submitted_at[self.next_step] = time.monotonic()
            self.next_step += 1

    def take(self, step: int, trainer_version: int) -> StepRollouts:
        """``step``'s batch: its tasks, prompt ids, stream positions, samples and lag metrics."""
        tasks, prompt_ids, groups = self.pending[step]  # popped once taken: a preempted wait keeps it in state_dict
        samples = self._collect_fresh(step, groups, lambda index: prompt_ids[index], trainer_version)
        del self.pending[step]
        first = self.first_prompt.pop(step)
        metrics = self._lag_metrics(samples, trainer_version)
        # submit -> all samples in hand: the generation time of a synchronous step; with lag > 0 an
        # upper bound (the batch may have finished while the trainer trained)
        metrics["gen/batch_latency_s"] = time.monotonic() - self.submitted_at.pop(step)
        return StepRollouts(tasks, prompt_ids, samples, list(range(first, first + len(prompt_ids))),
                            lag_metrics=metrics)

    def refill(self, step: int, count: int, first_index: int, trainer_version: int) -> StepRollouts:
        """Dynamic sampling: ``count`` further prompts from the cursor for ``step`` (prompt indices
        ``first_index ..``), generated now under the generator's weights; waits for their samples."""
        tasks, prompt_ids = self._prompts_at(self.next_prompt, count)
        positions = list(range(self.next_prompt, self.next_prompt + count))
        self.next_prompt += count
        indices = list(range(first_index, first_index + count))
        groups = list(self.generator.submit(prompt_ids, self.n_samples, prompt_indices=indices,
                                            **self._seeds(step, indices)))
        samples = self._collect_fresh(step, groups, lambda index: prompt_ids[index - first_index], trainer_version)
        return StepRollouts(tasks, prompt_ids, samples, positions, first_index=first_index)

    def _collect_fresh(self, step: int, groups: list[int], prompt_of: Callable[[int], list[int]],
                       trainer_version: int) -> list[Sample]:
        """Wait for ``groups`` (edited in place), generating again any group that holds a token older
        than the bound; their samples ordered by group then sample, each with its id."""
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
                (new,) = self.generator.submit([prompt_of(index)], self.n_samples, prompt_indices=[index],
                                               **self._seeds(step, [index], again=self.regenerated))
                groups[groups.index(g)] = new
        samples = [s for g in groups for s in sorted(self.pool.pop(g), key=lambda s: s.sample_index)]
        for s in samples:
            s.uid = sample_id(step, s.prompt_index, s.sample_index)
        return samples

    def _prompts_at(self, first: int, count: int) -> tuple[list[Task], list[list[int]]]:
        """(tasks, prompt ids) at stream positions ``first .. first + count - 1``."""
        if first % count == 0:  # on a batch boundary (always without refills): the step's batch as it always was
            return self.prompts.batch(first // count, count)
        rows = [self.prompts.batch(position, 1) for position in range(first, first + count)]
        return [t for ts, _ in rows for t in ts], [ids for _, idss in rows for ids in idss]

    def _seeds(self, step: int, indices: list[int], again: int = 0) -> dict:
        """``submit``'s seed keys in deterministic mode (none otherwise)."""
        if not self.deterministic:
            return {}
        return {"seed_keys": [f"s{step}p{i}" + (f"g{again}" if again else "") for i in indices]}

    def _wait_for(self, groups: list[int]) -> None:
        missing = lambda: sum(max(0, self.n_samples - len(self.pool[g])) for g in groups)  # noqa: E731
        while missing():
            for s in self.generator.collect(min_samples=1):
                self.pool[s.group_id].append(s)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Data cursor, admitted batches (finished samples + partial rollouts) and counters."""
        for s in self.generator.poll():  # finished in the engines but not yet read
            self.pool[s.group_id].append(s)
        groups = {g for _, _, gs in self.pending.values() for g in gs}
        return {"format": 1, "next_step": self.next_step, "regenerated": self.regenerated,
                "next_prompt": self.next_prompt,
                "pending": {step: {"groups": list(gs), "prompts_crc32": prompts_crc32(ids),
                                   "first_prompt": self.first_prompt[step]}
                            for step, (_, ids, gs) in self.pending.items()},
                "finished": {g: [dataclasses.asdict(s) for s in self.pool.get(g, [])] for g in groups},
                "unfinished": self.generator.snapshot(groups)}

    def load_state_dict(self, state: dict) -> dict[str, int]:
        """Resume from :meth:`state_dict` (before the first ``fill``); returns what came back.
        Raises ValueError when the data stream differs from the checkpoint's (data.* changed)."""
        if state.get("format") != 1:
            raise ValueError(f"controller state format {state.get('format')!r} is not 1")
        old_groups = [g for p in state["pending"].values() for g in p["groups"]]
        new_id = self.generator.restore(state["unfinished"], groups=old_groups)
        for step, p in sorted(state["pending"].items()):
            # without the key: a checkpoint of an older megarl, whose steps read the stream by step
            first = p.get("first_prompt", (int(step) - 1) * self.per_step)
            tasks, prompt_ids = self._prompts_at(first, self.per_step)
            if prompts_crc32(prompt_ids) != p["prompts_crc32"]:
                raise ValueError(f"step {step}: the prompts differ from the checkpoint's (CRC {prompts_crc32(prompt_ids)} != "
                                 f"{p['prompts_crc32']}); data.* changed since it was written; resume with the same "
                                 f"data settings or start a new run")
            self.pending[int(step)] = (tasks, prompt_ids, [new_id[g] for g in p["groups"]])
            self.first_prompt[int(step)] = first
            self.submitted_at[int(step)] = time.monotonic()
        finished = 0
        for g, rows in state["finished"].items():
            for row in rows:
                self.pool[new_id[int(g)]].append(Sample(**{**row, "group_id": new_id[int(g)]}))
                finished += 1
        self.next_step, self.regenerated = state["next_step"], state["regenerated"]
        self.next_prompt = state.get("next_prompt")  # None (older checkpoint): fill derives it from next_step
        return {"batches": len(state["pending"]), "finished": finished, "unfinished": len(state["unfinished"])}

    def _lag_metrics(self, samples: Sequence[Sample], trainer_version: int) -> dict[str, float]:
        hist = collections.Counter(trainer_version - v for s in samples for v in s.versions)
        tokens = max(sum(hist.values()), 1)
        out = {"lag/max": float(max(hist, default=0)), "lag/mean": sum(k * n for k, n in hist.items()) / tokens,
               "lag/regenerated_groups": float(self.regenerated)}
        out.update({f"lag/tokens_{k}": float(hist.get(k, 0)) for k in range(self.lag + 1)})
        return out


def sample_id(step: int, prompt_index: int, sample_index: int) -> str:
    """The id of a trained sample: unique in a run (each step's group is trained once)."""
    return f"s{step}p{prompt_index}k{sample_index}"


def trained_record(s: Sample) -> dict:
    """What trained_samples.jsonl keeps of one sample: id, completion CRC and length, versions."""
    return {"id": s.uid, "crc32": zlib.crc32(repr(list(s.completion_ids)).encode()), "tokens": len(s.completion_ids),
            "versions": [min(s.versions, default=-1), max(s.versions, default=-1)]}


def prompts_crc32(prompt_ids: Sequence[Sequence[int]]) -> int:
    """CRC32 of a step's prompts: equal across a straight and a resumed run iff the data stream continues."""
    return zlib.crc32(repr([list(p) for p in prompt_ids]).encode())


__all__ = ["RolloutQueue", "StepRollouts", "prompts_crc32", "sample_id", "trained_record"]
