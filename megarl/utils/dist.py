"""torch.distributed + megatron model-parallel setup, and a multi-process launcher for tests/tools.

The backend is chosen at runtime: gloo on CPU machines, gloo for CPU tensors and NCCL for CUDA
tensors on GPU machines. On CPU, the megatron compat layer is applied before any megatron
parallel state is created.
"""

from __future__ import annotations

import datetime
import logging
import math
import queue as queue_lib
import random
import socket
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.utils.errors import remote_error

log = logging.getLogger(__name__)


def default_backend() -> str:
    """"gloo" on CPU machines, "cpu:gloo,cuda:nccl" when CUDA is available."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def free_tcp_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1",
                     master_port: int = 29500, timeout_s: float = 300.0) -> None:
    """Join the default process group (TCP rendezvous at master_addr:master_port)."""
    if dist.is_initialized():
        raise RuntimeError("init_distributed: torch.distributed is already initialized in this "
                           "process; call destroy_distributed() first")
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    log.info("rank %d/%d: joining process group at %s:%d (backend %s, timeout %.0fs)",
             rank, world_size, master_addr, master_port, default_backend(), timeout_s)
    dist.init_process_group(
        backend=default_backend(), init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1,
                        timeout_s: float | None = None) -> None:
    """Create megatron's TP/PP/DP groups (and, with ``ep`` > 1, expert-parallel groups inside the DP
    ranks) over the default group and seed every RNG. ``timeout_s``: how long a collective of those
    groups waits for a silent peer (whole minutes, rounded up: Megatron's unit); None: Megatron's
    default (30 min), not the default group's.

    The same seed on every rank gives the same master weights under use_cpu_initialization
    (megatron draws the full tensor, then slices it), so TP=1 and TP=2 models start identical.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megarl.compat import apply_cpu_compat

    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel: call init_distributed() first")
    on_cpu = apply_cpu_compat()
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ValueError(f"tensor parallel ({tp}) x pipeline parallel ({pp}) = {tp * pp} must "
                         f"divide the world size ({world}); change trainer tp/pp or the number "
                         f"of trainer ranks")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if ep < 1 or (world // (tp * pp)) % ep:
        raise ValueError(f"expert parallel ({ep}) must divide the data parallel size ({world // (tp * pp)}); "
                         f"change trainer ep or the number of trainer ranks")
    minutes = {} if timeout_s is None else {"distributed_timeout_minutes": max(1, math.ceil(timeout_s / 60.0))}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, **minutes)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CPU the inference tracker is the one that does not need CUDA generators.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu, force_reset_rng=True)


def destroy_distributed() -> None:
    """Tear down megatron parallel state and the default process group (safe to call twice)."""
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _child_main(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable,
                args: tuple, kwargs: dict, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        try:
            init_distributed(rank, world_size, master_port=port, timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001
            if "address already in use" in str(e).lower():  # the free port was taken meanwhile
                results.put((rank, "port_taken", str(e)))
                return
            raise
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            destroy_distributed()
        except Exception:  # noqa: BLE001 - teardown after a failure may itself fail
            pass


class MultiprocessError(RuntimeError):
    """A rank spawned by run_multiprocess failed, crashed or timed out."""


class _PortTaken(MultiprocessError):
    """Another process took the rendezvous port between choosing and binding it."""


def run_multiprocess(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
                     **kwargs: Any) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size fresh processes joined in a process
    group; return the per-rank results (picklable) in rank order.

    fn must be importable (module level). Raises MultiprocessError naming the rank and carrying
    its traceback when a rank raises, dies, or the whole run exceeds timeout_s; the other ranks
    are then terminated, so a failure never hangs the caller. If the rendezvous port is taken
    by another process before rank 0 binds it, the launch is retried on a new port.
    """
    deadline = time.monotonic() + timeout_s
    for attempt in range(3):
        try:
            return _launch(fn, world_size, args, kwargs, deadline, timeout_s)
        except _PortTaken as e:
            log.warning("run_multiprocess: %s; retrying on another port (attempt %d)", e,
                        attempt + 2)
    raise MultiprocessError("run_multiprocess: the rendezvous port was taken 3 times in a row")


def _launch(fn: Callable, world_size: int, args: tuple, kwargs: dict, deadline: float,
            timeout_s: float) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_tcp_port()
    procs = [ctx.Process(target=_child_main, name=f"megarl-rank{r}", daemon=False,
                         args=(r, world_size, port, timeout_s, fn, args, kwargs, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    fn_name = getattr(fn, "__qualname__", repr(fn))
    log.info("run_multiprocess: waiting up to %.0fs for %d ranks running %s", timeout_s,
             world_size, fn_name)
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue_lib.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and not p.is_alive() and p.exitcode not in (None, 0):
                        # one more look: the result may have been queued just before exit
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                            break
                        except queue_lib.Empty:
                            raise MultiprocessError(
                                f"rank {r} of {world_size} running {fn_name} died with exit "
                                f"code {p.exitcode} before reporting a result") from None
                else:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(outputs))
                        raise MultiprocessError(
                            f"run_multiprocess: ranks {missing} of {world_size} running {fn_name} "
                            f"did not finish within {timeout_s:.0f}s")
                    continue
            if status == "port_taken":
                raise _PortTaken(f"rank {rank}: port {port}: {payload}")
            if status != "ok":
                exc = MultiprocessError(f"rank {rank} of {world_size} running {fn_name} raised:\n{payload}")
                exc.component = f"rank {rank} of {world_size} (pid {procs[rank].pid} on {socket.gethostname()})"
                exc.remote_error = remote_error(payload)  # the class the rank raised (megarl/utils/errors.py)
                raise exc
            outputs[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    return [outputs[r] for r in range(world_size)]
