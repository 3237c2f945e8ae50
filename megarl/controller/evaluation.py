"""Held-out evaluation that the policy cannot game: a strict scorer independent of the training reward.

The training reward is pluggable and may be lenient (flexible formats, shaping); evaluation is not.
Its scorer is written here on its own and shares no code with ``megarl.reward``. By default it
evaluates no expression: the answer is the last number of a reply that *finished* (a truncated reply is wrong,
whatever it contains), compared with the gold number exactly (as a fraction). A reply that restates
the question ("To find 12 + 7, ...") ends in 7 and is wrong.

Data whose answers are boxed (MATH: the row schema's ``eval_answer`` is ``boxed``; any data with
``data.eval_answer: boxed``) is judged on the reply's last ``\\boxed{...}`` by mathematical equivalence
with the gold (math-verify, the library of the ``math`` training reward and the sympy-equivalence score
of LlamaRL arXiv 2505.24034 sec. 8, called here on its own), so ``\\frac{1}{2}`` = ``0.5``,
``\\sqrt{18}`` = ``3\\sqrt{2}``, ``\\$18`` = ``18``. Equivalence alone can be gamed, so two guards, each
a reply a policy could learn to write instead of solving:

- **A numeric gold needs a number.** When the gold is a number, the boxed answer must be a number
  written out (an integer, a decimal, ``\\frac{a}{b}`` or ``a/b``; units, ``\\$``, ``%``, ``^\\circ``
  and a leading ``x =`` aside), never an expression left to evaluate: ``\\boxed{12+7}`` is not 19,
  though sympy (and LlamaRL's score) would take it; boxing the question's own arithmetic is exactly
  what a policy learns when expressions score.
- **No echo.** A symbolic answer (not a number) copied from the question (its normalised text inside
  the question's) is wrong unless it is the gold's own text: ``\\boxed{(x+1)^2 - x^2}`` for "Simplify
  $(x+1)^2 - x^2$" is not ``2x+1``.

No boxed answer, an unfinished reply, or a math-verify timeout or error is wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from megarl.data.schemas import last_boxed
from megarl.rollout import Sample

# A plain decimal number with optional thousands groups; a minus sign only when it is not a
# subtraction (not right after a digit, letter or closing bracket).
_NUMBER = re.compile(r"(?<![\w)\]])[-\u2212]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w)\]])[-\u2212]?\d+(?:\.\d+)?")
# Longest digit string read as a number: Python refuses to convert more than 4300 digits
# (sys.get_int_max_str_digits(), its default); a greedy reply that repeats digits must score wrong,
# not stop the evaluation. No gold answer is that long.
_MAX_DIGITS = 4000


def _exact(digits: str) -> Fraction | None:
    return Fraction(digits) if len(digits) <= _MAX_DIGITS else None


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (exactly, as a fraction), or None when there is none (or
    it has more than _MAX_DIGITS digits)."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return _exact(found[-1].replace(",", "").replace("\u2212", "-"))


_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")
_TEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\$|\s+")
ANSWER_STYLES = ("number", "boxed")




def _tex_key(text: str) -> str:
    key = _TEX_NOISE.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key.removesuffix(".").removeprefix("\\text{").removesuffix("}") if key.startswith("\\text{") else \
        key.removesuffix(".")


def _tex_number(text: str) -> Fraction | None:
    """A plain number or a numeric ``\\frac{a}{b}``, exactly; None for anything else."""
    key = _tex_key(text)
    m = _FRAC.match(key)
    if m:
        num, den = _exact(m.group(2)), _exact(m.group(3))
        value = num / den if num is not None and den else None
        return -value if value is not None and m.group(1) else value
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+", key):
        return _exact(key.replace(",", ""))
    return None


_UNIT_NOISE = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}|\^\{?\\circ\}?|\\%|%|\\\$|\\left|\\right|\\!|\\,|\\;|\\ |\$|\s+")
_LITERAL = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+|-?\\[dt]?frac\{\d+\}\{\d+\}|-?\d+/\d+")
MATH_VERIFY_TIMEOUT_S = 5  # per parse / verify; a slower one is judged wrong


def _literal(text: str) -> bool:
    """Whether ``text`` is a number written out (units, currency, percent, degrees, ``x =`` aside)."""
    key = re.sub(r"^[a-zA-Z]\s*=", "", _UNIT_NOISE.sub("", text).removesuffix("."))
    return bool(_LITERAL.fullmatch(key))


def _echo_key(text: str) -> str:
    return _UNIT_NOISE.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").lower()


def _equivalent(answer: str, gold: str) -> bool:
    """math-verify: ``answer`` and ``gold`` (both boxed contents) are mathematically equal; False on a
    parse failure, an error or a timeout (signal-based, so only on the main thread)."""
    import threading

    from math_verify import parse, verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        g = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        a = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
        return bool(g and a and verify(g, a, timeout_seconds=timeout))
    except Exception:  # math-verify's own timeout or a sympy error on odd input: not shown equal
        return False


def strict_boxed_correct(reply: str, gold: str, finish_reason: str | None, question: str = "") -> tuple[bool, bool]:
    """(correct, formatted) for boxed data: formatted = the reply finished with a ``\\boxed{}`` answer;
    correct = that answer is equivalent to ``gold`` (math-verify) and passes the guards of the module
    doc (a number for a numeric gold; not an expression copied from ``question``)."""
    if finish_reason == "length":
        return False, False
    answer = last_boxed(reply)
    if answer is None or not answer.strip():
        return False, False
    gold = (last_boxed(gold) or gold).strip()
    if not gold:
        return False, True
    if _tex_number(gold) is not None:  # a numeric gold: the answer must be a number written out
        if not _literal(answer):
            return False, True
    elif question and _echo_key(answer) != _echo_key(gold) and _echo_key(answer) in _echo_key(question):
        return False, True
    exact_a, exact_g = _tex_number(answer), _tex_number(gold)
    if exact_a is not None and exact_g is not None:  # plain numbers: exact, no library needed
        return exact_a == exact_g, True
    return _equivalent(answer, gold), True


def strict_correct(reply: str, gold: str, finish_reason: str | None, style: str = "number",
                   question: str = "") -> tuple[bool, bool]:
    """(correct, formatted): formatted = the reply finished and contains a number; correct = that
    number, the reply's last, equals ``gold``. ``style='boxed'``: :func:`strict_boxed_correct`
    (``question``: the prompt's text, for its echo guard)."""
    if style == "boxed":
        return strict_boxed_correct(reply, gold, finish_reason, question)
    if finish_reason == "length":
        return False, False
    answer = last_number(reply)
    if answer is None:
        return False, False
    gold_value = last_number(gold)
    return gold_value is not None and answer == gold_value, True


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of held-out prompts answered correctly (strict)
    format_rate: float  # fraction of replies that finished with a number
    truncated_frac: float  # fraction of replies cut at max_new_tokens
    mean_length: float  # completion tokens per reply
    n: int

    def metrics(self) -> dict[str, float]:
        return {"eval/accuracy": self.accuracy, "eval/format_rate": self.format_rate,
                "eval/truncated_frac": self.truncated_frac, "eval/mean_length": self.mean_length,
                "eval/n": float(self.n)}

    @classmethod
    def of(cls, correct: Sequence[bool], formatted: Sequence[bool], truncated: Sequence[bool],
           lengths: Sequence[int]) -> "EvalResult":
        """The summary of replies judged one by one (each sequence: one entry per reply)."""
        n = max(len(correct), 1)
        return cls(accuracy=sum(correct) / n, format_rate=sum(formatted) / n, truncated_frac=sum(truncated) / n,
                   mean_length=sum(lengths) / n, n=len(correct))

    @classmethod
    def of_samples(cls, samples: Sequence[Sample]) -> "EvalResult":
        """The summary of samples a :class:`StrictScorer` scored."""
        return cls.of([bool(s.correct) for s in samples], [bool(s.formatted) for s in samples],
                      [s.truncated for s in samples], [len(s.completion_ids) for s in samples])


class StrictScorer:
    """The strict held-out scorer behind the ``RewardScorer`` call the training reward takes, so
    evaluation reads the same records: ``correct`` / ``formatted`` by :func:`strict_correct`, and
    ``reward`` 1 for a correct reply, else 0 (never the training reward's shaping). ``style``: how a
    reply's final answer is read, the held-out data's (``number`` or ``boxed``); ``questions[i]``: the
    text of prompt ``i`` (the boxed style's echo guard; empty: no guard)."""

    def __init__(self, style: str = "number", questions: Sequence[str] = ()):
        if style not in ANSWER_STYLES:
            raise ValueError(f"answer style {style!r}: expected one of {ANSWER_STYLES}")
        self.style, self.questions = style, list(questions)

    def score(self, samples: Sequence[Sample], answers: Sequence[str],
              decode: Callable[[Sequence[int]], str]) -> None:
        """Set every sample's ``correct``, ``formatted`` and ``reward``; ``answers[i]``: the gold
        answer of prompt ``i``."""
        for s in samples:
            question = self.questions[s.prompt_index] if self.questions else ""
            s.correct, s.formatted = strict_correct(decode(s.completion_ids), answers[s.prompt_index], s.finish_reason,
                                                    self.style, question)
            s.reward = float(s.correct)


def score_replies(replies: Sequence[str], golds: Sequence[str], finish_reasons: Sequence[str | None],
                  lengths: Sequence[int]) -> tuple[EvalResult, list[bool]]:
    """Strict scores of held-out replies given as text (tools/eval_hf.py scores an HF model's);
    returns the summary and each reply's correctness."""
    judged = [strict_correct(r, g, f) for r, g, f in zip(replies, golds, finish_reasons, strict=True)]
    result = EvalResult.of([c for c, _ in judged], [f for _, f in judged], [f == "length" for f in finish_reasons],
                           lengths)
    return result, [c for c, _ in judged]


def hacking_warning(prev_reward: float, reward: float, prev_acc: float, acc: float, n_eval: int,
                    min_reward_rise: float = 0.05) -> str | None:
    """A warning when the training reward rose while strict held-out accuracy fell.

    ``prev_reward``/``reward``: mean training reward over the steps before the previous eval and
    since it. Accuracy must fall by more than two standard errors of a difference of two accuracies
    on ``n_eval`` prompts (sqrt(2 p (1 - p) / n), p their mean), so eval noise alone rarely warns.
    """
    p = min(max((prev_acc + acc) / 2, 1.0 / max(n_eval, 1)), 1 - 1.0 / max(n_eval, 1))
    noise = 2 * math.sqrt(2 * p * (1 - p) / max(n_eval, 1))
    if reward - prev_reward >= min_reward_rise and prev_acc - acc > noise:
        return (f"reward hacking? training reward rose {prev_reward:.3f} -> {reward:.3f} while strict held-out "
                f"accuracy fell {prev_acc:.3f} -> {acc:.3f} (more than eval noise {noise:.3f}): look at "
                f"eval_samples.jsonl and the reward function (reward.fn)")
    return None
