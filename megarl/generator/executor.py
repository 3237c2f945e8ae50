"""Generator executor: vLLM engine replicas, routing, policy versions, partial rollouts.

The executor runs in the controller's process and never generates itself: every replica is its
own process (:mod:`megarl.generator.engine`) in the executor's process group
(megarl/executors/group.py: spawn or attach, pipes, reader threads, waits, heartbeats, kill-all),
so a crashed engine is observed (its exit code or traceback) and reported as
:class:`GeneratorEngineDied` instead of a hang. Every wait has a timeout from the config and
names what it waits for.

Lifecycle: ``start()`` -> ``submit()`` / ``collect()`` (or ``generate()``) with
``update_weights()`` at any time -> ``shutdown()`` (also on ``with`` exit and interpreter exit).

Partial rollouts (``round_token_budget > 0``): each round a sample generates at most that many new
tokens; a sample cut by the budget (not finished by EOS, a stop string or its own length limit) is
cached with its tokens, logprobs and versions, and resumed -- prompt + tokens so far as the new
prompt, the remaining budget as the limit -- after the next weight update, so its later tokens come
from the newer policy. If nothing else is left to generate while a caller waits for samples,
cached partials resume under the current policy rather than stall the loop.

Deterministic mode (``deterministic=True``, controller.deterministic): every round of a sample is
its own request with a seed derived from (generator.seed, the sample's seed key from the caller,
its sample index, the tokens it has so far), and the engines run one sequence at a time without a
prefix cache (engine.engine_args), so a round's tokens and logprobs are a function of its seed, its
prefix and the weights, whatever else runs and whenever it runs. ``drain()`` before each update
(the controller's weight sync does it) makes the weights of every round the version current when it
was submitted, and :meth:`restore` puts back cut partials as cached (resumed at the next update or
stall, as in the run that saved them) and only re-sends the rounds that were in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.executors.base import ExecutorBase
from megarl.executors.group import ProcessGroup, Stalled, member_cause
from megarl.generator.config import GeneratorConfig
from megarl.generator.threads import threads_binds
from megarl.generator.replicas import ReplicaHandle, Track, model_vocab_size, remove_shm_files, request_seed
from megarl.generator.errors import GeneratorEngineDied, GeneratorError, GeneratorTimeout
from megarl.generator.supervision import ReplicaSupervision
from megarl.generator.weight_updates import WeightUpdater
from megarl.rollout import Sample, merge_rounds
from megarl.utils.errors import exception_line
from megarl.utils.procs import spawned_from_main_thread

log = logging.getLogger(__name__)

SAMPLING_OVERRIDES = {"temperature", "top_p", "top_k", "stop", "ignore_eos"}  # ignore_eos: benchmarks


class GeneratorExecutor(ReplicaSupervision, ExecutorBase):
    """vLLM engine replicas behind one submit/collect/update interface (the executor protocol of
    megarl/executors/base.py: start, health, close, pids)."""

    def __init__(self, cfg: GeneratorConfig, model_dir: str | os.PathLike,
                 cuda_devices: Sequence[int] | None = None, launcher: str = "local",
                 log_dir: str | os.PathLike | None = None, deterministic: bool = False):
        """``launcher``: 'local' spawns the replicas here; 'slurm' waits for them to attach (started by
        srun on the generator nodes, ``megarl rank --role generator``; megarl/executors/attach.py).
        ``log_dir``: the replicas' logs (default generator.log_dir, else a temporary folder); attached
        replicas on other nodes write there, so it must be on a filesystem every node sees.
        ``deterministic``: controller.deterministic (see the module docstring)."""
        on_cpu = not torch.cuda.is_available()
        problems = cfg.problems(on_cpu=on_cpu)
        if problems:
            raise ValueError("invalid generator config:\n  " + "\n  ".join(problems))
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"generator model folder {model_dir} has no config.json")
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.on_cpu = on_cpu
        self.cuda_devices = list(cuda_devices) if cuda_devices is not None else None
        self.deterministic = bool(deterministic)
        self.version = 0
        # the replica processes, their pipes and reader threads, waits, heartbeats, kill-all
        self._group = ProcessGroup("generator")
        self._tracks: dict[str, Track] = {}  # rid -> track in flight
        self._partials: list[Track] = []
        self._done: list[Sample] = []
        self._group_ids = itertools.count()
        self._round_ids = itertools.count()
        self._replies: dict[Any, Any] = {}
        self._failure: GeneratorError | None = None
        if launcher not in ("local", "slurm"):
            raise ValueError(f"launcher={launcher!r}: one of 'local' (spawn the replicas here) or 'slurm' (they attach)")
        self.launcher = launcher
        log_dir = log_dir or cfg.log_dir
        self._own_log_dir = not log_dir  # a temporary folder, removed after a clean shutdown
        self._log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="megarl-gen-"))
        self._closing = False
        self._launched_at = 0.0  # time.monotonic() of launch(): start_timeout_s counts from there
        self._init_supervision()
        self._weights = WeightUpdater(cfg, self)  # the executor as its UpdateHost

    @property
    def _replicas(self) -> list[ReplicaHandle]:
        return self._group.members

    @property
    def _procs(self) -> list:
        """Every replica process spawned here (restarted ones too)."""
        return self._group.procs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "GeneratorExecutor":
        """Start every replica and wait (``start_timeout_s``) until each is ready; on any failure no
        engine is left running (:meth:`launch`, then :meth:`await_ready`)."""
        return self.launch().await_ready()

    def launch(self) -> "GeneratorExecutor":
        """Spawn the replicas (attach mode: accept those srun started on the generator nodes and send
        each its start arguments) and return without waiting: they load vLLM while the controller
        waits for the trainer (megarl/controller/startup.py). On a failure no engine is left running."""
        if self._replicas:
            return self
        cfg = self.cfg
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._launched_at = time.monotonic()
        # The group kills every replica it spawned on shutdown(), on garbage collection and at
        # interpreter exit, also those already running when start-up is interrupted; each replica also
        # watches this process (megarl.utils.procs.watch_parent), for the deaths that run no finalizer.
        try:
            if self.launcher == "slurm":
                self._attach()
            else:
                binds = threads_binds(cfg) if self.on_cpu else [None] * cfg.replicas
                pdeathsig = spawned_from_main_thread()
                for r in range(cfg.replicas):
                    self._spawn_replica(r, binds[r], pdeathsig)
        except BaseException:
            self.shutdown()  # a failed start leaves no engine behind
            raise
        return self

    def await_ready(self, also_check: Callable[[], None] | None = None) -> "GeneratorExecutor":
        """Wait until every replica reported ready, up to ``start_timeout_s`` counted from the launch.
        ``also_check()`` runs at every look (it raises to end the wait: another executor failed).
        On any failure no engine is left running."""
        kind = "attached generator" if self.launcher == "slurm" else "generator"
        what = (f"{self.cfg.replicas} {kind} replica(s) to start "
                f"(generator.start_timeout_s={self.cfg.start_timeout_s:.0f} from the launch)")
        left = self._launched_at + self.cfg.start_timeout_s - time.monotonic()
        log.info("generator: waiting up to %.0fs more for %s (logs in %s)", max(left, 0.0), what, self._log_dir)
        try:
            self._wait(lambda: all(h.info for h in self._replicas), left, what, progress_resets=False,
                       also_check=also_check)
        except BaseException:
            self.shutdown()
            raise
        if self.launcher == "slurm":
            log.info("generator: %d replica(s) ready on %s", self.cfg.replicas,
                     ", ".join(sorted({h.process.host for h in self._replicas})))
        return self

    def has_exited(self) -> bool:
        """Whether a replica has exited (attached: its connection closed). Reads no message: another
        executor's wait asks it; this executor's own wait then says why."""
        return bool(self._group.exited())

    def _attach(self) -> None:
        """Attach mode: accept the replicas srun started on the generator nodes and send each its start
        arguments (what a spawned replica gets as its arguments)."""
        from megarl.executors.attach import AttachError, AttachSpec, accept_ranks, channel_port_var

        cfg = self.cfg
        try:
            conns = accept_ranks(AttachSpec.from_env(port_var=channel_port_var("generator")), cfg.replicas,
                                 cfg.start_timeout_s, role="generator", unit="replica",
                                 timeout_knob="generator.start_timeout_s")
        except AttachError as e:
            raise GeneratorError(str(e)) from None
        for r, (conn, hello) in enumerate(conns):
            log_path = self._log_dir / f"generator_replica{r}.log"
            conn.send(("init", {"cfg": cfg, "model_dir": self.model_dir, "on_cpu": self.on_cpu,
                                "log_path": str(log_path), "deterministic": self.deterministic}))
            self._group.attach(r, conn, hello, log_path, make=ReplicaHandle)

    def shutdown(self) -> None:
        """Ask every replica to exit; kill those that do not within shutdown_timeout_s. A replica
        still starting (loading vLLM, not yet reading its pipe) is killed at once: waiting for it
        would only delay a job that is being stopped, e.g. by a signal during start-up. An attached
        replica exits when told to, or when its connection closes."""
        self._closing = True
        # only a started replica reads its pipe (between engine steps); the rest are killed at once;
        # the group kills stragglers (and their TP workers), attached replicas exit on the EOF
        for h in self._group.close(("shutdown",), self.cfg.shutdown_timeout_s, leaving=lambda h: bool(h.info),
                                   knob="generator.shutdown_timeout_s"):
            remove_shm_files(h.info.get("shm_prefixes", []))
        if self._own_log_dir and self._failure is None:
            shutil.rmtree(self._log_dir, ignore_errors=True)  # after a failure it names the logs

    def close(self) -> None:
        """The executor protocol's name for :meth:`shutdown`."""
        self.shutdown()

    def __enter__(self) -> "GeneratorExecutor":
        return self.start() if not self._replicas else self

    # ------------------------------------------------------------------ generation
    def submit(self, prompts: Sequence[Sequence[int]], n_samples: int | None = None,
               max_new_tokens: int | None = None, prompt_indices: Sequence[int] | None = None,
               sampling: dict | None = None, round_token_budget: int | None = None,
               seed_keys: Sequence[str] | None = None, replica: int | None = None) -> list[int]:
        """Queue ``n_samples`` generations of every prompt (token ids); returns their group ids.
        The samples of a group go to one replica, where they share the prompt's prefix cache.

        ``sampling`` overrides the config's temperature / top_p / top_k / stop for these prompts
        (e.g. greedy evaluation on the training engines); ``round_token_budget`` overrides the
        partial-rollout budget (0 = off). ``seed_keys`` (deterministic mode; one per prompt, unique
        in the job, the same after a resume): the per-request seeds derive from them. ``replica``: run
        them there (the probe of a restarted replica), not on the least loaded."""
        self._check_failed()
        n = n_samples or self.cfg.n_samples
        limit = max_new_tokens or self.cfg.max_new_tokens
        sampling = dict(sampling or {})
        unknown = set(sampling) - SAMPLING_OVERRIDES
        if unknown:
            raise ValueError(f"sampling overrides {sorted(unknown)} not supported; use {sorted(SAMPLING_OVERRIDES)}")
        budget = self.cfg.round_token_budget if round_token_budget is None else int(round_token_budget)
        if limit + 1 > self.cfg.max_model_len:
            raise ValueError(f"max_new_tokens={limit} does not fit generator.max_model_len={self.cfg.max_model_len}")
        prompts = [[int(t) for t in prompt] for prompt in prompts]
        vocab = model_vocab_size(self.model_dir)
        for i, prompt in enumerate(prompts):  # validate all before queueing any
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if vocab and (min(prompt) < 0 or max(prompt) >= vocab):  # refused here, never inside a replica
                bad = [t for t in prompt if not 0 <= t < vocab]
                raise ValueError(f"prompt {i} has token id(s) {bad[:4]} outside the model's vocabulary [0, {vocab}) "
                                 f"(config.json vocab_size); nothing was queued: check the tokenizer matches model.path")
            if len(prompt) >= self.cfg.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, at least generator.max_model_len="
                                 f"{self.cfg.max_model_len}; shorten it or raise max_model_len")
        if prompt_indices is not None and len(prompt_indices) != len(prompts):
            raise ValueError(f"{len(prompt_indices)} prompt_indices for {len(prompts)} prompts")
        if seed_keys is not None and len(seed_keys) != len(prompts):
            raise ValueError(f"{len(seed_keys)} seed_keys for {len(prompts)} prompts")
        groups = []
        by_replica: dict[int, list[Track]] = {}
        for i, prompt in enumerate(prompts):
            g = next(self._group_ids)
            groups.append(g)
            target = self._least_loaded() if replica is None else replica
            for s in range(n):
                track = Track(key=f"g{g}s{s}", group_id=g, sample_index=s,
                               prompt_index=prompt_indices[i] if prompt_indices is not None else i,
                               prompt_ids=prompt, max_new_tokens=limit, round_budget=budget,
                               sampling=sampling, seed_key=seed_keys[i] if seed_keys is not None else "")
                track.replica = target
                by_replica.setdefault(target, []).append(track)
                self._replicas[target].active.add(track.key)  # reserve for load balancing
        for r, tracks in by_replica.items():
            self._send_round(r, tracks)
        return groups

    def collect(self, min_samples: int | None = None, timeout_s: float | None = None) -> list[Sample]:
        """Finished samples. Waits until ``min_samples`` are ready (default: everything submitted,
        partial rollouts included), at most ``timeout_s`` without any engine progress (default
        request_timeout_s); returns what is ready, oldest first."""
        timeout = self.cfg.request_timeout_s if timeout_s is None else timeout_s
        self._pump(0.0)
        possible = len(self._done) + self.num_outstanding
        want = possible if min_samples is None else min_samples
        if want > possible:
            raise ValueError(f"collect(min_samples={want}) but only {possible} sample(s) are submitted "
                             f"and not yet collected; submit more first")

        def ready() -> bool:
            if len(self._done) >= want:
                return True
            if not self._tracks and self._partials:  # nothing else runs: resume rather than stall
                log.info("generator: idle with %d partial rollout(s); resuming them at version %d",
                         len(self._partials), self.version)
                self.resume_partials()
            return False

        self._wait(ready, timeout, f"{want - len(self._done)} more sample(s) from the generator")
        out, self._done = self._done, []
        return out

    def poll(self) -> list[Sample]:
        """Finished samples so far, without waiting."""
        self._pump(0.0)
        out, self._done = self._done, []
        return out

    def generate(self, prompts: Sequence[Sequence[int]], n_samples: int | None = None,
                 max_new_tokens: int | None = None, sampling: dict | None = None,
                 round_token_budget: int | None = None, replica: int | None = None) -> list[Sample]:
        """Submit and wait for all samples of ``prompts`` (``replica``: on that one); ordered by
        prompt, then sample index."""
        groups = set(self.submit(prompts, n_samples, max_new_tokens, sampling=sampling,
                                 round_token_budget=round_token_budget, replica=replica))
        got: list[Sample] = []
        others: list[Sample] = []
        total = len(prompts) * (n_samples or self.cfg.n_samples)
        while len(got) < total:
            batch = self.collect(min_samples=1)
            for s in batch:
                (got if s.group_id in groups else others).append(s)
        self._done = others + self._done  # samples of earlier submits stay collectable
        return sorted(got, key=lambda s: (s.group_id, s.sample_index))

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until no request is in flight (finished samples and cut partials stay cached)."""
        timeout = self.cfg.request_timeout_s if timeout_s is None else timeout_s
        self._wait(lambda: not self._tracks, timeout, "in-flight generations to finish or be cut")

    def resume_partials(self) -> int:
        """Resubmit every cached partial rollout under the current policy; returns how many."""
        tracks, self._partials = self._partials, []
        by_replica: dict[int, list[Track]] = {}
        for t in tracks:
            r = self._least_loaded()
            t.replica = r
            self._replicas[r].active.add(t.key)
            by_replica.setdefault(r, []).append(t)
        for r, ts in by_replica.items():
            self._send_round(r, ts)
        return len(tracks)

    # ------------------------------------------------------------------ weights (megarl/generator/weight_updates.py)
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, replicas: Sequence[int] | None = None) -> float:
        """Load full HF tensors into every engine (``replicas``: only those) as policy ``version``
        (default: the next one); the seconds it took (:meth:`WeightUpdater.update_weights`)."""
        with self._weight_update():
            return self._weights.update_weights(named_tensors, version, replicas=replicas)

    def update_weights_from_source(self, source: dict, version: int, *,
                                   peer_check: Callable[[], None] | None = None,
                                   replicas: Sequence[int] | None = None) -> float:
        """Load weights ``version`` from a prepared source (e.g. ``SyncSpec.weight_source``); the
        seconds it took (:meth:`WeightUpdater.update_weights_from_source`)."""
        with self._weight_update():
            return self._weights.update_weights_from_source(source, version, peer_check=peer_check,
                                                            replicas=replicas)

    def inspect_weight(self, vllm_param_name: str, replica: int = 0) -> list[torch.Tensor]:
        """A parameter as every TP rank of ``replica`` holds it (:meth:`WeightUpdater.inspect_weight`)."""
        return self._weights.inspect_weight(vllm_param_name, replica)

    def landed_weights(self, replica: int = 0) -> list[dict[str, torch.Tensor]]:
        """What the last capturing update landed, per TP rank of ``replica``
        (:meth:`WeightUpdater.landed_weights`)."""
        return self._weights.landed_weights(replica)

    def _quiesce_for_update(self) -> None:
        """Before the replicas load new weights: in deterministic mode every round runs under the
        weights it was submitted with, so the rounds in flight finish first."""
        if self.deterministic and self._tracks:
            self.drain()

    def _adopt_version(self, version: int) -> None:
        """Every replica loaded weights ``version``: it is the policy now; cached partial rollouts
        resume under it."""
        self.version = version
        if self._partials:
            self.resume_partials()

    @property
    def num_outstanding(self) -> int:
        """Samples submitted but not yet collectable (in flight or cached partials)."""
        return len(self._tracks) + len(self._partials)

    def snapshot(self, groups: set[int]) -> list[dict]:
        """The unfinished samples of ``groups`` as plain dicts (for the controller's checkpoint):
        prompt, sampling, and the tokens / logprobs / versions of every round finished so far (a
        round still running in an engine is not included: it is generated again on restore;
        ``in_flight`` says which had one)."""
        self._pump(0.0)
        running = {id(t) for t in self._tracks.values()}
        tracks = {id(t): t for t in [*self._tracks.values(), *self._partials] if t.group_id in groups}
        return [{**{f.name: getattr(t, f.name) for f in dataclasses.fields(Track) if f.name not in ("key", "replica")},
                 "in_flight": id(t) in running} for t in tracks.values()]

    def restore(self, tracks: Sequence[dict], groups: Sequence[int] = ()) -> dict[int, int]:
        """Continue samples from :meth:`snapshot` (possibly of an earlier process) under the current
        weights; returns ``{old group id: new group id}`` for every group of ``tracks`` and
        ``groups`` (this executor numbers its own groups, so old ids never collide with new ones).
        In deterministic mode only the samples that had a round in flight are sent now; the cut
        partials wait, cached, for the next update (or a stall), as they did in the saving run."""
        self._check_failed()
        new_ids = {int(g): next(self._group_ids) for g in dict.fromkeys([*groups, *(d["group_id"] for d in tracks)])}
        by_replica: dict[int, list[Track]] = {}
        for d in tracks:
            old = int(d["group_id"])
            d = dict(d)
            in_flight = d.pop("in_flight", None)  # None: a checkpoint from before the flag
            if in_flight and d.get("rounds"):
                d["rounds"] -= 1  # the round lost with the old process is generated again, not counted twice
            t = Track(key=f"g{new_ids[old]}s{d['sample_index']}", **{**d, "group_id": new_ids[old]})
            if self.deterministic and in_flight is False:
                self._partials.append(t)
                continue
            t.replica = self._least_loaded()
            self._replicas[t.replica].active.add(t.key)
            by_replica.setdefault(t.replica, []).append(t)
        for r, ts in by_replica.items():
            self._send_round(r, ts)
        return new_ids

    def activity(self) -> dict[str, float]:
        """Seconds each replica spent, since it started, decoding (``busy_s``: inside engine steps)
        and loading weights (``load_s``), averaged over replicas; as fresh as the last message read
        from them. The controller turns differences per step into busy/idle seconds."""
        self._pump(0.0)
        n = max(len(self._replicas), 1)
        return {k: sum(float(h.info.get(k, 0.0)) for h in self._replicas) / n for k in ("busy_s", "load_s")}

    @property
    def num_partial(self) -> int:
        return len(self._partials)

    def health(self, timeout_s: float = 30.0) -> list[dict]:
        """Ask every replica for its state (pid, version, pending, steps, tokens); raises if one
        is dead or does not answer within ``timeout_s`` (it answers between decode steps)."""
        self._check_failed()
        tokens = []
        for h in self._replicas:
            token = ("health", next(self._round_ids))
            self._replies[token] = None
            tokens.append(token)
            self._send(h, ("health", token))
        self._wait(lambda: all(self._replies[t] is not None for t in tokens), timeout_s,
                   "health replies from the generator replicas", progress_resets=False)
        return [self._replies.pop(t) for t in tokens]

    @property
    def pids(self) -> list[int]:
        return [h.process.pid for h in self._replicas]

    # ------------------------------------------------------------------ internals
    def _least_loaded(self) -> int:
        return min(range(len(self._replicas)), key=lambda r: len(self._replicas[r].active))

    def _send_round(self, replica: int, tracks: list[Track]) -> None:
        h = self._replicas[replica]
        if not any(rid in self._tracks for rid in h.active):
            h.last_heard = time.monotonic()  # idle until now: its frozen clock starts with this work
        specs = []
        for t in tracks:
            remaining = t.max_new_tokens - len(t.ids)
            room = self.cfg.max_model_len - len(t.prompt_ids) - len(t.ids)
            limit = min(remaining, room)
            if t.round_budget > 0:
                limit = min(limit, t.round_budget)
            rid = f"{t.key}r{t.rounds}"
            t.rounds += 1
            self._tracks[rid] = t
            self._replicas[replica].active.add(rid)
            spec = {"rid": rid, "prompt_ids": t.prompt_ids + t.ids, "max_tokens": limit, "sampling": t.sampling}
            if self.deterministic:
                spec["seed"] = request_seed(self.cfg.seed, t)
            specs.append(spec)
            self._replicas[replica].active.discard(t.key)
        self._send(self._replicas[replica], ("submit", specs))

    def _send(self, h: ReplicaHandle, msg: tuple) -> None:
        """A command to one replica; a closed pipe means it died, one it does not read while silent for
        heartbeat_timeout_s that it hangs: it is replaced, or the job stops naming it and how."""
        try:
            sent = self._group.send(h, msg, stall_s=self.cfg.heartbeat_timeout_s)
        except Stalled as e:
            self._fail(h, f"{e} (generator.heartbeat_timeout_s={self.cfg.heartbeat_timeout_s:.0f})")
            self._check_failed()
            return
        if not sent:
            self._fail(h, self._exit_cause(h))
            self._check_failed()

    def _pump(self, timeout: float) -> bool:
        """Handle inbox messages (waiting up to ``timeout`` for the first); True if any arrived."""
        got = False
        while (item := self._group.get(timeout if not got else 0.0)) is not None:
            got = True
            self._handle(*item)
        return got

    def _handle(self, h: ReplicaHandle, msg: tuple) -> None:
        if not self._group.current(h):  # a replaced (failed) replica's late messages are dropped
            return
        kind = msg[0]
        if kind == "ready":
            h.info = msg[1]
        elif kind == "progress":  # a heartbeat while decoding: resets the no-progress clock
            h.info.update(msg[1])
        elif kind == "done":
            for res in msg[1]:
                self._finish(h, res)
            if len(msg) > 2:  # the replica's busy/load counters as of these results
                h.info.update(msg[2])
        elif kind == "updated":
            if len(msg) > 3:  # the replica's busy/load counters with this load in them
                h.info.update(msg[3])
            acked = self._replies.get(("updated", msg[1]))
            if acked is not None:
                acked.add(h.index)
        elif kind in ("health", "rpc"):
            if msg[1] in self._replies:
                self._replies[msg[1]] = msg[2]
        elif kind == "error":
            last = exception_line(msg[1]) or (msg[1].strip().splitlines()[-1] if msg[1].strip() else "unknown error")
            self._fail(h, f"raised {last}\n{msg[1]}", tb=msg[1])
        elif kind == "eof":
            if not self._closing:
                self._fail(h, self._exit_cause(h))

    def _finish(self, h: ReplicaHandle, res: dict) -> None:
        rid = res["rid"]
        h.active.discard(rid)
        t = self._tracks.pop(rid, None)
        if t is None:
            return
        t.ids.extend(res["ids"])
        t.lps.extend(res["lps"])
        t.vers.extend(res["vers"])
        if res.get("experts") is not None:  # an MoE model: this round's routing of prompt + tokens so far
            t.experts = merge_rounds(t.experts, res["experts"], len(t.prompt_ids) + len(t.ids))
        reason = res["finish_reason"]
        cut = (reason == "length" and t.round_budget > 0
               and len(t.ids) < t.max_new_tokens
               and len(t.prompt_ids) + len(t.ids) < self.cfg.max_model_len)
        if cut:
            self._partials.append(t)
        else:
            self._done.append(t.sample(reason, res["stop_reason"]))

    def _exit_cause(self, h: ReplicaHandle) -> str:
        h.process.join(2.0)
        return member_cause(h)

    def _wait(self, done, timeout: float, what: str, progress_resets: bool = True,
              also_check: Callable[[], None] | None = None) -> None:
        """Pump messages until ``done()``; raise on a dead replica, when ``also_check()`` raises, or
        after ``timeout`` seconds (without any message arriving, when ``progress_resets``)."""
        from megarl.utils.procs import raise_if_preempted

        def check() -> None:
            raise_if_preempted()  # a preemption abandons this wait (not inside a deferred sync or save)
            self._check_failed()
            if also_check is not None:
                also_check()

        def on_timeout() -> GeneratorTimeout:
            exc = GeneratorTimeout(f"generator: timed out after {timeout:.0f}s waiting for {what}; "
                                   f"replica logs in {self._log_dir}")
            exc.component = "generator replica(s) " + ", ".join(
                f"{h.index} (pid {h.process.pid})" for h in self._replicas)
            exc.log_path = str(self._log_dir)
            return exc

        self._group.wait(done, timeout, what, self._handle, check=check, on_timeout=on_timeout,
                         progress_resets=progress_resets, quiet=True)
