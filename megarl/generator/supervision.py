"""Supervision of the generator's replicas: a dead or frozen replica is replaced in place.

A replica *fails* when its process exits or raises (its pipe closes, or it sends an error), or when
it is *frozen*: it holds work and has sent nothing for ``generator.heartbeat_timeout_s`` (a decoding
replica reports every ``engine.HEARTBEAT_S`` and after every finished request). A spawned replica
that fails, outside a weight update, is recovered where the failure is noticed (every executor call
and every wait checks, :meth:`ReplicaSupervision._check_failed`):

1. the process is killed (SIGKILL, also when it is SIGSTOPped) with its TP workers;
2. the rounds it had in flight are taken back; a sample keeps the tokens, logprobs and versions of
   its earlier finished rounds and its lost round is generated again from them (prompt + known
   tokens, the remaining budget), so the versions stay true: kept tokens keep the version that made
   them, new tokens get the version the new replica holds. Tokens of the lost round were never
   seen by the executor (a round's tokens arrive when it finishes) and are dropped, so no sample is
   delivered twice and none is lost;
3. a new process takes the replica's index, starts, and gets the current weights from the
   *weight restorer* the controller registered (:meth:`set_weight_restorer`; controller/
   weight_sync.py: a sync to that replica alone, verified and probed). Without one, only a
   generator that never loaded weights (version 0, the model folder's) can restart;
4. the taken-back rounds are re-issued to the least loaded replicas, the new one included.

It logs one line: ``generator: replica R restarted (cause: ...): pid A -> B, weights vN, K request(s)
re-issued; recovered in S s``, and counts ``restarts`` (the controller reports it as
``gen/replica_restarts``). A replica that fails more than ``generator.max_restarts`` times within
``generator.restart_window_s`` stops the job with every cause (``max_restarts: 0``: the first failure
does, as before supervision existed). Not recovered, they stop the job as before: a failure during a
weight update (the trainer's senders wait for the dead receivers: the sync is lost), a failure
while a replica is being recovered, a replica that never became ready (a start-up failure is the
configuration's, not a transient fault), and attached replicas (srun starts those; the job's
launcher restarts the job).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from megarl.generator.engine import replica_main
from megarl.generator.errors import GeneratorError, engine_died
from megarl.generator.replicas import ReplicaHandle, Track, remove_shm_files
from megarl.generator.threads import threads_binds
from megarl.utils.devices import cuda_visible
from megarl.utils.procs import spawned_from_main_thread

if TYPE_CHECKING:
    from megarl.executors.group import ProcessGroup
    from megarl.generator.config import GeneratorConfig

log = logging.getLogger("megarl.generator.executor")  # the executor's logger: one log name for the generator

# restorer(replica index) -> the policy version it loaded into that replica (and verified)
WeightRestorer = Callable[[int], int]


class RestartBudget:
    """How often each replica may be restarted: ``max_restarts`` within ``window_s`` seconds."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts, self.window_s = int(max_restarts), float(window_s)
        self._failures: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._causes: dict[int, list[str]] = collections.defaultdict(list)

    def allow(self, replica: int, cause: str, now: float | None = None) -> str | None:
        """Record a failure of ``replica``; None when it may restart, else why the job must stop."""
        now = time.monotonic() if now is None else now
        failures = self._failures[replica]
        failures.append(now)
        self._causes[replica].append(cause.splitlines()[0] if cause else "unknown")
        while failures and now - failures[0] > self.window_s:
            failures.popleft()
        if len(failures) <= self.max_restarts:
            return None
        causes = "; ".join(self._causes[replica][-len(failures):])
        return (f"failed {len(failures)} time(s) within generator.restart_window_s={self.window_s:.0f}s, more than "
                f"generator.max_restarts={self.max_restarts} allow: stopping the job (causes: {causes})")


