"""One trainer rank in its own process: the far end of ``TrainerExecutor``'s command channel.

:func:`rank_main` is the spawned process's entry point. In order it: watches its parent (it dies
with the controller), sends stdout/stderr to its log file, leads its own process group, pins its
threads to its cores, joins the trainer's process group (gloo; megatron TP x PP, DP = world /
(tp * pp)), builds the learner (:class:`megarl.trainer.local.RankTrainer`: the same model,
optimizer and resume as the single-rank trainer; another role's, picked by its config's class:
:func:`_learner`), reports ``ready``, then serves commands until ``exit``.

Wire format (both directions): ``pickle`` bytes over a duplex ``multiprocessing`` pipe.
Commands ``(name, seq, *args)``; replies ``("ok", seq, payload)`` or ``("error", seq,
traceback)``; unsolicited ``("ready", info)``, ``("beat",)`` (a heartbeat thread, every
``HEARTBEAT_S``: the executor tells a frozen rank from one waiting in a collective) and
``("port_taken",)`` (the rendezvous port was taken before rank 0 bound it: the executor relaunches).
Commands are collective: the executor sends each to every rank.

:func:`attached_rank_main` is the same rank started by a launcher instead (srun on a trainer node,
``megarl.cluster.rank``): it connects to the executor (``megarl.executors.attach``), says hello,
receives the start arguments a spawned rank gets, and serves the same protocol over that socket.
It cannot watch a parent on another node: it exits when the executor's connection closes.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.trainer.config import TrainerConfig

log = logging.getLogger(__name__)
PORT_TAKEN_EXIT = 3  # rank 0's exit code when the rendezvous port was taken: the executor relaunches (0 ok, 1 failed)

HEARTBEAT_S = 1.0  # seconds between heartbeats (the executor's heartbeat_timeout_s is far longer)
COMMANDS = ("step", "save", "wait_saves", "sync", "logprobs", "values", "topology", "shards", "health")  # plus "exit"


class _Channel:
    """The rank's end of the pipe; sends are locked (the heartbeat thread shares it)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple:
        return pickle.loads(self.conn.recv_bytes())

    def beat_forever(self, on_lost=None) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self.send("beat")
            except OSError:  # the executor closed the pipe: the main thread will see it too
                if on_lost is not None:
                    on_lost()
                return


def _redirect_output(log_path: str) -> None:
    f = open(log_path, "ab", buffering=0)
    os.dup2(f.fileno(), 1)  # Python, torch and megatron all log here
    os.dup2(f.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _pin(cores: list[int] | None, world: int) -> int:
    """Bind this process to ``cores`` (one intra-op thread per core); without cores, share the
    allowed cores evenly with the other ranks so they do not oversubscribe. Returns the threads."""
    if cores:
        os.sched_setaffinity(0, cores)
        threads = len(cores)
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // world)
    torch.set_num_threads(threads)
    return threads


def _coords() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank()}


