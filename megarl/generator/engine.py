"""One generator replica: a process hosting a vLLM engine, driven over a pipe.

The replica owns its engine's step loop (an in-process ``LLMEngine``; for TP > 1 vLLM's own
multiprocessing executor runs the TP workers as its children). Between two engine steps it
handles commands: new requests, aborts, health probes and weight updates. An update arriving while
requests are decoding is the in-flight update of ``pause_generation(mode="keep")``: no step runs
while it is applied, in-flight requests stay queued, and they continue under the new weights. Their
KV cache, computed under the old weights, is dropped (the running requests are preempted by
``reset_prefix_cache(reset_running_requests=True)``) so every token after the switch is exactly the
new policy's continuation of the prefix, and no later request can hit a stale prefix-cache block.

Every generated token is tagged with the policy version the engine held when the step producing
it ran, so per-token versions are exact.

Wire protocol (tuples; the first item names the message):
  executor -> replica: ("submit", [spec, ...]), ("update", source, version),
                       ("health", token), ("rpc", token, megarl_method, args), ("shutdown",)
  replica -> executor: ("ready", info), ("done", [result, ...]), ("progress", info),
                       ("updated", version, seconds, {"busy_s", "load_s"}),
                       ("health", token, info), ("rpc", token, per_worker_results_or_error),
                       ("error", traceback_text)
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from megarl.generator.config import GeneratorConfig
from megarl.utils.faults import armed as fault_armed, pause_point

IDLE_POLL_S = 0.2  # how long the idle loop blocks on the pipe before re-checking its parent
HEARTBEAT_S = 5.0  # while decoding, report progress this often (the executor's liveness clock)


def replica_env(cfg: GeneratorConfig, threads_bind: str | None, on_cpu: bool) -> dict[str, str]:
    """Environment a replica process sets before importing vLLM."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core lives in this process
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from megarl.utils.paths import data_dir
        env["TORCHINDUCTOR_CACHE_DIR"] = str(data_dir() / "torchinductor")
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.kv_cache_gib))
        if threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    # TP workers are vLLM's children: make sure they can import megarl (the worker extension).
    repo_root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([repo_root, *paths])
    return env


# Debugging/testing hook: vLLM's CPU attention picks its kernel from the CPU (AMX for bf16 whenever
# the CPU has AMX, else the vector kernel) with no knob of its own; numerics differ between them.
# Setting this variable (e.g. 'vec') in an engine's environment forces that kernel, so one machine
# can compare the two. Only a kernel the CPU can run works ('amx' needs AMX).
FORCE_CPU_ATTN_KERNEL_ENV = "MEGARL_FORCE_CPU_ATTN_KERNEL"


def force_cpu_attention_kernel(kernel: str) -> None:
    """Make vLLM's CPU attention use ``kernel`` ('vec', 'vec16', 'amx', ...) in this process."""
    from vllm.v1.attention.backends import cpu_attn

    chosen = cpu_attn._get_attn_isa

    def forced(*args, **kwargs) -> str:
        print(f"megarl: CPU attention kernel forced to {kernel!r} (vLLM chose {chosen(*args, **kwargs)!r})",
              flush=True)
        return kernel

    cpu_attn._get_attn_isa = forced


def engine_args(cfg: GeneratorConfig, model_dir: str, replica: int, on_cpu: bool, deterministic: bool = False):
    """vLLM's engine arguments for replica ``replica``. ``deterministic`` (controller.deterministic):
    one sequence at a time, no prefix cache, and a whole prompt in one prefill step, so a request's
    numerics never depend on what else the engine holds; per-request seeds then make each sample a
    function of its seed and weights (a chunked prefill would crash them on CPU: vLLM rewinds the
    request's generator offset, which CPU generators lack)."""
    from vllm import EngineArgs

    from megarl.generator.weights import WORKER_EXTENSION

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=cfg.tp,
        dtype=cfg.dtype,
        quantization=None if cfg.quantization == "none" else cfg.quantization,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed + replica,
        enforce_eager=cfg.enforce_eager,
        logprobs_mode="processed_logprobs" if cfg.logprobs_mode == "processed" else "raw_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=not deterministic,
        disable_log_stats=True,
    )
    if deterministic:
        kwargs.update(max_num_seqs=1, max_num_batched_tokens=max(cfg.max_model_len, 2048))
    if cfg.tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if not on_cpu:
        if cfg.gpu_memory_utilization > 0:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib) * 2**30
    return EngineArgs(**kwargs)


