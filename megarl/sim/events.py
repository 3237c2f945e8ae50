"""The discrete-event simulation of RL steps: generator replicas, a trainer, weight syncs.

One event queue (heapq, ordered by time then insertion) holds three kinds of event:
``replica`` (a replica reaches the end of a run of decode steps: some sequence finished or hit its
round budget, or an interrupt asked it to stop at a step boundary), ``trainer`` (a train step or a
weight sync ends) and ``ready`` (a completed batch has been scored and may be trained on). Between
two events a replica's active set is fixed, so the time of k decode steps is exact
(``DecodeCost.run_time``); a replica's pending event is invalidated by an epoch counter when it is
interrupted.

Protocol (DESIGN.md, "Async and off-policy"):
- admission: at most ``(max_policy_lag + version + 1) * batch`` samples are ever admitted, where
  ``version`` counts the weight syncs the generator has received; admitted samples wait in one FIFO
  queue and a replica takes the next one whenever it has a free slot (prefill charged on admission).
- without partial rollouts batch v is samples [v B, (v+1) B) and the trainer waits for all of them
  (the longest reply blocks the step); with a round budget R a sample that has produced R tokens
  under the current weights leaves its slot and is re-queued first after the next sync (its
  context re-prefilled), or at once when a slot would otherwise idle; batch v is the first B
  samples to finish (stragglers roll over).
- a batch is ready ``reward_s`` after its last sample finishes; training takes ``train_s(batch)``;
  then a weight sync takes ``sync_s``, during which every replica is paused (at its next step
  boundary) -- the receiving side must stop decoding to swap weights. Step time = interval between
  sync ends. ``max_policy_lag = 0`` serialises everything: the sync-mode baseline.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from typing import Callable

from megarl.sim.workload import DecodeCost


@dataclasses.dataclass
class _Seq:
    idx: int
    length: int
    prompt: int
    done: int = 0            # tokens generated so far
    round_left: int = 0      # tokens left under the current weights (partial rollouts)
    version: int = 0         # weights version of its first token
    finish_t: float = -1.0
    stop: int = 0            # decode until done == stop: its length, or its static batch's longest (padding)


@dataclasses.dataclass
class SimConfig:
    batch: int
    prompt_tokens: int
    max_policy_lag: int
    steps: int
    replicas: int
    cost: DecodeCost
    lengths: Callable[[], int]
    train_s: Callable[[list[_Seq]], float]
    sync_s: float
    reward_s: float = 0.0
    round_budget: int | None = None  # partial rollouts; None = off
    warmup: int = 2


@dataclasses.dataclass
class SimResult:
    step_s: list[float]                  # interval between consecutive sync ends
    gen_span_s: list[float]              # first admission of batch v -> its last sample finished
    train_s: list[float]
    sync_s: float
    trainer_wait_s: list[float]          # trainer idle before train step v
    generator_busy_frac: float           # replica-time decoding or prefilling / (replicas x makespan)
    max_staleness: int                   # trainer version - first-token version, worst sample
    events: int
    warmup: int

    def steady(self, xs: list[float]) -> list[float]:
        return xs[self.warmup:] or xs

    @property
    def step_median_s(self) -> float:
        return statistics.median(self.steady(self.step_s))

    @property
    def step_mean_s(self) -> float:
        return statistics.fmean(self.steady(self.step_s))

    def phase_medians(self) -> dict:
        # step_s is the steady-state mean: throughput is what a long run sees (steps can alternate)
        return {"step_s": self.step_mean_s, "step_median_s": self.step_median_s,
                "generate_span_s": statistics.median(self.steady(self.gen_span_s)),
                "train_s": statistics.median(self.steady(self.train_s)), "sync_s": self.sync_s,
                "trainer_wait_s": statistics.median(self.steady(self.trainer_wait_s)),
                "generator_busy_frac": self.generator_busy_frac, "max_staleness": self.max_staleness,
                "events": self.events}


class _Replica:
    def __init__(self, rid: int):
        self.rid = rid
        self.active: list[_Seq] = []
        self.epoch = 0
        self.seg_start = 0.0     # decoding of the current run starts here (after prefill)
        self.seg_k = 0           # steps in the current run
        self.seg_end = 0.0
        self.paused = False
        self.busy_s = 0.0


class Simulation:
    def __init__(self, cfg: SimConfig):
        if cfg.round_budget is not None and cfg.max_policy_lag < 1:
            raise ValueError("partial rollouts need max_policy_lag >= 1: at lag 0 a paused sample waits "
                             "for a sync that waits for it")
        self.c = cfg
        self.q: list = []
        self.n_ev = 0
        self.t = 0.0
        self.reps = [_Replica(i) for i in range(cfg.replicas)]
        self.pending: list[_Seq] = []      # admitted, not on a replica (resumed ones go first)
        self.waiting_round: list[_Seq] = []  # hit the round budget; resume after the next sync
        self.admitted = 0
        self.version = 0
        self.finished: list[_Seq] = []     # finish order
        self.by_idx: dict[int, _Seq] = {}
        self.consumed = 0
        self.first_admit: dict[int, float] = {}
        self.batches_done = 0              # batches whose samples have all finished
        self.done_per_batch: dict[int, int] = {}  # admission batch -> samples finished
        self.ready_members: dict[int, list[_Seq]] = {}  # scored batches the trainer may take
        self.train_step = 0                # next step to train
        self.trainer_busy = False
        self.trainer_free_t = 0.0
        self.syncing = False
        self.sync_ends: list[float] = [0.0]
        self.res = {"gen": [], "train": [], "wait": []}
        self.max_stale = 0

    # -- event queue ---------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload) -> None:
        self.n_ev += 1
        heapq.heappush(self.q, (t, self.n_ev, kind, payload))

    # -- admission -----------------------------------------------------------------------------
    def _admit(self) -> None:
        limit = (self.c.max_policy_lag + self.version + 1) * self.c.batch
        while self.admitted < limit:
            s = _Seq(self.admitted, self.c.lengths(), self.c.prompt_tokens, version=self.version)
            self.by_idx[s.idx] = s
            self.first_admit.setdefault(s.idx // self.c.batch, self.t)
            self.pending.append(s)
            self.admitted += 1

    def _fill(self) -> None:
        """Hand queued samples to replicas with free slots, round-robin so load spreads evenly."""
        static = self.c.cost.static  # a static batch takes new samples only once it is empty
        free = [r for r in self.reps if not r.paused and len(r.active) < self.c.cost.max_seqs
                and not (static and r.active)]
        if not self.pending and self.waiting_round and free:
            # work-conserving: a cut rollout waits for new weights only while others need its slot;
            # otherwise it resumes now (at lag >= 1 the window can fill with stragglers: without this
            # the trainer would wait for them and they for the trainer's next sync)
            self.pending, self.waiting_round = self.waiting_round, []
        if not self.pending or not free:
            return
        taken: dict[int, list[_Seq]] = {}
        while self.pending and free:
            for r in list(free):
                if not self.pending:
                    break
                taken.setdefault(r.rid, []).append(self.pending.pop(0))
                if len(r.active) + len(taken[r.rid]) >= self.c.cost.max_seqs:
                    free.remove(r)
        for rid, seqs in taken.items():
            r = self.reps[rid]
            self._stop_at_boundary(r)
            longest = max(s.length for s in seqs)
            for s in seqs:
                s.stop = longest if static else s.length
                s.round_left = self.c.round_budget or (s.stop - s.done)
            r.active.extend(seqs)
            prefill = self.c.cost.prefill(sum(s.prompt + s.done for s in seqs))
            start = max(self.t, r.seg_end)
            r.busy_s += prefill
            self._plan(r, start + prefill)

    # -- replicas ------------------------------------------------------------------------------
    def _plan(self, r: _Replica, start: float) -> None:
        r.epoch += 1
        if r.paused or not r.active:
            r.seg_start, r.seg_k, r.seg_end = start, 0, start
            return
        k = min(min(s.stop - s.done, s.round_left) for s in r.active)
        n, s0 = len(r.active), sum(s.prompt + s.done for s in r.active)
        r.seg_start, r.seg_k = start, k
        r.seg_end = start + self.c.cost.run_time(n, s0, k)
        self._push(r.seg_end, "replica", (r.rid, r.epoch))

    def _advance(self, r: _Replica, k: int) -> None:
        n, s0 = len(r.active), sum(s.prompt + s.done for s in r.active)
        r.busy_s += self.c.cost.run_time(n, s0, k)
        for s in r.active:
            s.done += k
            s.round_left -= k

    def _stop_at_boundary(self, r: _Replica) -> None:
        """Cut the replica's run at the first step boundary at or after now (the step in flight ends)."""
        if not r.active or r.seg_end <= self.t or r.seg_k == 0:
            return
        n, s0 = len(r.active), sum(s.prompt + s.done for s in r.active)
        dt = max(0.0, self.t - r.seg_start)
        k = self.c.cost.steps_within(n, s0, dt, r.seg_k)
        if self.c.cost.run_time(n, s0, k) < dt - 1e-12 or (k == 0 and self.t > r.seg_start):
            k = min(r.seg_k, k + 1)
        self._advance(r, k)
        r.seg_end = r.seg_start + self.c.cost.run_time(n, s0, k)
        r.seg_k = 0
        r.epoch += 1
        self._retire(r, r.seg_end)

    def _retire(self, r: _Replica, t: float) -> None:
        keep = []
        for s in r.active:
            if s.done >= s.stop:
                s.finish_t = t
                self.finished.append(s)
                v = s.idx // self.c.batch
                self.done_per_batch[v] = self.done_per_batch.get(v, 0) + 1
                self._check_batches(t)
            elif s.round_left <= 0:
                self.waiting_round.append(s)
            else:
                keep.append(s)
        r.active = keep

    def _on_replica(self, rid: int, epoch: int) -> None:
        r = self.reps[rid]
        if epoch != r.epoch:
            return
        self._advance(r, r.seg_k)
        r.seg_k = 0
        self._retire(r, self.t)
        self._plan(r, self.t)
        self._fill()

    # -- batches and the trainer ---------------------------------------------------------------
    def _check_batches(self, t: float) -> None:
        b = self.c.batch
        while True:  # a later batch may complete first (shorter replies): mark every complete one in order
            v = self.batches_done
            if self.c.round_budget is None:
                if self.done_per_batch.get(v, 0) < b:
                    return
                members = [self.by_idx[i] for i in range(v * b, (v + 1) * b)]
                t_done = max(m.finish_t for m in members)
            else:
                if len(self.finished) - self.consumed < b:
                    return
                members = self.finished[self.consumed:self.consumed + b]
                self.consumed += b
                t_done = t
            self.batches_done += 1
            self.res["gen"].append(t_done - self.first_admit.get(v, 0.0))
            self._push(max(t, t_done + self.c.reward_s), "ready", (v, members))

    def _on_ready(self, v: int, members: list[_Seq]) -> None:
        self.ready_members[v] = members
        self._try_train()

    def _try_train(self) -> None:
        v = self.train_step
        members = self.ready_members.get(v)
        if self.trainer_busy or members is None or v >= self.c.steps:
            return
        self.res["wait"].append(self.t - self.trainer_free_t)
        self.max_stale = max([self.max_stale] + [v - s.version for s in members])
        dt = self.c.train_s(members)
        self.res["train"].append(dt)
        self.trainer_busy = True
        self._push(self.t + dt, "trainer", "trained")

    def _on_trainer(self, what: str) -> None:
        if what == "trained":
            # the sync starts once every replica has finished the decode step it is in
            for r in self.reps:
                self._stop_at_boundary(r)
                r.paused = True
            start = max([self.t] + [r.seg_end for r in self.reps])
            for r in self.reps:
                self._plan(r, start)
            self._push(start + self.c.sync_s, "trainer", "synced")
        else:
            self.version += 1
            self.train_step += 1
            self.trainer_busy = False
            self.trainer_free_t = self.t
            self.sync_ends.append(self.t)
            for r in self.reps:
                r.paused = False
                r.seg_end = self.t
                if self.c.round_budget:
                    for s in r.active:  # new weights: a new round's budget
                        s.round_left = self.c.round_budget
            self.pending[:0] = self.waiting_round  # resumed rollouts first, re-prefilled on admission
            self.waiting_round = []
            self._admit()
            for r in self.reps:
                self._plan(r, self.t)
            self._fill()
            self._try_train()

    def run(self) -> SimResult:
        self._admit()
        self._fill()
        while self.q and self.train_step < self.c.steps:
            self.t, _, kind, payload = heapq.heappop(self.q)
            if kind == "replica":
                self._on_replica(*payload)
            elif kind == "ready":
                self._on_ready(*payload)
            else:
                self._on_trainer(payload)
        if self.train_step < self.c.steps:
            raise RuntimeError(f"simulation stalled after {self.train_step} steps (no events left)")
        ends = self.sync_ends
        makespan = ends[-1] or 1.0
        busy = sum(r.busy_s for r in self.reps) / (len(self.reps) * makespan)
        return SimResult(step_s=[b - a for a, b in zip(ends, ends[1:])], gen_span_s=self.res["gen"][:self.c.steps],
                         train_s=self.res["train"], sync_s=self.c.sync_s, trainer_wait_s=self.res["wait"],
                         generator_busy_frac=min(1.0, busy), max_staleness=self.max_stale, events=self.n_ev,
                         warmup=min(self.c.warmup, max(0, self.c.steps - 1)))


def simulate(cfg: SimConfig) -> SimResult:
    """Run the DES for ``cfg.steps`` trainer steps."""
    return Simulation(cfg).run()


__all__ = ["SimConfig", "SimResult", "Simulation", "simulate"]
