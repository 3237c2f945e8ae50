"""RewardPool: scores a batch of replies: final-answer correctness, truncation, overlong shaping.

The ``math`` reward runs math-verify (sympy), which can take seconds or hang on a pathological
reply and enforces its own timeouts with ``signal.alarm``, which only works in a process's main
thread. So it (and any ``module:function`` reward, whose cost is unknown) runs in scoring
processes: each calls it from its main thread, one sample at a time, and the pool cuts a sample
that runs past ``reward.timeout_s`` (counted from the moment that process got it): the process is
killed and replaced, the sample scores ``reward.wrong`` and is counted (``reward/timeouts``), and
the batch goes on. A reward that raises scores ``reward.wrong`` and is counted (``reward/errors``);
more than ``reward.max_error_frac`` of a batch's scored samples raising stops the job with
:class:`RewardError` carrying the first traceback. A scoring process that dies (killed from
outside, or crashed) is replaced and counted (``reward/worker_deaths``); the sample it held is scored
again once on a fresh process (dying on it twice scores it as an error), so the batch goes on.
The scoring processes are a process group (megarl/executors/group.py: spawn, pipes, reader
threads, kill). ``arithmetic`` and ``gsm8k`` are a few linear-time regexes over the reply: they run in the calling
process, since shipping a batch to workers would cost more than scoring it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import time
import traceback
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

from megarl.executors.base import ExecutorBase, ProcessDied, exit_cause
from megarl.executors.group import Member, ProcessGroup
from megarl.reward.config import RewardConfig
from megarl.reward.registry import get_reward, reward_meta
from megarl.utils.procs import spawned_from_main_thread, watch_parent

if TYPE_CHECKING:
    from megarl.rollout import Sample

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a scoring process must import megarl.reward and the reward within this (s)
KILL_JOIN_S = 5.0        # wait for a killed scoring process to be reaped (s)
MAX_START_DEATHS = 3     # scoring processes that may die before they are ready, per batch


class RewardError(RuntimeError):
    """The reward function failed on too much of a batch (more than ``reward.max_error_frac``), or
    could not be loaded in a scoring process; the message carries the first traceback."""


@dataclasses.dataclass(frozen=True)
class ScoredSample:
    """One reply's score. ``correct``: its final answer is right (False when truncated);
    ``formatted``: an answer could be extracted in the configured format (False when truncated);
    ``truncated``: it hit max_new_tokens (finish reason 'length')."""

    reward: float
    correct: bool
    formatted: bool
    truncated: bool


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """What scoring one reply gave: ``status`` 'ok', 'error' (the function raised; ``detail`` is
    the traceback) or 'timeout' (cut at reward.timeout_s)."""

    ok: bool
    status: str = "ok"
    detail: str = ""


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_new_tokens - buffer`` tokens, then rising
    linearly to ``penalty`` at ``max_new_tokens`` (capped there); 0 when ``buffer`` is 0."""
    if buffer <= 0:
        return 0.0
    over = length - (max_new_tokens - buffer)
    return penalty * min(max(over, 0), buffer) / buffer