def _shards(trainer) -> list[tuple[dict, torch.Tensor]]:
    """This rank's HF pieces for the executor to reassemble; DP replicas other than dp 0 hold the
    same values and send none. Host copies: the result is pickled to the controller, and a CUDA
    tensor there would start CUDA in the controller and put a copy of the model on its cuda:0."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.shards import local_shard_specs

    if ps.get_data_parallel_rank() != 0:
        return []
    return [(s.describe(), s.local_view.detach().to("cpu", copy=True))
            for s in local_shard_specs(trainer.model) if not s.is_tied_copy]


class _Server:
    """The command handlers of one rank."""

    def __init__(self, trainer, info: dict, reports: bool):
        self.trainer, self.info, self.reports = trainer, info, reports
        self._sender = None
        self._sender_spec = None

    def step(self, batch) -> dict:
        metrics = self.trainer.step(batch)
        return {"step": self.trainer.step_count, "metrics": metrics if self.reports else None}

    def save(self) -> str:
        return str(self.trainer.save())

    def wait_saves(self) -> None:
        self.trainer.wait_saves()

    def sync(self, spec, version: int) -> dict:
        if self._sender is None or self._sender_spec != spec:  # one sender (plan, store) per topology
            from megarl.trainer.ddma import make_sender

            self._sender = make_sender(self.trainer.model, spec)
            self._sender_spec = spec
        return self._sender.sync(int(version))

    def logprobs(self, batch, temperature) -> torch.Tensor | None:
        lp = self.trainer.logprobs(batch, temperature)  # collective: every rank runs it
        return lp if self.reports else None

    def values(self, batch) -> torch.Tensor | None:
        v = self.trainer.values(batch)  # a value model's ranks (the critic's): collective like logprobs
        return v if self.reports else None

    def topology(self):
        return self.trainer.topology()

    def shards(self) -> list:
        return _shards(self.trainer)

    def health(self) -> dict:
        return {**self.info, "step": self.trainer.step_count}


def rank_main(conn, rank: int, world: int, master_port: int, cfg: TrainerConfig, algo: AlgorithmConfig,
              model_dir: str, total_steps: int, run_dir: str, cores: list[int] | None, log_path: str,
              parent_pid: int | None = None, pdeathsig: bool = True, cuda_devices: str | None = None) -> None:
    """Entry point of trainer rank ``rank`` of ``world`` (spawned by ``TrainerExecutor``).
    ``parent_pid`` / ``pdeathsig``: see :func:`megarl.utils.procs.watch_parent`. ``cuda_devices``:
    this rank's CUDA_VISIBLE_DEVICES (megarl.config.placement), set before CUDA initialises."""
    from megarl.utils.procs import watch_parent

    watch_parent(parent_pid, pdeathsig=pdeathsig)  # first: no rank outlives its controller
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    _redirect_output(log_path)
    # Its own process group: the executor kills it with anything it started, and a terminal's
    # Ctrl-C reaches only the controller, which then shuts the ranks down in order.
    os.setpgrp()
    _run(_Channel(conn), rank, lambda chan: _serve(chan, rank, world, master_port, cfg, algo, model_dir,
                                                   total_steps, run_dir, cores))


def attached_rank_main(rank: int, world: int, *, controller: tuple[str, int], authkey: bytes, job_id: str,
                       master_addr: str, master_port: int, connect_timeout_s: float,
                       cuda_devices: str | None = None, cleanup=None) -> None:
    """Entry point of trainer rank ``rank`` of ``world`` started by a launcher: connect to the
    executor at ``controller`` (retrying up to ``connect_timeout_s``), then serve like a spawned
    rank, joining the trainer's process group at ``master_addr:master_port``. ``cleanup``: run
    before the process exits (its job-scoped temp dir). Never returns."""
    from megarl.executors.attach import join_controller

    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    conn, init = join_controller("trainer rank", rank, controller, authkey, job_id, connect_timeout_s,
                                 "trainer.start_timeout_s")
    chan = _Channel(conn)
    log.info("trainer rank %d: logs in %s", rank, init["log_path"])
    _redirect_output(init["log_path"])
    _run(chan, rank, lambda ch: _serve(ch, rank, world, master_port, init["cfg"], init["algo"], init["model_dir"],
                                       init["total_steps"], init["run_dir"], init["cores"], master_addr=master_addr),
         exit_on_lost=True, cleanup=cleanup)


