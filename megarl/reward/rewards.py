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
  follow). The boxed content is compared symbolically (``\\frac{1}{2}`` = ``0.5``), with two guards
  against answers a policy learns to write instead of solving (:func:`_verify`): when the gold is a
  number, the answer must be a number written out, not an expression left to evaluate
  (``\\boxed{12+7}``, ``\\boxed{\\dbinom{8}{4}}``, ``\\boxed{3 \\lor 19}`` are wrong for a numeric gold:
  boxing the question's own arithmetic would score, though sympy and MATH's grader take it); and a
  percent sign counts only when the gold has one (math-verify reads ``3\\%`` as both 3 and 0.03).
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


def _load_math_verify() -> None:
    """math/dapo's ``prepare``: import math-verify (sympy, its LaTeX grammar) and parse once, in each
    scoring process before it says ready, so the 1-4 s this takes (measured on 2 loaded cores) is not
    charged to the first sample's reward.timeout_s, which would score it wrong as timed out."""
    from math_verify import parse

    parse("\\boxed{\\frac{1}{2}}")


@register_reward("math", extract=extract_math, prepare=_load_math_verify)
def math(completion: str, gold: str, *, strict: bool = False) -> bool:
    """math-verify: the last ``\\boxed{}`` of the reply is mathematically equal to gold."""
    return _verify(extract_math(completion, strict=strict), gold)


@register_reward("dapo", extract=extract_dapo, prepare=_load_math_verify)
def dapo(completion: str, gold: str, *, strict: bool = False) -> bool:
    """math-verify: the last line's ``Answer: ...`` (else the last ``\\boxed{}``) equals gold."""
    return _verify(extract_dapo(completion, strict=strict), gold)


# What is not the number itself in a written-out answer: units and words (\\text{...}), degrees,
# currency, TeX spacing and sizing, '$' delimiters; a leading 'x =' is dropped separately.
_NOT_THE_NUMBER = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}|\^\{?\\circ\}?|\\\$|\\left|\\right|\\[!,; ]|\$|\s+")
# A number written out: an integer or decimal (thousands groups allowed), a fraction a/b or
# \frac{a}{b} (also \dfrac, \tfrac, and TeX's \frac12 shorthand), with a sign, a percent sign allowed.
_WRITTEN_NUMBER = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+|\d+/\d+"
                             r"|\\[dt]?frac(?:\{\d+\}\{\d+\}|\d\d))(?:\\?%)?")


def _written_number(text: str) -> Optional[str]:
    """``text`` as the number it writes out (units, currency, degrees and a leading ``x =`` dropped),
    or None when it is anything else: an expression, a set, a symbol."""
    key = re.sub(r"^[a-zA-Z]\s*=", "", _NOT_THE_NUMBER.sub("", text).removesuffix("."))
    return key if _WRITTEN_NUMBER.fullmatch(key) else None


def _verify(content: Optional[str], gold: str) -> bool:
    """math-verify of one extracted final answer against gold (bare, ``$...$`` or boxed), with the
    module doc's two guards: a numeric gold needs a number written out; a percent sign only counts
    when the gold has one."""
    from math_verify import parse, verify

    if content is None:
        return False
    gold_content = answers.last_boxed(gold) if "\\boxed" in gold or "\\fbox" in gold else gold.strip()
    if gold_content and gold_content.startswith("$") and gold_content.endswith("$"):
        gold_content = gold_content.strip("$").strip()
    if not gold_content:
        return False
    gold_number = _written_number(gold_content)
    if gold_number is not None:
        number = _written_number(content)
        if number is None:  # an expression for a numeric gold: the question's own arithmetic would score
            return False
        if number.endswith("%") and not gold_number.endswith("%"):
            content = number.rstrip("%").removesuffix("\\")  # 3% is 3 here, never also 0.03
    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    # Boxed on both sides: math-verify then parses exactly this content (its boxed extraction
    # handles bare numbers, fractions, tuples and radicals that a bare string would lose).
    gold_parsed = parse(f"\\boxed{{{gold_content}}}", parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{content}}}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