class RewardPool(ExecutorBase):
    """Scores (completion, gold) pairs with the reward ``cfg.fn``; see docs/rewards.md. An executor
    (megarl/executors/base.py): ``start`` spawns the scoring processes (none for in-process rewards),
    ``health``/``pids`` report them, ``close`` kills them.

    ``max_new_tokens`` is the generator's completion limit (tokens), the end of the overlong ramp.
    ``last_counts``: the timeouts and errors of the last batch (what :meth:`score` returns).
    """

    def __init__(self, cfg: RewardConfig, max_new_tokens: int):
        problems = cfg.problems(max_new_tokens=max_new_tokens)
        if problems:
            raise ValueError("; ".join(problems))
        self.cfg, self.max_new_tokens = cfg, max_new_tokens
        self.fn = get_reward(cfg.fn_name())  # resolved now: a bad import path fails before any generation
        meta = reward_meta(self.fn)
        self._extract: Optional[Callable] = meta["extract"]
        self.in_process: bool = bool(meta["in_process"])
        self._group = ProcessGroup("reward")  # the scoring processes, their pipes and reader threads
        self.last_counts: Dict[str, float] = {"reward/timeouts": 0, "reward/errors": 0, "reward/worker_deaths": 0}
        self._deaths = 0  # scoring processes found dead during the current batch

    def start(self) -> "RewardPool":
        if not self.in_process:
            self._ensure_pool()
        return self

    @property
    def pids(self) -> list[int]:
        return self._group.pids

    @property
    def _workers(self) -> List["_Worker"]:
        return self._group.members

    def health(self) -> list[dict]:
        """One dict per scoring process (pid, alive); raises :class:`ProcessDied` naming a worker
        that has exited. The pool is then restarted, so the next :meth:`score` runs on fresh
        workers instead of failing on the broken pool."""
        procs = self._processes()
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            self.close()
            raise ProcessDied(f"reward: scoring process pid {dead[0].pid} {exit_cause(dead[0].exitcode)} "
                              f"({len(dead)} of {len(procs)} dead); the pool restarts at the next score")
        return [{"pid": p.pid, "alive": True} for p in procs]

    def _processes(self) -> list:
        """The pool's worker processes (none for an in-process reward or a closed pool)."""
        return [w.process for w in self._workers]

    @property
    def correct(self) -> float:
        return self.cfg.correct

    @property
    def truncated_score(self) -> float:
        return self.cfg.wrong if self.cfg.truncated is None else self.cfg.truncated

    def score(self, samples: Sequence[Sample], answers: Sequence[str],
              decode: Callable[[Sequence[int]], str]) -> Dict[str, float]:
        """Set every sample's ``reward``, ``correct`` and ``formatted`` (the ``RewardScorer`` call).
        ``answers[i]``: the gold answer of prompt ``i``; ``decode``: completion token ids to text.
        Returns the batch's ``reward/timeouts`` and ``reward/errors`` counts (samples) and
        ``reward/worker_deaths`` (scoring processes that died and were replaced)."""
        scored = self.score_texts([decode(s.completion_ids) for s in samples],
                                  [answers[s.prompt_index] for s in samples],
                                  [s.finish_reason for s in samples], [len(s.completion_ids) for s in samples])
        for s, r in zip(samples, scored):
            s.reward, s.correct, s.formatted = r.reward, r.correct, r.formatted
        return dict(self.last_counts)

    def score_texts(self, completions: Sequence[str], golds: Sequence[str], finish_reasons: Sequence[Optional[str]],
                    lengths: Sequence[int]) -> List[ScoredSample]:
        """One :class:`ScoredSample` per reply, from text (what :meth:`score` does for samples).
        ``finish_reasons``: the generator's ('stop', 'length', ...); ``lengths``: completion
        lengths (tokens). Raises :class:`RewardError` when more than reward.max_error_frac of the
        scored replies raised in the reward function."""
        n = len(completions)
        for name, seq in (("gold answers", golds), ("finish reasons", finish_reasons), ("lengths", lengths)):
            if len(seq) != n:
                raise ValueError(f"{n} completions but {len(seq)} {name}")
        cfg = self.cfg
        truncated = [reason == "length" for reason in finish_reasons]
        finished = [i for i in range(n) if not truncated[i]]
        self._deaths = 0
        verdicts = self._judge([completions[i] for i in finished], [golds[i] for i in finished])
        self._account(verdicts)
        correct = {i: v.ok for i, v in zip(finished, verdicts)}
        out = []
        for i in range(n):
            if truncated[i]:
                out.append(ScoredSample(self.truncated_score, False, False, True))
                continue
            ok = correct[i]
            formatted = ok if self._extract is None else self._formatted(completions[i])
            reward = (cfg.correct if ok else cfg.wrong) - overlong_penalty(
                lengths[i], self.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            out.append(ScoredSample(reward, ok, bool(formatted), False))
        return out

    def _formatted(self, completion: str) -> bool:
        try:
            return self._extract(completion, strict=self.cfg.strict) is not None  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - an extractor that raises: the reply is not formatted
            return False

    def _account(self, verdicts: List[_Verdict]) -> None:
        """Count the batch's timeouts and errors; too many errors stop the job (RewardError)."""
        timeouts = sum(v.status == "timeout" for v in verdicts)
        errors = [v for v in verdicts if v.status == "error"]
        self.last_counts = {"reward/timeouts": timeouts, "reward/errors": len(errors),
                            "reward/worker_deaths": self._deaths}
        if not (timeouts or errors):
            return
        first = errors[0].detail.strip().splitlines()[-1] if errors else ""
        log.warning("reward: %d of %d sample(s) timed out after %.1fs and %d raised in %s (first: %s); "
                    "scored %s and counted", timeouts, len(verdicts), self.cfg.timeout_s, len(errors), self.cfg.fn,
                    first or "-", self.cfg.wrong)
        if len(errors) > self.cfg.max_error_frac * len(verdicts):
            raise self._error(f"reward: {len(errors)} of {len(verdicts)} sample(s) of the batch raised in reward.fn="
                              f"{self.cfg.fn!r}, more than reward.max_error_frac={self.cfg.max_error_frac}; fix the "
                              f"reward function. The first traceback:\n{errors[0].detail.rstrip()}")

    def _error(self, message: str, pids: Optional[List[int]] = None) -> RewardError:
        """A :class:`RewardError` naming where the reward ran: the scoring processes (``pids``: the
        one at fault, else every one) or, for an in-process reward, the controller."""
        exc = RewardError(message)
        pids = pids if pids is not None else self.pids
        if not self.in_process and pids:
            exc.component = (f"reward scoring process{'es' if len(pids) > 1 else ''} (pid "
                             f"{', '.join(map(str, pids))} on {socket.gethostname()}) of reward.fn={self.cfg.fn!r}")
        return exc

    def _judge(self, completions: List[str], golds: List[str]) -> List[_Verdict]:
        if not completions:
            return []
        if self.in_process:
            return [_safe_call(self.fn, c, g, self.cfg.strict) for c, g in zip(completions, golds)]
        return self._judge_in_pool(completions, golds)

    def _judge_in_pool(self, completions: List[str], golds: List[str]) -> List[_Verdict]:
        """One sample per scoring process at a time, each cut at timeout_s from when its process got
        it; a cut or dead process is replaced. Every wait is bounded."""
        workers = self._ensure_pool()
        timeout = self.cfg.timeout_s
        pending = collections.deque(range(len(completions)))
        out: List[Optional[_Verdict]] = [None] * len(completions)
        retried: set[int] = set()
        early_deaths = 0
        while pending or any(w.task is not None for w in workers):
            now = time.monotonic()
            for w in workers:
                if w.ready and w.task is None and not w.broken and pending:
                    i = pending.popleft()
                    if not w.give(i, completions[i], golds[i], self.cfg.strict):
                        pending.appendleft(i)  # it died idle: its EOF (below) replaces it
            due = [w.given + timeout for w in workers if w.task is not None] + \
                  [w.spawned + START_TIMEOUT_S for w in workers if not w.ready]
            got = self._group.get(max(0.0, min(due) - now) if due else START_TIMEOUT_S)
            arrived = [got] if got is not None and self._group.current(got[0]) else []  # a replaced one's EOF: dropped
            for w, msg in arrived:
                if msg == ("eof",):  # the process died (killed from outside, or crashed)
                    if not w.ready:
                        early_deaths += 1
                        if early_deaths > MAX_START_DEATHS:
                            cause = exit_cause(_reap(w.process))
                            exc = self._error(f"reward: scoring processes for reward.fn={self.cfg.fn!r} die while "
                                              f"starting ({early_deaths} times; the last {cause}); see its import",
                                              pids=[w.process.pid])
                            self.close()
                            raise exc
                    if w.task is not None:
                        if w.task in retried:
                            out[w.task] = _Verdict(False, "error", f"the scoring process pid {w.process.pid} "
                                                   f"{exit_cause(w.process.exitcode)} twice on this sample")
                        else:  # once more on a fresh process: a kill from outside loses nothing
                            retried.add(w.task)
                            pending.appendleft(w.task)
                    self._deaths += 1
                    log.warning("reward: scoring process pid %d %s%s; starting another (reward/worker_deaths)",
                                w.process.pid, exit_cause(_reap(w.process)),
                                " while scoring a sample, which is scored again" if w.task is not None else "")
                    self._replace(w)
                    continue
                if msg[0] == "ready":
                    w.ready = True
                elif msg[0] == "init_error":
                    exc = self._error(f"reward: reward.fn={self.cfg.fn!r} could not be loaded in a scoring "
                                      f"process:\n{msg[1].rstrip()}", pids=[w.process.pid])
                    self.close()
                    raise exc
                else:
                    i, status, value = msg
                    out[i] = _Verdict(bool(value), "ok") if status == "ok" else _Verdict(False, "error", value)
                    w.task = None
            now = time.monotonic()
            for w in list(workers):
                if w.task is not None and now - w.given >= timeout:
                    out[w.task] = _Verdict(False, "timeout")
                    log.warning("reward: sample cut after %.1fs (reward.timeout_s); scoring process pid %d "
                                "killed and replaced", timeout, w.process.pid)
                    self._replace(w)
                elif not w.ready and now - w.spawned >= START_TIMEOUT_S:
                    pid = w.process.pid
                    self.close()
                    raise ProcessDied(f"reward: scoring process pid {pid} did not start within "
                                      f"{START_TIMEOUT_S:.0f}s")
        return [v if v is not None else _Verdict(False, "error", "not scored") for v in out]

    def _spawn(self, index: int) -> "_Worker":
        """Start scoring process ``index`` (in place of a cut or dead one). Started from this thread;
        each watches this process and dies with it (megarl.utils.procs.watch_parent), so no scorer
        outlives the job."""
        return self._group.spawn(index, _worker_main, (self.cfg.fn_name(), self.cfg.timeout_s, os.getpid(),
                                                       spawned_from_main_thread(), _sandbox_knobs(self.cfg)),
                                 name="megarl-reward", daemon=True, make=_Worker)

    def _replace(self, w: "_Worker") -> "_Worker":
        """Kill ``w`` and start another in its place (in ``self._workers``, the list being iterated)."""
        self._group.kill(w)
        return self._spawn(w.index)

    def _ensure_pool(self) -> List["_Worker"]:
        if not self._workers:
            for i in range(self.cfg.workers):
                self._spawn(i)
        return self._workers

    def close(self) -> None:
        self._group.discard()  # killed: a stuck sympy call ignores a polite request


class _Worker(Member):
    """One scoring process of the pool's group; ``task``: the sample index it is scoring, if any."""

    def __init__(self, index: int, process, conn, log_path=None):
        super().__init__(index, process, conn, log_path)
        self.spawned, self.given = time.monotonic(), 0.0
        self.ready = False
        self.broken = False  # its pipe refused a sample: it died while idle, its EOF is on its way
        self.task: Optional[int] = None

    def give(self, i: int, completion: str, gold: str, strict: bool) -> bool:
        """Send sample ``i``; False when the process is gone (e.g. OOM-killed between batches)."""
        try:
            self.conn.send((i, completion, gold, strict))
        except OSError:  # BrokenPipeError, ConnectionResetError: the pipe's reader exited
            self.broken = True
            return False
        self.task, self.given = i, time.monotonic()
        return True


def _reap(proc) -> Optional[int]:
    proc.join(KILL_JOIN_S)
    return proc.exitcode


def _safe_call(fn: Callable, completion: str, gold: str, strict: bool) -> _Verdict:
    try:
        return _Verdict(bool(fn(completion, gold, strict=strict)))
    except Exception:  # noqa: BLE001 - counted; too many in a batch stop the job (RewardPool._account)
        return _Verdict(False, "error", traceback.format_exc())


def _sandbox_knobs(cfg) -> dict:
    """The code sandbox's knobs, for sandbox.configure in each scoring process."""
    return {"allow_weaker": list(cfg.code_sandbox_allow_weaker), "uid_base": cfg.code_sandbox_uid_base}


def _init_worker(timeout_s: float, parent_pid: Optional[int] = None, pdeathsig: bool = True,
                 sandbox_knobs: Optional[dict] = None) -> None:
    watch_parent(parent_pid, pdeathsig=pdeathsig)  # first: a worker dies with the job's controller
    from megarl.reward import rewards, sandbox

    rewards.MATH_TIMEOUT_S = max(1, int(timeout_s))
    # The code sandbox's run ends (and sweeps its processes) before the pool would kill this worker.
    sandbox.WALL_TIMEOUT_S = max(0.5, 0.8 * timeout_s - 0.5)
    if sandbox_knobs is not None:
        sandbox.configure(**sandbox_knobs)


def _worker_main(conn, spec: str, timeout_s: float, parent_pid: Optional[int], pdeathsig: bool,
                 sandbox_knobs: Optional[dict] = None) -> None:
    """A scoring process: load the reward, say ready, then score one (index, completion, gold,
    strict) at a time from its main thread (math-verify's signal.alarm needs it) until EOF."""
    _init_worker(timeout_s, parent_pid, pdeathsig, sandbox_knobs)
    try:
        fn = get_reward(spec)
        prepare = reward_meta(fn).get("prepare")
        if prepare is not None:
            prepare()  # e.g. the code sandbox's machine check: refused at start, not on a sample
    except BaseException:  # noqa: BLE001 - reported to the pool, which stops the job with it
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            i, completion, gold, strict = conn.recv()
        except (EOFError, OSError):
            return
        v = _safe_call(fn, completion, gold, strict)
        conn.send((i, v.status, v.ok if v.status == "ok" else v.detail))
