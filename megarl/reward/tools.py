"""A tool-use environment: ``calculator``. The policy may write ``<calc>EXPR</calc>`` inside a math
reply; the environment answers ``<result>VALUE</result>`` in a user turn and the policy continues.
A reply with no calculator call ends the rollout and is scored by the ``arithmetic`` reward (its
final number against the gold answer).

The observation's tokens come from the model's own chat template (:func:`turn_ids`): the template's
end-of-turn separator after the reply, the tool's turn, and the assistant header that opens the next
reply, tokenized once here; earlier turns are never re-encoded.
"""

from __future__ import annotations

import ast
import operator
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any, List, Optional, Sequence

from megarl.reward.environment import EnvState, RewardEnvironment, StepResult, register_environment, task_messages

CALL = re.compile(r"<calc>(.{1,200}?)</calc>\s*$", re.DOTALL)
INSTRUCTION = ("You may use a calculator: write <calc>EXPRESSION</calc> and stop; the result comes back as "
               "<result>VALUE</result>. End with the final number.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_POW = 64      # largest exponent the calculator takes (a bound on its time and memory)
# Largest numerator or denominator, in bits (~1233 digits), of any number the calculator reads or
# computes: MAX_POW alone bounds one power, not a tower of them (((9**64)**64)**64 has 830k bits and
# one more **64 would take hours), and 4096 bits keeps every value printable (str() refuses > 4300 digits)
MAX_BITS = 4096
_PLACEHOLDER = "\u2063MEGARL_REPLY\u2063"  # never in a real reply: where the sampled tokens sit


def calculate(expr: str) -> Optional[Fraction]:
    """An arithmetic expression's exact value (numbers, + - * / // % **, parentheses); None when it
    is anything else, divides by zero or has an exponent above MAX_POW. Never ``eval``."""
    def bits(v: Fraction) -> int:
        return max(v.numerator.bit_length(), v.denominator.bit_length())

    def bounded(v: Fraction) -> Fraction:
        if bits(v) > MAX_BITS:
            raise ValueError("too large")
        return v

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return bounded(Fraction(str(node.value)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_POW):
                raise ValueError("exponent")
            # each operand within MAX_BITS: the worst result, a power, has 64 x 4096 bits (milliseconds)
            return bounded(Fraction(_OPS[type(node.op)](left, right)))
        raise ValueError("not arithmetic")

    try:
        return ev(ast.parse(expr.strip(), mode="eval").body)
    except (ValueError, ZeroDivisionError, SyntaxError, TypeError, OverflowError, RecursionError):
        return None


def _fmt(value: Optional[Fraction]) -> str:
    if value is None:
        return "error"
    if value.denominator == 1:
        return str(value.numerator)
    try:
        return f"{float(value):.10g}"
    except OverflowError:  # beyond a double (~1.8e308), within MAX_BITS: 10 digits from the exact value
        return f"{Decimal(value.numerator) / Decimal(value.denominator):.10g}"


def turn_ids(tokenizer: Any, messages: List[dict], content: str, reply_ids: Sequence[int]) -> List[int]:
    """Token ids that follow a reply in the chat template: the reply's end-of-turn separator (unless
    the reply already ended with it), a user turn of ``content``, and the assistant header."""
    before = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": _PLACEHOLDER}],
                                           tokenize=False)
    after = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": _PLACEHOLDER},
                                                      {"role": "user", "content": content}],
                                          tokenize=False, add_generation_prompt=True)
    if not after.startswith(before[:before.index(_PLACEHOLDER)]):
        raise ValueError("calculator: the chat template renders earlier turns differently once a turn is added")
    suffix = after[after.index(_PLACEHOLDER) + len(_PLACEHOLDER):]
    eos = tokenizer.eos_token or ""
    if eos and reply_ids and reply_ids[-1] == tokenizer.eos_token_id and suffix.startswith(eos):
        suffix = suffix[len(eos):]  # the reply sampled the separator itself
    return list(tokenizer.encode(suffix, add_special_tokens=False))


class Calculator:
    """The ``calculator`` environment (see the module doc); ``max_calls`` per rollout."""

    name = "calculator"
    instruction = INSTRUCTION  # what the prompt says (data.instruction: auto takes it)
    concurrent_steps = True    # step keeps its state in the rollout's EnvState only

    def __init__(self, *, tokenizer: Any = None, strict: bool = False, correct: float = 1.0, wrong: float = 0.0,
                 max_calls: int = 4):
        self.tokenizer, self.max_calls = tokenizer, max_calls
        self.final = RewardEnvironment("arithmetic", tokenizer=tokenizer, strict=strict, correct=correct,
                                       wrong=wrong)

    def reset(self, task: Any) -> EnvState:
        messages = task_messages(task)
        messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']} {self.instruction}"}
        return EnvState(task, messages)

    def call_in(self, state: EnvState, text: str) -> Optional[str]:
        """The expression the reply calls the calculator with (it ends in ``<calc>EXPR</calc>``), or None
        when it calls nothing or ``max_calls`` were made."""
        call = CALL.search(text)
        return call.group(1) if call and state.extra.get("calls", 0) < self.max_calls else None

    def step(self, state: EnvState, reply_ids: Sequence[int]) -> StepResult:
        text = self.tokenizer.decode(list(reply_ids), skip_special_tokens=True)
        expr = self.call_in(state, text)
        if expr is None:
            return self.final.score_text(state, text)
        state.turn += 1
        state.extra["calls"] = state.extra.get("calls", 0) + 1
        result = f"<result>{_fmt(calculate(expr))}</result>"
        obs = turn_ids(self.tokenizer, state.messages, result, reply_ids)
        state.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": result}]
        return StepResult(obs, False, None, {"call": expr, "result": result})


register_environment("calculator")(Calculator)
