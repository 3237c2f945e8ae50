"""The ``code`` reward: a reply's Python code passes the task's tests, run in the sandbox.

The task's gold answer is a JSON object ``{"prompt", "test", "entry_point"}`` (the code row schema,
megarl/data/schemas.py, builds it from HumanEval-style rows). The program run is:

- the last fenced code block of the reply (```` ```python ... ``` ```` or a bare fence) when there is
  one, else the whole reply;
- prefixed with the task's prompt when it does not define ``def <entry_point>`` itself, so a reply
  that continues the prompt (HumanEval's completion format) and one that restates the whole function
  both work.

A pass is all of ``check(candidate)``'s tests passing in the sandbox (megarl/reward/sandbox.py); a
timeout, a crash, a failed assert or any trick the sandbox sees is a fail.
"""

from __future__ import annotations

import json
import re
from typing import Optional, Tuple

from megarl.reward import sandbox
from megarl.reward.registry import register_reward

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def code_task(gold: str) -> dict:
    """The ``{"prompt", "test", "entry_point"}`` of a code task's gold; ValueError naming what is missing."""
    try:
        task = json.loads(gold)
    except (TypeError, json.JSONDecodeError):
        raise ValueError("reward.fn=code: the gold answer is not a code task (a JSON object with 'test' and "
                         "'entry_point'); use code rows (prompt, test, entry_point) as the data") from None
    missing = [k for k in ("test", "entry_point") if not isinstance(task, dict) or not task.get(k)]
    if missing:
        raise ValueError(f"reward.fn=code: the code task has no {' and no '.join(missing)}")
    return task


def extract_code(completion: str, *, strict: bool = False) -> Optional[str]:
    """The reply's program: its last fenced block (strict: only a fenced block), else the whole reply."""
    blocks = _FENCE.findall(completion)
    if blocks:
        return blocks[-1]
    if strict:
        return None
    return completion if completion.strip() else None


def program_of(completion: str, task: dict, *, strict: bool = False) -> Optional[str]:
    """What runs: the reply's code, with the task's prompt before it unless it defines the entry point."""
    code = extract_code(completion, strict=strict)
    if code is None:
        return None
    if re.search(rf"^\s*(async\s+)?def\s+{re.escape(task['entry_point'])}\s*\(", code, re.MULTILINE):
        return code
    return task.get("prompt", "") + code


def explain_code(completion: str, gold: str, *, strict: bool = False) -> Tuple[bool, str]:
    """(passed, reason) of one reply against its task's tests, in the sandbox."""
    task = code_task(gold)
    program = program_of(completion, task, strict=strict)
    if program is None:
        return False, "no code in the reply" + (" (strict: a fenced ```python block is required)" if strict else "")
    verdict = sandbox.run_tests(program, task["test"], task["entry_point"], prompt=task.get("prompt", ""))
    return verdict.passed, verdict.reason


@register_reward("code", extract=extract_code, explain=explain_code, prepare=sandbox.check_sandbox)
def code(completion: str, gold: str, *, strict: bool = False) -> bool:
    """The reply's code passes every test of the task (``check(entry_point)``), sandboxed."""
    return explain_code(completion, gold, strict=strict)[0]
