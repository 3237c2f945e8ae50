"""``megarl reward check --fn NAME --cases FILE.jsonl``: score given replies before training on a reward.

Each case is a task row of the reward's data schema (megarl/data/schemas.py: GSM8K's question +
answer, MATH's problem + solution, a code row's prompt + test + entry_point, ...) plus a ``reply``
string. One JSON object per case is printed, in order: ``case`` (1-based), ``where`` (file:line),
``score`` (reward units: reward.correct / reward.wrong), ``correct`` and ``reason``.
"""

from __future__ import annotations

import json
from typing import Iterator, TextIO

from megarl.data.schemas import detect
from megarl.data.sources import DataError, iter_rows
from megarl.data.tasks import parse_row
from megarl.reward.environment import get_environment


def check_cases(fn: str, cases: str, *, strict: bool = False) -> Iterator[dict]:
    """One verdict per case of ``cases`` (a JSON-lines file), scored by ``fn`` (a reward or environment)."""
    env = get_environment(fn, strict=strict)
    if not callable(getattr(env, "score_text", None)):  # a multi-step environment answers turn by turn
        raise ValueError(f"--fn {fn!r} is a multi-turn environment: it answers each reply with an observation, "
                         f"so one reply per case has no verdict; check a reward (--fn arithmetic, gsm8k, math, "
                         f"dapo, code, or package.module:function), or drive the environment with "
                         f"megarl.controller.turns.multi_turn (docs/environments.md)")
    schema, n = None, 0
    for n, (where, row) in enumerate(iter_rows(cases), 1):
        reply = row.get("reply")
        if not isinstance(reply, str):
            raise DataError(f"{where}: no 'reply' string; each case is a task row plus the reply to score")
        schema = schema or detect(row)
        if schema is None:
            raise DataError(f"{where}: no known row schema (keys here: {sorted(row)[:8]}); give a task row of "
                            f"{fn!r}'s data (e.g. question + answer, or prompt + test + entry_point) plus 'reply'")
        task = parse_row(row, schema, where)
        step = env.score_text(env.reset(task), reply)
        yield {"case": n, "where": where, "score": step.reward, "correct": bool(step.info.get("correct")),
               "reason": step.info.get("reason", "")}
    if n == 0:
        raise DataError(f"{cases}: no cases (each line is a task row plus the 'reply' to score)")


def print_checks(fn: str, cases: str, out: TextIO, *, strict: bool = False) -> int:
    """Print each case's verdict as one JSON line; returns the number of cases."""
    n = 0
    for verdict in check_cases(fn, cases, strict=strict):
        out.write(json.dumps(verdict) + "\n")
        out.flush()
        n += 1
    return n
