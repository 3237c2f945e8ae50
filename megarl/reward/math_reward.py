"""Math-verify rewards in a process pool with a per-sample timeout.

math-verify enforces its own timeouts with ``signal.alarm``, which only works in a process's main
thread: each pool worker calls it from its main thread, and the pool adds an outer wall-clock
timeout so a pathological sample scores as wrong instead of stalling the RL loop.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

log = logging.getLogger(__name__)


def score_one(completion: str, gold: str, timeout_s: int = 5) -> bool:
    """True when the completion's final answer is mathematically equal to ``gold``."""
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=timeout_s)
    pred = parse(completion, parsing_timeout=timeout_s)
    if not gold_parsed or not pred:
        return False
    return bool(verify(gold_parsed, pred, timeout_seconds=timeout_s))


class MathReward:
    """Scores (completion, gold) pairs: ``correct`` when verified, ``wrong`` otherwise (incl. timeouts)."""

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, correct: float = 1.0, wrong: float = 0.0):
        self.workers, self.timeout_s = workers, timeout_s
        self.correct, self.wrong = correct, wrong
        self._pool: ProcessPoolExecutor | None = None

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
        return self._pool

    def score(self, completions: list[str], golds: list[str]) -> list[float]:
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        pool = self._ensure_pool()
        inner = max(1, int(self.timeout_s))
        futures = [pool.submit(score_one, c, g, inner) for c, g in zip(completions, golds)]
        rewards, timed_out = [], 0
        # Outer deadline: all samples in parallel, each allowed timeout_s plus pool start-up slack.
        deadline = time.monotonic() + self.timeout_s * (1 + len(futures) / self.workers) + 30.0
        for fut in futures:
            try:
                ok = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                ok, timed_out = False, timed_out + 1
            rewards.append(self.correct if ok else self.wrong)
        if timed_out:
            log.warning("reward: %d sample(s) timed out after %.1fs and scored as wrong; restarting the pool",
                        timed_out, self.timeout_s)
            self.close()
        return rewards

    def close(self) -> None:
        if self._pool is not None:
            procs = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.kill()  # a stuck sympy call ignores shutdown
            self._pool = None

    def __enter__(self) -> "MathReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
