"""RewardPool: scores a batch of replies: final-answer correctness, truncation, overlong shaping.

The ``math`` reward runs math-verify (sympy), which can take seconds or hang on a pathological
reply and enforces its own timeouts with ``signal.alarm``, which only works in a process's main
thread. So it (and any ``module:function`` reward, whose cost is unknown) runs in a process pool:
each worker calls it from its main thread, and the pool adds an outer wall-clock deadline so a stuck
sample scores as wrong instead of stalling the RL loop (the pool is then killed and restarted).
``arithmetic`` and ``gsm8k`` are a few linear-time regexes over the reply: they run in the calling
process, since shipping a batch to workers would cost more than scoring it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

from megarl.executors.base import ExecutorBase, ProcessDied, exit_cause
from megarl.reward.config import RewardConfig
from megarl.reward.registry import get_reward, reward_meta
from megarl.utils.procs import spawned_from_main_thread, watch_parent

if TYPE_CHECKING:
    from megarl.rollout import Sample

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScoredSample:
    """One reply's score. ``correct``: its final answer is right (False when truncated);
    ``formatted``: an answer could be extracted in the configured format (False when truncated);
    ``truncated``: it hit max_new_tokens (finish reason 'length')."""

    reward: float
    correct: bool
    formatted: bool
    truncated: bool


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
    """

    def __init__(self, cfg: RewardConfig, max_new_tokens: int):
        problems = cfg.problems(max_new_tokens=max_new_tokens)
        if problems:
            raise ValueError("; ".join(problems))
        self.cfg, self.max_new_tokens = cfg, max_new_tokens
        self.fn = get_reward(cfg.fn)  # resolved now: a bad import path fails before any generation
        meta = reward_meta(self.fn)
        self._extract: Optional[Callable] = meta["extract"]
        self.in_process: bool = bool(meta["in_process"])
        self._pool: Optional[ProcessPoolExecutor] = None

    def start(self) -> "RewardPool":
        if not self.in_process:
            self._ensure_pool()
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes()]

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
        return list((getattr(self._pool, "_processes", None) or {}).values()) if self._pool else []

    @property
    def correct(self) -> float:
        return self.cfg.correct

    @property
    def truncated_score(self) -> float:
        return self.cfg.wrong if self.cfg.truncated is None else self.cfg.truncated

    def score(self, samples: Sequence[Sample], answers: Sequence[str],
              decode: Callable[[Sequence[int]], str]) -> None:
        """Set every sample's ``reward``, ``correct`` and ``formatted`` (the ``RewardScorer`` call).
        ``answers[i]``: the gold answer of prompt ``i``; ``decode``: completion token ids to text."""
        scored = self.score_texts([decode(s.completion_ids) for s in samples],
                                  [answers[s.prompt_index] for s in samples],
                                  [s.finish_reason for s in samples], [len(s.completion_ids) for s in samples])
        for s, r in zip(samples, scored):
            s.reward, s.correct, s.formatted = r.reward, r.correct, r.formatted

    def score_texts(self, completions: Sequence[str], golds: Sequence[str], finish_reasons: Sequence[Optional[str]],
                    lengths: Sequence[int]) -> List[ScoredSample]:
        """One :class:`ScoredSample` per reply, from text (what :meth:`score` does for samples).
        ``finish_reasons``: the generator's ('stop', 'length', ...); ``lengths``: completion
        lengths (tokens)."""
        n = len(completions)
        for name, seq in (("gold answers", golds), ("finish reasons", finish_reasons), ("lengths", lengths)):
            if len(seq) != n:
                raise ValueError(f"{n} completions but {len(seq)} {name}")
        cfg = self.cfg
        truncated = [reason == "length" for reason in finish_reasons]
        finished = [i for i in range(n) if not truncated[i]]
        verdicts = self._judge([completions[i] for i in finished], [golds[i] for i in finished])
        correct = dict(zip(finished, verdicts))
        out = []
        for i in range(n):
            if truncated[i]:
                out.append(ScoredSample(self.truncated_score, False, False, True))
                continue
            ok = correct[i]
            formatted = ok if self._extract is None else self._extract(completions[i], strict=cfg.strict) is not None
            reward = (cfg.correct if ok else cfg.wrong) - overlong_penalty(
                lengths[i], self.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            out.append(ScoredSample(reward, ok, bool(formatted), False))
        return out

    def _judge(self, completions: List[str], golds: List[str]) -> List[bool]:
        if not completions:
            return []
        if self.in_process:
            return [_safe_call(self.fn, c, g, self.cfg.strict) for c, g in zip(completions, golds)]
        pool = self._ensure_pool()
        futures = [pool.submit(_worker_score, self.cfg.fn, c, g, self.cfg.strict) for c, g in zip(completions, golds)]
        verdicts, timed_out, failed = [], 0, 0
        # Outer deadline: all samples in parallel, each allowed timeout_s, plus pool start-up slack.
        deadline = time.monotonic() + self.cfg.timeout_s * (1 + len(futures) / self.cfg.workers) + 30.0
        for fut in futures:
            try:
                ok = bool(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                ok, timed_out = False, timed_out + 1
            except Exception:  # a broken pool (a worker died); the sample scores as wrong
                ok, failed = False, failed + 1
            verdicts.append(ok)
        if timed_out or failed:
            log.warning("reward: %d sample(s) timed out after %.1fs and %d failed, scored as wrong; "
                        "restarting the pool", timed_out, self.cfg.timeout_s, failed)
            self.close()
        return verdicts

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # Workers are spawned by submit() in this thread; each watches this process and dies
            # with it (megarl.utils.procs.watch_parent), so no scorer outlives the job.
            self._pool = ProcessPoolExecutor(self.cfg.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init_worker,
                                             initargs=(self.cfg.timeout_s, os.getpid(), spawned_from_main_thread()))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            procs = self._processes()
            self._pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.kill()  # a stuck sympy call ignores shutdown
            self._pool = None



def _safe_call(fn: Callable, completion: str, gold: str, strict: bool) -> bool:
    try:
        return bool(fn(completion, gold, strict=strict))
    except Exception:  # a reward that raises on odd input must not stop training: the sample is wrong
        log.warning("reward: %s raised on a sample; scored as wrong", getattr(fn, "__qualname__", fn),
                    exc_info=True)
        return False


_WORKER_FNS: Dict[str, Callable] = {}


def _init_worker(timeout_s: float, parent_pid: Optional[int] = None, pdeathsig: bool = True) -> None:
    watch_parent(parent_pid, pdeathsig=pdeathsig)  # first: a worker dies with the job's controller
    from megarl.reward import rewards

    rewards.MATH_TIMEOUT_S = max(1, int(timeout_s))


def _worker_score(spec: str, completion: str, gold: str, strict: bool) -> bool:
    fn = _WORKER_FNS.get(spec)
    if fn is None:
        fn = _WORKER_FNS[spec] = get_reward(spec)
    return _safe_call(fn, completion, gold, strict)