class _Replica:
    """The loop inside the replica process."""

    def __init__(self, conn, cfg: GeneratorConfig, model_dir: str, replica: int, on_cpu: bool,
                 deterministic: bool = False):
        from vllm import LLMEngine

        self.conn = conn
        self.cfg = cfg
        self.replica = replica
        self.parent_pid = os.getppid()
        self.version = 0
        self.engine = LLMEngine.from_engine_args(engine_args(cfg, model_dir, replica, on_cpu, deterministic))
        self.pending: dict[str, dict] = {}  # rid -> {"ids": [...], "lps": [...], "vers": [...]}
        self.running = True
        self.steps = 0
        self.tokens = 0
        self.busy_s = 0.0  # seconds inside engine steps (decoding/prefill): the replica's busy time
        self.load_s = 0.0  # seconds loading weights
        self.last_report = time.monotonic()
        self.fault_paused: set[str] = set()  # fault pause points this replica already held at
        # MoE: each request's routed experts per MoE layer go back with its tokens (router replay, R3)
        self.moe_layers = self.engine.collective_rpc("megarl_capture_routed_experts")[0]

    def sampling_params(self, max_tokens: int, overrides: dict, seed: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        c = self.cfg
        stop = list(overrides.get("stop", c.stop)) or None
        return SamplingParams(
            n=1, temperature=overrides.get("temperature", c.temperature),
            top_p=overrides.get("top_p", c.top_p), top_k=overrides.get("top_k", c.top_k),
            max_tokens=max_tokens, stop=stop, logprobs=0, output_kind=RequestOutputKind.DELTA,
            detokenize=bool(stop),  # text is only needed to match stop strings
            ignore_eos=bool(overrides.get("ignore_eos", False)),
            seed=seed,  # set only in deterministic mode (see engine_args)
        )

    # --- commands ------------------------------------------------------------------------------
    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            for spec in msg[1]:
                rid = spec["rid"]
                self.pending[rid] = {"ids": [], "lps": [], "vers": []}
                self.engine.add_request(rid, {"prompt_token_ids": list(spec["prompt_ids"])},
                                        self.sampling_params(int(spec["max_tokens"]),
                                                             spec.get("sampling") or {}, spec.get("seed")))
        elif kind == "update":
            self.update(msg[1], int(msg[2]))
        elif kind == "health":
            self.conn.send(("health", msg[1], self.info()))
        elif kind == "rpc":  # a read-only MegarlWorkerExtension method on every TP worker
            method = msg[2]
            if not method.startswith("megarl_"):
                raise ValueError(f"rpc {method!r}: only MegarlWorkerExtension methods (megarl_*)")
            try:
                out: Any = self.engine.collective_rpc(method, args=tuple(msg[3]))
            except Exception as e:  # reported to the caller, the engine itself is fine
                out = f"{type(e).__name__}: {e}"
            self.conn.send(("rpc", msg[1], out))
        elif kind == "shutdown":
            self.running = False
        else:
            raise ValueError(f"unknown command {kind!r}")

    def update(self, source: dict, version: int) -> None:
        """Apply new weights between two steps (in-flight requests are kept and continue)."""
        t0 = time.monotonic()
        # The kill matrix (tests/faults) waits for this line to kill a replica mid-landing.
        _log(f"replica {self.replica} (pid {os.getpid()}): landing weights v{version}")
        pause_point(f"replica_landing@r{self.replica}v{version}")  # fault tests: a kill lands mid-landing
        # Sources addressed per worker (DDMA) need to know which replica this is; a source may say
        # itself (a sync to one restarted replica alone is a topology of one replica: index 0).
        self.engine.collective_rpc("megarl_reload_weights", args=({"replica": self.replica, **source},))
        # Drop every KV block computed with the old weights: running requests are preempted and
        # recompute their prefix under the new weights; the prefix cache starts empty.
        if not self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        if self.moe_layers:  # the reload may have rebuilt a router: hook it again
            self.engine.collective_rpc("megarl_capture_routed_experts")
        self.version = version
        self.load_s += time.monotonic() - t0
        _log(f"replica {self.replica}: weights v{version} landed in {time.monotonic() - t0:.2f}s")
        # the counters ride on the reply the sync waits for, so its step counts this load (a later
        # "done" would give it to whichever step reads that, or to none)
        self.conn.send(("updated", version, time.monotonic() - t0, {"busy_s": self.busy_s, "load_s": self.load_s}))

    def info(self) -> dict:
        return {"replica": self.replica, "pid": os.getpid(), "version": self.version,
                "pending": len(self.pending), "steps": self.steps, "tokens": self.tokens,
                "busy_s": self.busy_s, "load_s": self.load_s}

    def shm_prefixes(self) -> list[str]:
        """Prefixes of the /dev/shm files vLLM's CPU TP communicator creates (it never removes
        them); the executor deletes them once this replica is gone."""
        if self.cfg.tp == 1:
            return []
        idents = self.engine.collective_rpc(_dist_ident)
        return sorted({f"{i}-" for i in idents if i})

    # --- generation ----------------------------------------------------------------------------
    def _result(self, rid: str, finish_reason: str | None, stop_reason: Any) -> dict:
        st = self.pending.pop(rid)
        return {"rid": rid, "ids": st["ids"], "lps": st["lps"], "vers": st["vers"],
                "finish_reason": finish_reason or "abort", "stop_reason": stop_reason}

    def step(self) -> None:
        finished = []
        t0 = time.monotonic()
        outputs = self.engine.step()
        self.busy_s += time.monotonic() - t0
        for out in outputs:
            st = self.pending.get(out.request_id)
            if st is None:
                continue
            comp = out.outputs[0]
            new_ids = list(comp.token_ids)
            if new_ids:
                if comp.logprobs is None or len(comp.logprobs) != len(new_ids):
                    raise RuntimeError(f"request {out.request_id}: {len(new_ids)} tokens but "
                                       f"{0 if comp.logprobs is None else len(comp.logprobs)} logprobs")
                st["ids"].extend(new_ids)
                st["lps"].extend(float(d[t].logprob) for t, d in zip(new_ids, comp.logprobs))
                st["vers"].extend([self.version] * len(new_ids))
                self.tokens += len(new_ids)
            if out.finished:
                finished.append(self._result(out.request_id, comp.finish_reason, comp.stop_reason))
        self.steps += 1
        point = f"replica_decoding@r{self.replica}v{self.version}"
        if self.pending and not self.fault_paused & {point, "*"} and fault_armed(point):
            # Fault tests: hold here once, mid-generation, so a kill or SIGSTOP lands while this replica decodes.
            self.fault_paused.add(point)
            _log(f"replica {self.replica} (pid {os.getpid()}): decoding {len(self.pending)} request(s) at "
                 f"v{self.version}, {self.tokens} token(s) so far: fault pause")
            pause_point(point)
        if finished and self.moe_layers:
            # worker 0's record (every TP worker routes every token alike)
            routed = self.engine.collective_rpc("megarl_take_routed_experts", args=([r["rid"] for r in finished],))[0]
            for r in finished:
                r["experts"] = routed.get(r["rid"])
        if finished:
            self.conn.send(("done", finished, {"busy_s": self.busy_s, "load_s": self.load_s}))
        elif time.monotonic() - self.last_report > HEARTBEAT_S:
            self.conn.send(("progress", self.info()))
        if finished or time.monotonic() - self.last_report > HEARTBEAT_S:
            self.last_report = time.monotonic()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def loop(self) -> None:
        self.conn.send(("ready", {**self.info(), "shm_prefixes": self.shm_prefixes()}))
        while self.running:
            busy = self.engine.has_unfinished_requests()
            timeout = 0.0 if busy else IDLE_POLL_S
            while self.running and self.conn.poll(timeout):
                self.handle(self.conn.recv())  # EOFError here = the executor is gone
                timeout = 0.0
            if not self.parent_alive():
                return
            if self.running and self.engine.has_unfinished_requests():
                self.step()


def _log(message: str) -> None:
    """An INFO line in the replica's log (its stdout is the log file; vLLM owns its logging setup)."""
    print(f"{time.strftime('%H:%M:%S')} INFO megarl.generator.engine: {message}", flush=True)


def _dist_ident(worker=None) -> str:
    return os.environ.get("VLLM_DIST_IDENT", "")


def replica_main(conn, cfg: GeneratorConfig, model_dir: str, replica: int, threads_bind: str | None,
                 on_cpu: bool, log_path: str, cuda_devices: str | None, parent_pid: int | None = None,
                 pdeathsig: bool = True, attached: bool = False, cleanup=None, deterministic: bool = False,
                 restarts: int = 0) -> None:
    """Entry point of a replica process (spawned by the executor). ``parent_pid`` / ``pdeathsig``:
    see :func:`megarl.utils.procs.watch_parent` (the replica dies with the executor's process).
    ``attached``: started by a launcher on another node (:func:`attached_replica_main`); it has no
    parent to watch and exits when the executor's connection closes. ``cleanup``: run before exit.
    ``deterministic``: controller.deterministic (see :func:`engine_args`). ``restarts``: how often
    this replica was restarted before (megarl/generator/supervision.py); fault pauses hold only the first."""
    from megarl.utils.procs import watch_parent

    if not attached:
        watch_parent(parent_pid, pdeathsig=pdeathsig)  # first: no replica outlives its controller
    log = open(log_path, "ab", buffering=0)
    os.dup2(log.fileno(), 1)  # vLLM, its C++ kernels and its TP workers all log here
    os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(replica_env(cfg, threads_bind, on_cpu))
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    # Its own process group: the executor (and the parent watch) kill it with its TP workers, and a
    # terminal's Ctrl-C reaches only the controller, which then shuts the replica down in order.
    if os.getpgrp() != os.getpid():  # a launcher may have made it a session leader already
        os.setpgrp()
    if on_cpu and os.environ.get(FORCE_CPU_ATTN_KERNEL_ENV):
        force_cpu_attention_kernel(os.environ[FORCE_CPU_ATTN_KERNEL_ENV])
    replica_obj = None
    code = 0
    try:
        replica_obj = _Replica(conn, cfg, model_dir, replica, on_cpu, deterministic)
        if restarts:
            _log(f"replica {replica} (pid {os.getpid()}): restart {restarts} of this replica")
            replica_obj.fault_paused.add("*")  # fault tests hold the first incarnation only
        replica_obj.loop()
    except EOFError:
        pass  # executor closed the pipe: exit quietly
    except BaseException:
        code = 1
        text = traceback.format_exc()
        print(text, flush=True)
        try:
            conn.send(("error", text))
        except Exception:
            pass
    finally:
        if replica_obj is not None:
            try:
                replica_obj.engine.engine_core.shutdown()
            except Exception:
                pass
    try:
        conn.close()
    except Exception:
        pass
    if cleanup is not None:
        cleanup()
    os._exit(code)  # skip interpreter teardown of vLLM's threads (can hang)


def attached_replica_main(replica: int, *, controller: tuple[str, int], authkey: bytes, job_id: str,
                          connect_timeout_s: float, threads_bind: str | None, cuda_devices: str | None,
                          cleanup=None) -> None:
    """Entry point of generator replica ``replica`` started by a launcher (srun on a generator node,
    ``megarl rank --role generator``): connect to the generator executor at ``controller`` (retrying
    up to ``connect_timeout_s``), say hello, receive the start arguments a spawned replica gets, and
    run it over that connection. Never returns."""
    from megarl.executors.attach import join_controller

    conn, init = join_controller("generator replica", replica, controller, authkey, job_id, connect_timeout_s,
                                 "generator.start_timeout_s")
    print(f"generator replica {replica}: logs in {init['log_path']}", file=sys.stderr, flush=True)
    replica_main(conn, init["cfg"], init["model_dir"], replica, threads_bind, init["on_cpu"], init["log_path"],
                 cuda_devices, attached=True, cleanup=cleanup, deterministic=bool(init.get("deterministic")))
