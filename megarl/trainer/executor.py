"""Trainer executor: TP x PP x DP Megatron ranks, each in its own process, driven over a command channel.

The executor lives in the controller's process and never trains itself. It spawns one process per
rank (``megarl.trainer.worker.rank_main``; global rank ``r`` has ``tp = r % tp``, ``dp = (r // tp) %
dp``, ``pp = r // (tp * dp)``, megatron's default order) and sends every command to every rank
(commands are collective). Each rank builds exactly what the single-rank ``LocalTrainer`` builds
(``megarl.trainer.local.RankTrainer``), so at TP = PP = DP = 1 a step is the same arithmetic.

Interface (what the controller's loop uses; the same as ``LocalTrainer`` where they overlap)::

    with TrainerExecutor(cfg.trainer, cfg.algorithm, model_dir, total_steps=n, run_dir=run) as tr:
        tr.step_count                   # optimizer steps taken (= policy version), resume-aware
        metrics = tr.step(batch)        # the whole RolloutBatch to every rank; DP ranks take their rows
        tr.start_sync(spec, version)    # every rank starts DdmaSender.sync(version) ...
        gen.update_weights_from_source(spec.weight_source(version), version)
        stats = tr.finish_sync()        # ... and its per-rank phase stats come back
        path = tr.save()                # collective megatron dist checkpoint; rank 0's step folder
        tr.hf_weights()                 # full HF tensors (gathers the model here: checks, shm push)
        tr.health(), tr.pids

Supervision (the process group, megarl/executors/group.py: spawn or attach, pipes, reader threads,
waits, the heartbeat detector, kill-all): every wait is bounded by a knob of ``TrainerConfig`` (``start_timeout_s``,
``step_timeout_s``, ``save_timeout_s``, ``heartbeat_timeout_s``) and logs what it waits for. A rank
that dies, raises, stops beating or does not answer in time raises :class:`TrainerRankFailed` /
:class:`TrainerTimeout` naming the rank (global and tp/pp/dp), the cause and the exit code, and
every rank process is killed at once (their collective state is unusable): later calls re-raise.
Metrics come from the rank at tp 0, dp 0 on the last pipeline stage (where the loss is computed).

Attach mode (``launcher="slurm"``, ``cluster.launcher``): the ranks are not spawned here but started
elsewhere (srun on the trainer nodes, ``megarl.cluster``) and connect to this executor
(``megarl.executors.attach``); the same protocol and supervision then run over those connections,
with a rank's connection EOF standing for its exit and its host and pid in every error.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.executors.attach import AttachError, AttachSpec, accept_ranks, channel_port_var, rendezvous_vars
from megarl.executors.base import ExecutorBase, ExecutorError, ExecutorTimeout, ProcessDied
from megarl.executors.group import Member, ProcessGroup, Stalled, member_cause, member_node, member_where
from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig
from megarl.trainer.worker import PORT_TAKEN_EXIT, rank_main
from megarl.utils.devices import cuda_visible
from megarl.utils.dist import free_tcp_port
from megarl.utils.errors import exception_line, remote_error

log = logging.getLogger(__name__)

_GRACE_S = 3.0       # after a rank raises: time for a dead peer (the likely cause) to show
_SYNC_MARGIN_S = 60.0  # finish_sync waits the spec's own timeout plus this


class TrainerError(ExecutorError):
    """The trainer executor cannot continue."""


class TrainerRankFailed(TrainerError, ProcessDied):
    """A trainer rank died or raised. ``rank``/``tp``/``pp``/``dp``/``pid``/``exitcode``/``cause``."""

    def __init__(self, message: str, *, rank: int, coords: dict, pid: int | None,
                 exitcode: int | None, cause: str):
        super().__init__(message)
        self.rank, self.pid, self.exitcode, self.cause = rank, pid, exitcode, cause
        self.tp, self.pp, self.dp = coords["tp"], coords["pp"], coords["dp"]


class TrainerTimeout(TrainerError, ExecutorTimeout):
    """Trainer ranks did not answer in time (``ranks``: the silent ones, frozen ones first)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def said_as(e: ExecutorError, role: str, cls: type) -> ExecutorError:
    """``e`` (this executor's error) said as ``role``'s, raised as ``cls``: a role that runs on the
    trainer's machinery (the distillation teacher, the critic) names itself, not "trainer rank"."""
    text = str(e).replace("trainer rank", f"{role} rank")
    exc = cls(f"{role}: {text[len('trainer: '):] if text.startswith('trainer: ') else text}")
    exc.component = (e.component or role).replace("trainer rank", f"{role} rank")
    exc.log_path, exc.remote_error = e.log_path, getattr(e, "remote_error", None)
    return exc


