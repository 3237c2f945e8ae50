"""The built-in rewards: ``arithmetic``, ``gsm8k``, ``math`` and ``dapo``.

Each extracts ONE final answer from the reply (:mod:`megarl.reward.answers`) and compares only it
with the gold answer; nothing else the reply says can make it right.

- ``arithmetic``: the last number of the reply equals gold (exact: integers and decimals are
  compared as fractions, ``19.0 == 19``). ``strict``: the whole reply must be that number
  (whitespace, a leading ``=`` or ``$`` and a trailing period allowed).
- ``gsm8k``: as lm-eval-harness's gsm8k filters. Flexible: the number after the last ``####`` when
  there is one, else the last number of the reply (flexible-extract). ``strict``: only the number
  right after the last ``####`` (strict-match); no ``####`` is wrong.
- ``math``: math-verify on the content of the last ``\\boxed{...}`` only, never on free text; no
  boxed answer is wrong. The gold answer (bare, ``$...$`` or itself boxed) is parsed the same way.
  ``strict``: the last ``\\boxed{}`` must also end the reply (only whitespace, '.', '$', '\\]' may
  follow). The boxed content is compared symbolically, so an unsimplified but equal boxed
  expression (``\\boxed{12+7}`` for 19) counts, as in MATH grading.
- ``dapo``: as ``math``, on the answer DAPO-Math-17k's prompt asks for: the reply's last non-empty
  line when it reads ``Answer: ...`` (its content, ``$`` and a final period dropped, a ``\\boxed{}``
  in it unwrapped), else the last ``\\boxed{...}``. An ``Answer:`` anywhere but the last line (a
  restated instruction, an abandoned attempt) is not read. ``strict``: only that last line.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Optional

from megarl.reward import answers
from megarl.reward.registry import register_reward

# math-verify's own parse/verify timeout (whole seconds, signal.alarm); RewardPool's workers set it
# from reward.timeout_s. Only used in a main thread: signal.alarm cannot be armed anywhere else.
MATH_TIMEOUT_S = 5


def gold_number(gold: str) -> Optional[Fraction]:
    """Gold as a number: the whole string ('1,200', '-3'), else its '####' answer, else its last number."""
    for extract in (answers.to_number, answers.hash_answer, answers.last_number):
        value = extract(gold)
        if value is not None:
            return value
    return None


def _same(pred: Optional[Fraction], gold: str) -> bool:
    want = gold_number(gold)
    return pred is not None and want is not None and pred == want


def extract_arithmetic(completion: str, *, strict: bool) -> Optional[Fraction]:
    return answers.only_number(completion) if strict else answers.last_number(completion)


def extract_gsm8k(completion: str, *, strict: bool) -> Optional[Fraction]:
    marked = answers.hash_answer(completion)
    if strict or marked is not None:
        return marked
    return answers.last_number(completion)


def extract_math(completion: str, *, strict: bool) -> Optional[str]:
    content = answers.last_boxed(completion, at_end=strict)
    return content or None  # '\boxed{}' is no answer


# DAPO-Math-17k's prompt: 'The last line of your response should be of the form Answer: $Answer'.
_ANSWER_LINE = re.compile(r"\**\s*answer\s*\**\s*:\s*\**\s*(?P<answer>.+?)\s*$", re.IGNORECASE)


def extract_dapo(completion: str, *, strict: bool) -> Optional[str]:
    lines = [line for line in completion.splitlines() if line.strip()]
    m = _ANSWER_LINE.fullmatch(lines[-1].strip()) if lines else None
    if m:
        content = m.group("answer").rstrip(".").strip()
        if "\\boxed" in content or "\\fbox" in content:
            content = answers.last_boxed(content) or ""
        content = content.strip("$").strip()
        return content or None
    return None if strict else extract_math(completion, strict=False)


@register_reward("arithmetic", extract=extract_arithmetic, in_process=True)
def arithmetic(completion: str, gold: str, *, strict: bool = False) -> bool:
    """The reply's final number (strict: the reply is only that number) equals gold, exactly."""
    return _same(extract_arithmetic(completion, strict=strict), gold)


@register_reward("gsm8k", extract=extract_gsm8k, in_process=True)
def gsm8k(completion: str, gold: str, *, strict: bool = False) -> bool:
    """The '####' answer (flexible: else the last number) equals gold, exactly."""
    return _same(extract_gsm8k(completion, strict=strict), gold)


@register_reward("math", extract=extract_math)
def math(completion: str, gold: str, *, strict: bool = False) -> bool:
    """math-verify: the last ``\\boxed{}`` of the reply is mathematically equal to gold."""
    return _verify(extract_math(completion, strict=strict), gold)


@register_reward("dapo", extract=extract_dapo)
def dapo(completion: str, gold: str, *, strict: bool = False) -> bool:
    """math-verify: the last line's ``Answer: ...`` (else the last ``\\boxed{}``) equals gold."""
    return _verify(extract_dapo(completion, strict=strict), gold)


def _verify(content: Optional[str], gold: str) -> bool:
    """math-verify of one extracted final answer against gold (bare, ``$...$`` or boxed)."""
    from math_verify import parse, verify

    if content is None:
        return False
    gold_content = answers.last_boxed(gold) if "\\boxed" in gold or "\\fbox" in gold else gold.strip()
    if gold_content and gold_content.startswith("$") and gold_content.endswith("$"):
        gold_content = gold_content.strip("$").strip()
    if not gold_content:
        return False
    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    # Boxed on both sides: math-verify then parses exactly this content (its boxed extraction
    # handles bare numbers, fractions, tuples and radicals that a bare string would lose).
    gold_parsed = parse(f"\\boxed{{{gold_content}}}", parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{content}}}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
