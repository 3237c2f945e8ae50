"""The background checkpoint writer (``trainer.async_save``): one write in flight per rank.

Megatron-LM's way: megatron-core's ``dist_checkpointing.save(..., async_sharded_save=True)`` plans
the save (collective) and returns an ``AsyncRequest`` whose ``async_fn`` writes this rank's shard
files and whose ``finalize_fns`` write the global metadata (collective). megatron-core 0.16.1's own
scheduler (``AsyncCallsQueue`` / ``TemporalAsyncCaller``) calls ``torch.cuda.synchronize`` and
all-reduces a CUDA tensor, so it does not run on CPU / gloo; this module is the same scheme with
the device left out: :meth:`AsyncWriter.start` forks a writer process that runs ``async_fn``. The fork
is the snapshot (the writer sees the tensors as they were at the fork, copy-on-write, while the
trainer goes on updating its own); on a GPU the request's ``preload_fn`` copies them to host memory
first. :meth:`AsyncWriter.poll` (every step) and :meth:`AsyncWriter.wait` (the next save, a
preemption, the end of the run) are collective: all ranks agree the writes are done before the
finalize functions and then ``commit`` (manifest last, rename, ``latest``) run, so a writer killed
mid-write never leaves a checkpoint that counts as complete.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megarl.utils.faults import pause_point

log = logging.getLogger("megarl.trainer.checkpoint")

PAUSE = "checkpoint_async_write"  # fault tests hold the writer here (every write, or `...@<step>`: that
#                                   step's): its shards written, nothing committed
_POLL_S = 0.05  # how often a blocking wait looks at the writer process (s)
_EXIT_AFTER_RESULTS_S = 5.0  # once its results are read, the writer only flushes and exits (s, at most)


def _write(async_fn: Optional[Callable], args: tuple, kwargs: dict, step: int, parent: int,
           after_write: Optional[Callable[[], Any]]) -> None:
    """The writer process: this rank's shard files, then exit (its result goes back by the queue)."""
    from megarl.utils.procs import watch_parent

    watch_parent(parent)  # a killed rank takes its writer with it, and every process forked below it
    # (megatron's per-bucket writers) its own parent, else they wait forever on the writer's queues.
    # The hook is inherited by those processes too, so it watches whoever forked, taken before the fork.
    forking = [0]
    os.register_at_fork(before=lambda: forking.__setitem__(0, os.getpid()),
                        after_in_child=lambda: watch_parent(forking[0]))
    # A fork keeps the parent's OpenMP pool state but not its threads: the first parallel torch op
    # here (a clone or copy of a tensor over ATen's grain size, 32768 elements: every real model)
    # would wait forever on those threads (a futex, 0 CPU). One thread, as torch's DataLoader
    # workers do; megatron's own per-bucket writers, forked from here, inherit it.
    torch.set_num_threads(1)
    if async_fn is not None:
        async_fn(*args, **kwargs)
    if after_write is not None:
        after_write()  # e.g. the shards' CRCs, here rather than on the trainer's step
    log.info("checkpoint: async writer (pid %d) wrote the step-%d shards", os.getpid(), step)
    pause_point(PAUSE)
    pause_point(f"{PAUSE}@{step}")  # this step's write only (the kill matrix holds one)


class _ResultsQueue:
    """megatron's write-results queue (``put`` in the writer, ``get_nowait`` in the finalize), read
    while the writer runs. A forked writer's ``mp.Queue.put`` hands the item to a feeder thread, and
    the writer cannot exit until that thread has written it all into the pipe; past the pipe's
    buffer (64 KiB on Linux: a real model's write results are more) it waits for a reader. So this
    process must read before it waits for the exit, or both wait forever."""

    def __init__(self) -> None:
        self._pipe = mp.get_context("fork").Queue()
        self._got: "queue.Queue[Any]" = queue.Queue()

    def put(self, item: Any) -> None:  # in the writer
        self._pipe.put(item)

    def drain(self) -> int:
        """Read what the writer has sent since the last call (non-blocking); how many items."""
        n = 0
        while True:
            try:
                self._got.put(self._pipe.get_nowait())
                n += 1
            except queue.Empty:
                return n

    def get_nowait(self) -> Any:
        self.drain()
        return self._got.get_nowait()