def _run(chan: _Channel, rank: int, serve, exit_on_lost: bool = False, cleanup=None) -> None:
    """Heartbeats, then ``serve(chan)``; exits the process (code 0 after ``exit``, 1 on failure)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format=f"%(asctime)s trainer-rank{rank} %(levelname)s %(name)s: %(message)s")

    def finish(code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if cleanup is not None:
            cleanup()
        os._exit(code)  # not a normal exit: gloo/megatron teardown can hang after a failure

    def lost() -> None:
        log.error("trainer rank %d: the controller's connection closed; exiting", rank)
        finish(1)

    threading.Thread(target=chan.beat_forever, args=(lost if exit_on_lost else None,), daemon=True,
                     name="megarl-trainer-beat").start()
    try:
        serve(chan)
    except BaseException:  # noqa: BLE001 - a start-up failure goes back to the executor
        tb = traceback.format_exc()
        log.error("trainer rank %d failed:\n%s", rank, tb)
        try:
            chan.send("error", None, tb)
        except OSError:
            pass
        finish(1)
    finish(0)


def _learner(cfg: TrainerConfig):
    """The class one rank builds, picked by the config's class: a role's config subclass names its own
    (``rank_class()``: the critic's, megarl/critic/executor.py, which this floor does not import), a
    forward-only config the frozen rank (the teacher's), else the trainer's learner."""
    from megarl.trainer.forward_only import ForwardOnlyConfig, ForwardOnlyRank
    from megarl.trainer.local import RankTrainer

    own = getattr(type(cfg), "rank_class", None)
    if own is not None:
        return own()
    return ForwardOnlyRank if isinstance(cfg, ForwardOnlyConfig) else RankTrainer


def _serve(chan: _Channel, rank: int, world: int, master_port: int, cfg: TrainerConfig,
           algo: AlgorithmConfig, model_dir: str, total_steps: int, run_dir: str,
           cores: list[int] | None, master_addr: str = "127.0.0.1") -> None:
    from megarl.utils.dist import destroy_distributed, init_distributed, init_model_parallel

    t0 = time.monotonic()
    threads = _pin(cores, world)
    # Collectives may wait on a slow peer this long; longer than the executor's own timeouts, so
    # the executor (which names the silent rank) always fires first.
    pg_timeout = max(cfg.start_timeout_s, cfg.step_timeout_s, cfg.save_timeout_s) + 60.0
    try:
        init_distributed(rank, world, master_addr=master_addr, master_port=master_port, timeout_s=pg_timeout)
    except Exception as e:  # noqa: BLE001
        if rank == 0 and "address already in use" in str(e).lower():
            chan.send("port_taken")
            sys.stderr.flush()
            os._exit(PORT_TAKEN_EXIT)
        raise
    init_model_parallel(cfg.tp, cfg.pp, seed=cfg.seed, ep=cfg.ep, timeout_s=pg_timeout)  # Megatron's groups too
    trainer = _learner(cfg)(cfg, algo, model_dir, total_steps=total_steps, run_dir=run_dir)
    from megatron.core import parallel_state as ps

    coords = _coords()
    reports = coords["tp"] == 0 and coords["dp"] == 0 and ps.is_pipeline_last_stage()
    info = {"rank": rank, **coords, "pid": os.getpid(), "host": socket.gethostname(), "cores": list(cores or []), "threads": threads,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "reports_metrics": reports}
    server = _Server(trainer, info, reports)
    log.info("trainer rank %d (tp %d, pp %d, dp %d) ready in %.1fs at step %d, %d thread(s), cores %s",
             rank, coords["tp"], coords["pp"], coords["dp"], time.monotonic() - t0, trainer.step_count,
             threads, cores or "any")
    chan.send("ready", {**info, "step": trainer.step_count, "start_s": time.monotonic() - t0})
    while True:
        name, seq, *args = chan.recv()
        if name == "exit":
            log.info("trainer rank %d: exit requested", rank)
            chan.send("ok", seq, None)
            break
        try:
            if name not in COMMANDS:
                raise ValueError(f"unknown trainer command {name!r}; expected one of {COMMANDS} or 'exit'")
            t = time.monotonic()
            out = getattr(server, name)(*args)
            log.info("trainer rank %d: %s (seq %d) done in %.2fs", rank, name, seq, time.monotonic() - t)
            chan.send("ok", seq, out)
        except Exception:  # noqa: BLE001 - reported; the executor decides (it stops the job)
            tb = traceback.format_exc()
            log.error("trainer rank %d: %s (seq %d) failed:\n%s", rank, name, seq, tb)
            chan.send("error", seq, tb)
    destroy_distributed()


__all__ = ["rank_main", "attached_rank_main", "HEARTBEAT_S"]