class ReplicaSupervision:
    """The supervising half of :class:`megarl.generator.executor.GeneratorExecutor` (a mixin: it
    uses the executor's process group (megarl/executors/group.py), replica handles, tracks and
    waits)."""

    cfg: GeneratorConfig
    _group: ProcessGroup
    _replicas: list[ReplicaHandle]
    _tracks: dict[str, Track]

    def _init_supervision(self) -> None:
        self.restarts = 0  # replicas restarted so far (gen/replica_restarts)
        self.restarts_of: collections.Counter = collections.Counter()  # replica index -> its restarts
        self._budget = RestartBudget(self.cfg.max_restarts, self.cfg.restart_window_s)
        self._to_recover: dict[int, tuple[ReplicaHandle, str, float]] = {}  # index -> (handle, cause, since)
        self._restorer: WeightRestorer | None = None
        self._updating = 0  # > 0 while a weight update waits: a failure then stops the job
        self._recovering = False

    def set_weight_restorer(self, restorer: WeightRestorer | None) -> None:
        """``restorer(replica)`` loads the current weights into that (restarted) replica alone,
        verifies them and returns their version (controller/weight_sync.py registers it)."""
        self._restorer = restorer

    def recover_failed(self) -> None:
        """Restart every failed replica now (or raise what stops the job); the controller calls it
        before a sync (controller/weight_sync.py)."""
        self._check_failed()

    @contextlib.contextmanager
    def _weight_update(self) -> Iterator[None]:
        """While weights load, a replica failure stops the job (the sync's senders would wait for
        the dead receivers). Recover earlier failures with :meth:`recover_failed` before the trainer
        starts sending: a restore is a sync of its own and cannot run inside one."""
        self._updating += 1
        try:
            self._check_failed()
            yield
        finally:
            self._updating -= 1

    # ------------------------------------------------------------------ spawning
    def _spawn_replica(self, r: int, bind: str | None, pdeathsig) -> None:
        """Start replica ``r``'s process in the group (in place of a failed one)."""
        cfg = self.cfg
        cuda = None
        if self.cuda_devices is not None:
            cuda = cuda_visible(self.cuda_devices[r * cfg.tp:(r + 1) * cfg.tp])  # ordinals as we see them
        log_path = self._log_dir / f"generator_replica{r}.log"
        self._group.spawn(r, replica_main, (cfg, self.model_dir, r, bind, self.on_cpu, str(log_path), cuda,
                                            os.getpid(), pdeathsig),
                          {"deterministic": self.deterministic, "restarts": self.restarts_of[r]},
                          name=f"megarl-gen-{r}", log_path=log_path, make=ReplicaHandle)

    # ------------------------------------------------------------------ noticing failures
    def _restartable(self) -> bool:
        return (self.cfg.max_restarts > 0 and self.launcher == "local" and not self._closing
                and not self._updating and not self._recovering)

    def _fail(self, h: ReplicaHandle, cause: str, tb: str = "") -> None:
        """Replica ``h`` failed: recover it at the next check, or stop the job when it cannot be."""
        if self._failure is not None or h.index in self._to_recover or self._replicas[h.index] is not h:
            return  # already failed, already being replaced, or a replaced handle's late message
        if self._restartable() and h.info:  # never ready: a start-up failure is the config's, not transient
            log.warning("generator: replica %d (pid %s) failed: %s", h.index, h.process.pid, cause.splitlines()[0])
            self._to_recover[h.index] = (h, cause, time.monotonic())
        else:
            self._failure = engine_died(h, cause, tb)

    def _check_frozen(self) -> None:
        """A replica that holds work and has said nothing for heartbeat_timeout_s is frozen (the
        group's heartbeat detector; a decoding replica's progress messages are its heartbeats). An
        attached one (Slurm) cannot be restarted from here: it stops the job, naming it (_fail)."""
        if self._updating or self._recovering:
            return
        busy = lambda h: bool(h.active and h.info) and h.index not in self._to_recover  # noqa: E731
        for h in self._group.silent(self.cfg.heartbeat_timeout_s, busy):
            silent = time.monotonic() - h.last_heard
            self._fail(h, f"made no progress for {silent:.0f}s while holding {len(h.active)} request(s) "
                          f"(frozen: generator.heartbeat_timeout_s={self.cfg.heartbeat_timeout_s:.0f})")

    def _check_failed(self) -> None:
        """Raise the failure that stops the job; recover every replica that can be."""
        if self._failure is None:
            for h in self._replicas:
                if h.process.exitcode is not None and h.index not in self._to_recover:
                    self._fail(h, self._exit_cause(h))
            self._check_frozen()
        while self._failure is None and self._to_recover and not self._recovering:
            index = next(iter(self._to_recover))
            h, cause, since = self._to_recover[index]
            try:
                self._recover(h, cause, since)
            finally:
                del self._to_recover[index]
        if self._failure is not None:
            raise self._failure

    # ------------------------------------------------------------------ recovering
    def _recover(self, h: ReplicaHandle, cause: str, since: float) -> None:
        """Replace failed replica ``h`` (module docstring, steps 1-4)."""
        refused = self._budget.allow(h.index, cause)
        self._group.kill(h)  # SIGKILL ends a SIGSTOPped process too
        if refused:
            self._failure = engine_died(h, f"{cause.splitlines()[0]}; it {refused}")
            return
        lost = [self._tracks.pop(rid) for rid in sorted(h.active) if rid in self._tracks]
        h.active.clear()
        remove_shm_files(h.info.get("shm_prefixes", []))
        if self.version != 0 and self._restorer is None:
            self._failure = engine_died(h, f"{cause.splitlines()[0]}; it cannot be restarted: the generator holds "
                                           f"weights v{self.version} and no weight restorer is registered")
            return
        self._recovering = True
        try:
            bind = threads_binds(self.cfg)[h.index] if self.on_cpu else None
            self.restarts_of[h.index] += 1
            self._spawn_replica(h.index, bind, spawned_from_main_thread())
            new = self._replicas[h.index]
            self._wait(lambda: bool(new.info), self.cfg.start_timeout_s, f"replica {h.index} to restart",
                       progress_resets=False)
            version = self._restorer(h.index) if self._restorer is not None else 0
        except GeneratorError as e:
            self._failure = self._failure or e
            raise
        finally:
            self._recovering = False
        by_replica: dict[int, list[Track]] = {}
        for t in lost:  # the lost round is generated again from the sample's known tokens
            t.rounds -= 1
            t.replica = self._least_loaded()
            self._replicas[t.replica].active.add(t.key)
            by_replica.setdefault(t.replica, []).append(t)
        for r, tracks in by_replica.items():
            self._send_round(r, tracks)
        self.restarts += 1
        log.warning("generator: replica %d restarted (cause: %s): pid %s -> %s, weights v%d, %d request(s) "
                    "re-issued; recovered in %.1fs", h.index, cause.splitlines()[0], h.process.pid,
                    new.process.pid, version, len(lost), time.monotonic() - since)


__all__ = ["ReplicaSupervision", "RestartBudget", "WeightRestorer"]