class AsyncWriter:
    """One rank's background checkpoint writes, at most one in flight; every method but
    :attr:`in_flight` is collective over the trainer's ranks (they call them in the same order)."""

    def __init__(self, timeout_s: float) -> None:
        """``timeout_s``: the longest a blocking :meth:`wait` waits for the writer
        (trainer.save_timeout_s)."""
        self.timeout_s = float(timeout_s)
        self._proc: Optional[mp.process.BaseProcess] = None
        self._request: Any = None
        self._commit: Optional[Callable[[Optional[BaseException]], Path]] = None
        self._step = -1
        self._t0 = 0.0
        self._results: Optional[_ResultsQueue] = None

    @property
    def in_flight(self) -> Optional[int]:
        """The step being written, or None."""
        return self._step if self._commit is not None else None

    def results_queue(self) -> "_ResultsQueue":
        """The queue the forked writer puts its write results in for this process to read
        (megatron's writer defaults to a Manager server process per rank); drained by every poll."""
        self._results = _ResultsQueue()
        return self._results

    def start(self, request: Any, commit: Callable[[Optional[BaseException]], Path], step: int,
              after_write: Optional[Callable[[], Any]] = None) -> None:
        """Fork the writer for megatron's ``request`` (None: nothing to write on this rank);
        ``after_write()`` runs in the writer once its files are written; ``commit(failed)`` runs once
        every rank's write is done (``failed``: how it failed, else None)."""
        if self._commit is not None:
            raise RuntimeError(f"checkpoint: step {step} started while step {self._step} is being written")
        self._request, self._commit, self._step, self._t0 = request, commit, int(step), time.monotonic()
        fn, args, kwargs = None, (), {}
        if request is not None and request.async_fn is not None:
            fn, args, kwargs = request.async_fn, list(request.async_fn_args), dict(request.async_fn_kwargs)
            if request.preload_fn is not None and torch.cuda.is_available():
                args[1] = request.preload_fn()  # device tensors -> host memory (the snapshot)
        self._proc = mp.get_context("fork").Process(target=_write, args=(fn, tuple(args), kwargs, step, os.getpid(), after_write),
                                                    name=f"megarl-ckpt-writer-{step}")  # not a daemon: it forks megatron's file writers
        self._proc.start()
        log.info("checkpoint: step %d snapshot taken in %.2fs; writing in the background (pid %d)",
                 step, time.monotonic() - self._t0, self._proc.pid)

    def _all_done(self, deadline: float = float("inf")) -> bool:
        """Whether every rank's writer has finished; raises TimeoutError on every rank at once when
        one rank is past ``deadline`` (the decision is collective, so no rank is left waiting)."""
        if self._results is not None and self._results.drain() and self._proc is not None:
            self._proc.join(_EXIT_AFTER_RESULTS_S)  # its results just arrived: it exits now
        flags = torch.tensor([int(self._proc is not None and self._proc.is_alive()),
                              int(time.monotonic() > deadline)], dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        alive, late = (int(x) for x in flags.tolist())
        if alive and late:
            step = self._step
            self._abort()
            raise TimeoutError(f"checkpoint: the step-{step} background write did not finish within "
                               f"{self.timeout_s:g}s (trainer.save_timeout_s); raise it or check the disk")
        return not alive

    def poll(self) -> Optional[Path]:
        """Commit the write in flight if every rank's writer has finished; the committed step
        folder, else None (also when nothing is in flight)."""
        if self._commit is None or not self._all_done():
            return None
        return self._finish()

    def wait(self, why: str) -> Optional[Path]:
        """Block until the write in flight is done on every rank (at most ``timeout_s``), commit it,
        and log how long this waited (``why``: what waits); None when nothing is in flight."""
        if self._commit is None:
            return None
        t0 = time.monotonic()
        while not self._all_done(deadline=t0 + self.timeout_s):
            time.sleep(_POLL_S)
        waited = time.monotonic() - t0
        log.info("checkpoint: %s waited %.2fs for the step-%d background write", why, waited, self._step)
        return self._finish()

    def _abort(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._proc = self._request = self._commit = None
        self._step = -1

    def _finish(self) -> Path:
        proc, request, commit, step = self._proc, self._request, self._commit, self._step
        proc.join()
        self._proc = self._request = self._commit = None
        self._step = -1
        failed = torch.tensor([int(proc.exitcode != 0)], dtype=torch.int32)
        if dist.get_world_size() > 1:  # every rank skips the collective finalize, or none does
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        problem: Optional[BaseException] = None if not int(failed.item()) else RuntimeError(
            f"checkpoint: the step-{step} background writer "
            + (f"(pid {proc.pid}) exited with {proc.exitcode}" if proc.exitcode else "of another rank failed"))
        if request is not None and problem is None:
            try:
                for fn in request.finalize_fns:  # megatron's metadata (collective)
                    fn()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - torch DCP's CheckpointException; commit decides
                problem = e
        path = commit(problem)
        log.info("checkpoint: step %d written in the background in %.1fs", step, time.monotonic() - self._t0)
        return path