def rank_coords(rank: int, tp: int, pp: int, dp: int) -> dict:
    """tp/pp/dp coordinates of a global trainer rank (megatron's tp-cp-ep-dp-pp order)."""
    if not 0 <= rank < tp * pp * dp:
        raise ValueError(f"rank {rank} outside a tp={tp} x pp={pp} x dp={dp} trainer")
    return {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)}


def rank_cores(cpus: Sequence[int] | None, world: int) -> list[list[int] | None]:
    """Each rank's cores: ``cpus`` split evenly in order (a remainder goes to the first ranks);
    with fewer cores than ranks, ranks share them round-robin, one core each. None: no pinning."""
    if cpus is None:
        return [None] * world
    cpus = list(cpus)
    if not cpus:
        raise ValueError("cpus=[]: give the trainer at least one core, or None for no pinning")
    if len(cpus) < world:
        return [[cpus[r % len(cpus)]] for r in range(world)]
    return [cpus[r * len(cpus) // world:(r + 1) * len(cpus) // world] for r in range(world)]


class _Rank(Member):
    """A rank process of the group (megarl/executors/group.py) with its tp/pp/dp coordinates."""

    def __init__(self, index: int, process, conn, log_path: Path, coords: dict):
        super().__init__(index, process, conn, log_path)
        self.coords = coords

    @property
    def name(self) -> str:
        c = self.coords
        return f"trainer rank {self.index} (tp {c['tp']}, pp {c['pp']}, dp {c['dp']}; {member_where(self)})"

    @property
    def component(self) -> str:
        """:attr:`name` with the node also for a rank spawned here (the command's last line)."""
        return self.name if self.remote else f"{self.name[:-1]} on {member_node(self)})"

    def failure(self, cause: str, what: str, note: str = "", detail: str = "") -> TrainerRankFailed:
        """The error that ends the job for this rank: ``cause`` (how it ended), ``what`` the
        executor was waiting for, ``detail`` (its traceback, when it raised; else its log's tail)."""
        body = detail or f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        exc = TrainerRankFailed(
            f"trainer: {self.name} {cause} while waiting for {what}; every trainer rank was killed{note}\n"
            f"{body}", rank=self.index, coords=self.coords, pid=self.process.pid,
            exitcode=None if self.remote else self.process.exitcode, cause=cause)
        exc.component, exc.log_path = self.component, str(self.log_path)
        exc.remote_error = remote_error(detail) if detail else None
        return exc


class TrainerExecutor(ExecutorBase):
    """TP x PP x DP Megatron ranks in their own processes behind ``LocalTrainer``'s interface."""

    def __init__(self, cfg: TrainerConfig, algo: AlgorithmConfig, model_dir: str | os.PathLike, *,
                 total_steps: int, run_dir: str | os.PathLike, cpus: list[int] | None = None,
                 devices: Sequence[int] | None = None, launcher: str = "local", role: str = "trainer"):
        problems = cfg.problems()
        if problems:
            raise ValueError("invalid trainer config:\n  " + "\n  ".join(problems))
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"trainer model folder {model_dir} has no config.json")
        self.cfg, self.algo = cfg, algo
        self.model_dir, self.run_dir = str(model_dir), Path(run_dir)
        self.total_steps = int(total_steps)
        self.world = cfg.tp * cfg.pp * cfg.dp
        self.cores = rank_cores(cpus, self.world)
        if devices is not None and len(devices) != self.world:
            raise ValueError(f"devices={list(devices)}: the trainer has {self.world} rank(s), one device each")
        # Each rank's CUDA_VISIBLE_DEVICES: its plan ordinal among the devices we see, as we see them
        # (megarl.config.placement.cuda_visible); None: inherit ours.
        self.devices = [cuda_visible([d]) for d in devices] if devices is not None else [None] * self.world
        if launcher not in ("local", "slurm"):
            raise ValueError(f"launcher={launcher!r}: one of 'local' (spawn the ranks here) or 'slurm' (they attach)")
        self.launcher = launcher
        self.role = role  # whose ranks these are: a teacher's or a critic's attach at their own port (Slurm)
        self.log_dir = self.run_dir / "logs"
        # the rank processes, their pipes and reader threads, waits, heartbeats, kill-all
        self._group = ProcessGroup("trainer", beats=("beat",))
        self._seq = 0
        self._step_count = 0
        self._failure: TrainerError | None = None
        self._pending: tuple[int, float, str] | None = None  # (seq, timeout, what) of an in-flight sync
        self._pdeathsig = False  # launch(): whether the ranks die with this process (spawned from its main thread)
        self._launches = 0  # local launches so far (a taken rendezvous port relaunches; 3 at most)
        self._launched_at = 0.0  # time.monotonic() of the last launch: start_timeout_s counts from there

    @property
    def _ranks(self) -> list[_Rank]:
        return self._group.members

    @property
    def _procs(self) -> list:
        """Every rank process spawned here (a relaunch's too)."""
        return self._group.procs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "TrainerExecutor":
        """Spawn the ranks and wait (``start_timeout_s``) until each has built model + optimizer
        and resumed; on any failure no rank is left running (:meth:`launch`, then :meth:`await_ready`)."""
        return self.launch().await_ready()

    def launch(self) -> "TrainerExecutor":
        """Spawn the ranks (attach mode: accept them and send each its start arguments) and return
        without waiting: they build model + optimizer while the controller starts the generator
        (megarl/controller/startup.py). On a failure no rank is left running."""
        if self._ranks:
            return self
        from megarl.utils.procs import spawned_from_main_thread

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._pdeathsig = spawned_from_main_thread()
        try:
            self._attach() if self.launcher == "slurm" else self._spawn_ranks()
        except BaseException:
            self.close()
            raise
        return self

    def await_ready(self, also_check: Callable[[], None] | None = None) -> "TrainerExecutor":
        """Wait until every launched rank is ready, up to ``start_timeout_s`` counted from the launch;
        a local launch whose rendezvous port was taken is relaunched (3 launches in all).
        ``also_check()`` runs at every look (it raises to end the wait: another executor failed).
        On any failure no rank is left running."""
        try:
            while not self._await_ready(also_check):
                if self.launcher == "slurm":
                    host = self._ranks[0].process.host
                    port = os.environ.get(rendezvous_vars(self.role)[1], "?")
                    self._raise(TrainerError(f"{self.role}: rank 0 on {host} could not bind the rendezvous port "
                                             f"{port} (in use: another job on that node?); set cluster.port_base "
                                             f"to a free range"))
                if self._launches == 3:
                    raise TrainerError("trainer: the rendezvous port was taken 3 times in a row")
                log.warning("trainer: the rendezvous port was taken; relaunching the ranks (attempt %d)",
                            self._launches + 1)
                self._spawn_ranks()
        except BaseException:
            self.close()
            raise
        self._step_count = self._ranks[0].info["step"]
        log.info("%s: %d rank(s) ready (tp %d x pp %d x dp %d) at step %d; pids %s, logs in %s", self.role,
                 self.world, self.cfg.tp, self.cfg.pp, self.cfg.dp, self._step_count, self.pids, self.log_dir)
        return self

    def has_exited(self) -> bool:
        """Whether a rank has failed by exiting (attached: its connection closed); a rank 0 that found
        the rendezvous port taken is not one: :meth:`await_ready` relaunches. Reads no message:
        another executor's wait asks it; this executor's own wait then says why."""
        return any(r.process.exitcode != PORT_TAKEN_EXIT for r in self._group.exited())

    def _make_rank(self, index: int, process, conn, log_path: Path) -> _Rank:
        return _Rank(index, process, conn, log_path, rank_coords(index, self.cfg.tp, self.cfg.pp, self.cfg.dp))

    def _spawn_ranks(self) -> None:
        self._group.discard()
        self._launches += 1
        self._launched_at = time.monotonic()
        port = free_tcp_port()
        for r in range(self.world):
            log_path = self.log_dir / f"trainer_rank{r}.log"
            self._group.spawn(r, rank_main, (r, self.world, port, self.cfg, self.algo, self.model_dir,
                                             self.total_steps, str(self.run_dir), self.cores[r], str(log_path),
                                             os.getpid(), self._pdeathsig, self.devices[r]),
                              name=f"megarl-trainer-{r}", log_path=log_path, make=self._make_rank)

    def _attach(self) -> None:
        """Attach mode: accept the ranks started elsewhere and send each its start arguments (the
        same as a spawned rank's); :meth:`await_ready` waits until every one is ready."""
        self._launched_at = time.monotonic()
        try:
            spec = AttachSpec.from_env(port_var=channel_port_var(self.role))
            conns = accept_ranks(spec, self.world, self.cfg.start_timeout_s, role=self.role)
        except AttachError as e:
            raise TrainerError(str(e)) from None
        for r, (conn, hello) in enumerate(conns):
            log_path = self.log_dir / f"trainer_rank{r}.log"
            rank = self._group.attach(r, conn, hello, log_path, make=self._make_rank)
            self._group.send_bytes(rank, pickle.dumps(
                ("init", {"cfg": self.cfg, "algo": self.algo, "model_dir": self.model_dir,
                          "total_steps": self.total_steps, "run_dir": str(self.run_dir), "cores": self.cores[r],
                          "log_path": str(log_path)})))

    def _await_ready(self, also_check: Callable[[], None] | None = None) -> bool:
        """Whether the launch came up (False: its rendezvous port was taken); raises on a failure."""
        left = self._launched_at + self.cfg.start_timeout_s - time.monotonic()
        self._wait(lambda: all(r.info for r in self._ranks), left,
                   f"{self.world} trainer rank(s) to start (build model + optimizer, resume; "
                   f"trainer.start_timeout_s={self.cfg.start_timeout_s:.0f} from the launch)",
                   missing=lambda: [r for r in self._ranks if not r.info], also_check=also_check)
        if any(r.info.get("port_taken") for r in self._ranks):
            return False
        for r in self._ranks:
            got = {k: r.info[k] for k in ("tp", "pp", "dp")}
            if got != r.coords:
                self._raise(TrainerError(f"{r.name} has megatron coordinates {got}, the executor expected "
                                         f"{r.coords}: the rank order differs from rank_coords()"))
        return True

    def close(self) -> None:
        """Ask every rank to exit (they tear down their process group), wait ``shutdown_timeout_s``,
        kill the rest. A failed executor's ranks were killed already. Idempotent."""
        if self._ranks and self._failure is None:
            self._group.close(("exit", -1), self.cfg.shutdown_timeout_s,
                              leaving=lambda r: bool(r.info) and not r.info.get("port_taken"),
                              knob="trainer.shutdown_timeout_s")
        self._group.discard()
        self._pending = None

    # ------------------------------------------------------------------ commands
    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (= the policy version the weights represent)."""
        return self._step_count

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, in global rank order."""
        return [r.process.pid for r in self._ranks]

    def step(self, batch: RolloutBatch) -> dict:
        """One optimizer step on ``batch`` (every rank gets the whole batch; DP rank d trains on
        its contiguous share of rows); returns ``LocalTrainer.step``'s metrics."""
        if batch.batch_size % self.cfg.dp:
            raise ValueError(f"a batch of {batch.batch_size} sequences does not split over trainer.dp="
                             f"{self.cfg.dp} data-parallel ranks; make it a multiple of {self.cfg.dp}")
        out = self._call("step", (batch,), self.cfg.step_timeout_s, f"train step {self._step_count + 1}")
        self._step_count = out[0]["step"]
        return next(o["metrics"] for o in out if o["metrics"] is not None)

    def logprobs(self, batch: RolloutBatch, temperature: float | None = None) -> torch.Tensor:
        """Per-token logprobs ``[b, s]`` of ``batch`` under the current weights (every rank runs the
        forward; the reporting rank returns them). ``temperature``: default trainer.logprob_temperature."""
        out = self._call("logprobs", (batch, temperature), self.cfg.step_timeout_s, "logprobs")
        return next(o for o in out if o is not None)

    def topology(self):
        """The trainer's layout as the DDMA planner describes it (``TrainerTopology``, from rank 0)."""
        return self._call("topology", (), self.cfg.save_timeout_s, "its topology")[0]

    def save(self) -> Path:
        """Checkpoint (collective megatron dist checkpoint on every rank); rank 0's step folder."""
        return Path(self._call("save", (), self.cfg.save_timeout_s, f"save step {self._step_count}")[0])

    def wait_saves(self) -> None:
        """Wait for the ranks' background checkpoint write in flight (trainer.async_save) and commit it."""
        self._call("wait_saves", (), self.cfg.save_timeout_s, "the background checkpoint write")

    def start_sync(self, spec, version: int) -> None:
        """Every rank starts ``DdmaSender.sync(version)`` for ``spec`` (a ``SyncSpec``; senders are
        made once per spec); returns at once. Call :meth:`finish_sync` before any other command."""
        self._check_idle()
        seq = self._send("sync", (spec, int(version)))
        self._pending = (seq, float(spec.timeout_s) + _SYNC_MARGIN_S, f"DDMA sync of weights v{version}")

    def finish_sync(self) -> list[dict]:
        """Wait for the sync started by :meth:`start_sync`; per-rank phase stats (quantize_s,
        verify_s, transfer_s, bytes_sent, peak_extra_bytes) with rank, tp, pp, dp, in rank order."""
        if self._pending is None:
            raise RuntimeError("finish_sync() without start_sync()")
        seq, timeout, what = self._pending
        try:
            out = self._collect(seq, timeout, what)
        finally:
            self._pending = None
        return [{"rank": r.index, **r.coords, **stats} for r, stats in zip(self._ranks, out)]

    def abandon_sync(self, why: str) -> None:
        """The receivers of the sync in flight failed (``why``): the senders would wait for them
        until the sync's timeout, so every rank is killed now and the executor is failed."""
        if self._pending is None:
            return
        self._pending = None
        if self._failure is None:
            self._failure = TrainerError(f"trainer: DDMA sync abandoned ({why}); every trainer rank was killed")
            self._group.kill_all()

    def raise_if_dead(self) -> None:
        """Raise :class:`TrainerRankFailed` if a rank process has exited. Cheap and reads no
        message, so it is safe while a sync is in flight (the generator calls it while it waits)."""
        if self._failure is not None:
            raise self._failure
        for r in self._ranks:
            if r.process.exitcode is not None:
                self._rank_failed(r, member_cause(r), "the DDMA sync in flight")

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, reassembled here from the dp 0 ranks' shards.
        Holds a whole copy of the model in this process: for checks and the shm weight push, not
        for the DDMA path."""
        from megarl.trainer.shards import ShardSpec, reassemble

        pieces = self._call("shards", (), self.cfg.save_timeout_s, "their weight shards")
        specs = [ShardSpec(**{k: v for k, v in d.items() if k != "dtype"}, local_view=t)
                 for rank_pieces in pieces for d, t in rank_pieces]
        return iter(reassemble(specs).items())

    def health(self) -> list[dict]:
        """Every rank's state (rank, tp, pp, dp, pid, cores, threads, cuda_visible_devices, step); raises if one is dead,
        frozen or does not answer within ``save_timeout_s``. Ranks answer between commands."""
        return self._call("health", (), self.cfg.save_timeout_s, "health replies")

    # ------------------------------------------------------------------ channel
    def _call(self, name: str, args: tuple, timeout: float, what: str) -> list:
        self._check_idle()
        return self._collect(self._send(name, args), timeout, what)

    def _check_idle(self) -> None:
        if self._failure is not None:
            raise self._failure
        if not self._ranks:
            raise TrainerError("the trainer executor is not started (call start() or use `with`)")
        if self._pending is not None:
            raise RuntimeError(f"{self._pending[2]} is in flight: call finish_sync() first")

    def _send(self, name: str, args: tuple) -> int:
        self._check_alive(f"the ranks to take the {name!r} command")
        self._seq += 1
        data = pickle.dumps((name, self._seq, *args), protocol=pickle.HIGHEST_PROTOCOL)  # once for all ranks
        what = f"the ranks to take the {name!r} command"
        for r in self._ranks:
            # Bounded: a rank that neither reads (a batch fills its channel's buffer) nor beats is frozen
            # (SIGSTOP, a hung node), and an unbounded write would wait for it forever.
            try:
                sent = self._group.send_bytes(r, data, stall_s=self.cfg.heartbeat_timeout_s)
            except Stalled as e:
                self._raise(self._timeout([r], str(e), what))
            if not sent:  # its end is closed: it died (or is dying)
                r.process.join(2.0)
                self._rank_failed(r, member_cause(r), what)
        return self._seq

    def _collect(self, seq: int, timeout: float, what: str) -> list:
        replies: dict[int, Any] = {}

        def on_reply(r: _Rank, msg: tuple) -> None:
            if msg[0] == "ok" and msg[1] == seq:
                replies[r.index] = msg[2]

        self._wait(lambda: len(replies) == len(self._ranks), timeout, f"{len(self._ranks)} trainer rank(s) to "
                   f"answer: {what}", on_reply, missing=lambda: [r for r in self._ranks if r.index not in replies])
        return [replies[r.index] for r in self._ranks]

    def _wait(self, done, timeout: float, what: str, on_reply=None, *, missing,
              also_check: Callable[[], None] | None = None) -> None:
        """Handle messages until ``done()``; raise (killing every rank) on a dead, failed or frozen
        rank (the group's heartbeat detector), or after ``timeout`` seconds; ``also_check()`` runs at
        every look."""
        def check() -> None:
            if also_check is not None:
                also_check()
            frozen = self._group.silent(self.cfg.heartbeat_timeout_s)
            if frozen:
                self._raise(self._timeout(frozen, f"sent no heartbeat for {self.cfg.heartbeat_timeout_s:.0f}s "
                                                  f"(frozen)", what))
            self._check_alive(what, on_reply)  # a backstop: a death normally shows as its pipe's EOF

        def on_timeout() -> TrainerError:
            self._raise(self._timeout(missing(), f"did not answer within {timeout:.0f}s", what))

        self._group.wait(done, timeout, what, lambda r, msg: self._handle(r, msg, what, on_reply),
                         check=check, on_timeout=on_timeout)

    def _timeout(self, silent: list[_Rank], why: str, what: str) -> TrainerTimeout:
        now = time.monotonic()
        lines = "\n".join(f"  {r.name}: last heartbeat {now - r.last_heard:.1f}s ago; last lines of "
                          f"{r.log_path}:\n{r.log_tail(8)}" for r in silent)
        exc = TrainerTimeout(f"trainer: {', '.join(r.name for r in silent)} {why} while waiting "
                             f"for {what}\n{lines}", [r.index for r in silent])
        exc.component = ", ".join(r.component for r in silent)
        exc.log_path = str(silent[0].log_path) if silent else None
        return exc

    def _handle(self, r: _Rank, msg: tuple, what: str, on_reply) -> None:
        if r.conn.closed or not self._group.current(r):  # from an earlier launch
            return
        kind = msg[0]
        if kind == "ready":
            r.info = msg[1]
        elif kind == "port_taken":
            r.info = {"port_taken": True}
            for other in self._ranks:  # the others wait for a rank 0 that will never listen
                other.info = other.info or {"port_taken": True}
        elif kind == "error":
            self._rank_raised(r, msg[2], what)
        elif kind == "eof":
            if r.info.get("port_taken"):
                return
            r.process.join(2.0)
            self._rank_failed(r, member_cause(r), what)
        elif on_reply is not None:
            on_reply(r, msg)

    # ------------------------------------------------------------------ failures
    def _check_alive(self, what: str, on_reply=None) -> None:
        """Raise if a rank has exited; first handle what it sent before dying (its traceback, or
        the EOF of its pipe), for at most 2 s, so the error names the root cause."""
        dead = [r for r in self._ranks if r.process.exitcode is not None and not r.info.get("port_taken")]
        if not dead:
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            item = self._group.get(0.1)
            if item is not None:
                self._handle(*item, what, on_reply)
            if all(r.info.get("port_taken") for r in dead):
                return
        self._rank_failed(dead[0], member_cause(dead[0]), what)

    def _rank_raised(self, r: _Rank, tb: str, what: str) -> None:
        # A peer's death makes the others' collectives fail: report the death, the root cause.
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline:
            dead = [o for o in self._ranks if o is not r and o.process.exitcode not in (None, 0)]
            if dead:
                self._rank_failed(dead[0], member_cause(dead[0]), what,
                                  note=f"\n{r.name} then raised: {_last_line(tb)}")
            time.sleep(0.1)
        code = r.process.exitcode
        self._rank_failed(r, f"raised {_last_line(tb)} ({'still running' if code is None else f'exit code {code}'})",
                          what, detail=tb)

    def _rank_failed(self, r: _Rank, cause: str, what: str, note: str = "", detail: str = "") -> None:
        self._raise(r.failure(cause, what, note, detail))

    def _raise(self, exc: TrainerError) -> None:
        """Record the failure, kill every rank (no orphans), raise."""
        if self._failure is None:
            self._failure = exc
            log.error("%s", str(exc).splitlines()[0])
            self._group.kill_all()
        raise self._failure


def _last_line(tb: str) -> str:
    """The "Class: message" line of a rank's traceback (not the last line of a multi-line message)."""
    lines = tb.strip().splitlines()
    return exception_line(tb) or (lines[-1] if lines else "an unknown error")
