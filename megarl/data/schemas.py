"""Row schemas: which column of a data row is the prompt, which the gold answer, how the gold final
answer is read from it, and the reward and instruction that go with the data.

A schema is a row of :data:`SCHEMAS`, not a branch: recognising a new dataset layout is one more
entry. A file's schema is picked once, from its first row, by the first entry whose two keys are
both there; every later row must have them too (a row that does not is a bad row, named by
``file:line``). ``data.prompt_key`` / ``data.answer_key`` replace an entry's keys (dotted paths into
nested columns, ``reward_model.ground_truth``); when no entry fits even so and both are given, the
file is read as the ``custom`` schema. Columns a schema does not name are ignored.

The prompt column holds either a string (the question: ``data.instruction`` is appended and
``data.system_prompt`` added as a system turn) or a list of chat messages ``[{"role", "content"},
...]``, used as it is (system turn included) through the tokenizer's chat template.

How the gold final answer is read (``gold``):

- ``hash``: the text after the last ``####`` (GSM8K), or the whole answer when it has none;
  thousands separators dropped.
- ``boxed``: the content of the last ``\\boxed{...}`` of a reference solution (MATH).
- ``as_is``: the value itself, stripped (verl's ``reward_model.ground_truth``).
- ``auto``: ``boxed`` when the answer has a ``\\boxed{}``, ``hash`` when it has ``####``, else ``as_is``.
- ``code``: a code task (HumanEval's ``prompt`` + ``test`` + ``entry_point``): the gold is the JSON
  object ``{"prompt", "test", "entry_point"}`` the ``code`` reward runs (megarl/reward/code.py).

Nothing here imports torch, pyarrow or math-verify.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

# The instruction appended to a string prompt when data.instruction is auto (the schema's own).
ANSWER_NUMBER = "Reply with only the final number."  # the quickstart's, for short numeric answers
# Qwen2.5-Math's chain-of-thought prompt, the usual one for MATH-style RL (verl's MATH preprocessing
# asks for the same: "... output the final answer within \boxed{}").
ANSWER_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
# A code task's prompt is a function's signature and docstring; the reply is its whole code.
ANSWER_CODE = "Complete the Python function. Reply with the whole function in one ```python block."


@dataclass(frozen=True)
class RowSchema:
    name: str         # short name, logged and used in messages ('gsm8k', 'math', 'verl', ...)
    label: str        # what it is, for people ('GSM8K', 'MATH', ...)
    prompt_key: str   # dotted path to the prompt: a string or a list of chat messages
    answer_key: str   # dotted path to the gold answer, or to a reference solution holding it
    gold: str         # how the gold final answer is read from the answer column (see the module doc)
    reward: str       # the reward.fn this data gets when reward.fn is auto
    instruction: str  # what data.instruction auto appends to a string prompt
    # How held-out evaluation reads a reply's final answer (megarl/controller/evaluation.py): 'number'
    # (the last number) or 'boxed' (the last \boxed{}, for answers that are not all numbers).
    eval_answer: str = "number"
    # Further columns the gold is built from (the code schema's 'entry_point'), read with the answer.
    extra_keys: tuple[str, ...] = ()

    def keys(self, prompt_key: str = "", answer_key: str = "") -> "RowSchema":
        """This schema with ``data.prompt_key`` / ``data.answer_key`` in place of its own keys."""
        return replace(self, prompt_key=prompt_key or self.prompt_key, answer_key=answer_key or self.answer_key)

    def describe(self) -> str:
        how = {"hash": "the text after its last '####'", "boxed": "its last \\boxed{}", "as_is": "as it is",
               "auto": "its last \\boxed{}, else after '####', else as it is",
               "code": "the tests, run against the reply's code"}[self.gold]
        return f"{self.label} rows (prompt {self.prompt_key!r}, gold answer {how} of {self.answer_key!r})"


# Order matters: the first entry whose keys a file's first row has wins (verl's 'prompt' +
# 'reward_model.ground_truth' before plain 'prompt' + 'answer'; MATH's 'problem' + 'solution' before
# 'problem' + 'answer').
SCHEMAS: tuple[RowSchema, ...] = (
    # verl / DAPO-Math-17k: data_source, prompt (chat messages), ability, reward_model {style,
    # ground_truth}, extra_info. DAPO's own prompt asks for "Answer: ..." on the last line; the
    # dapo reward reads that line or the last \boxed{}.
    RowSchema("verl", "verl", "prompt", "reward_model.ground_truth", "as_is", "dapo", ANSWER_BOXED),
    # HumanEval (and MBPP-style rows in its layout): prompt (signature + docstring), test (defines
    # check(candidate)), entry_point; canonical_solution is ignored. The code reward runs the tests.
    RowSchema("code", "code (HumanEval)", "prompt", "test", "code", "code", ANSWER_CODE, extra_keys=("entry_point",)),
    # MATH (Hendrycks): problem, solution (the gold answer is its last \boxed{}), level, type.
    RowSchema("math", "MATH", "problem", "solution", "boxed", "math", ANSWER_BOXED, "boxed"),
    # MATH-500 and similar: problem + a bare answer.
    RowSchema("math-answer", "MATH (answer column)", "problem", "answer", "auto", "math", ANSWER_BOXED, "boxed"),
    # GSM8K: question, answer ('... #### 72').
    RowSchema("gsm8k", "GSM8K", "question", "answer", "hash", "gsm8k", ANSWER_NUMBER),
    # Plain: prompt (text or messages) + answer.
    RowSchema("plain", "plain", "prompt", "answer", "auto", "arithmetic", ANSWER_NUMBER),
)
# Both data.prompt_key and data.answer_key given, and no entry has those keys.
CUSTOM = RowSchema("custom", "custom", "", "", "auto", "arithmetic", ANSWER_NUMBER)
# builtin:arithmetic (generated, no file).
ARITHMETIC = RowSchema("arithmetic", "builtin arithmetic", "question", "answer", "as_is", "arithmetic", ANSWER_NUMBER)

KNOWN = "; ".join(f"{s.label} ({s.prompt_key!r} + {s.answer_key!r})" for s in SCHEMAS)
MISSING = object()


def lookup(row: dict, dotted: str) -> Any:
    """``row['a']['b']`` for ``'a.b'``; :data:`MISSING` when any part is missing or null (parquet
    stores a missing value as a null)."""
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return MISSING
        node = node[part]
    return node


def has(row: dict, dotted: str) -> bool:
    return lookup(row, dotted) is not MISSING


def detect(row: dict, prompt_key: str = "", answer_key: str = "") -> Optional[RowSchema]:
    """The schema of a file whose first row is ``row`` (None when none fits). With both keys given,
    the entry with exactly those keys, else ``custom``; with one, the first entry whose other key the
    row has."""
    if prompt_key and answer_key:
        if not (has(row, prompt_key) and has(row, answer_key)):
            return None
        return next((s for s in SCHEMAS if (s.prompt_key, s.answer_key) == (prompt_key, answer_key)),
                    CUSTOM.keys(prompt_key, answer_key))
    for schema in SCHEMAS:
        s = schema.keys(prompt_key, answer_key)
        if has(row, s.prompt_key) and has(row, s.answer_key):
            return s
    return None


def root_columns(schema: RowSchema) -> list[str]:
    """The top-level columns a schema reads (what a columnar reader needs to load)."""
    return sorted({schema.prompt_key.split(".")[0], schema.answer_key.split(".")[0],
                   *(k.split(".")[0] for k in schema.extra_keys)})


# --- the gold final answer ------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# What may follow a final \boxed{} for it to count as the reply's end: '.', '$', whitespace, and one
# closing display/inline math delimiter.
_BOXED_TAIL = re.compile(r"[\s.$]*(?:\\\]|\\\)|\$\$)?[\s.$]*")


def last_boxed(text: str, *, at_end: bool = False) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, stripped; None when
    there is none or it is unclosed. ``at_end``: only when nothing but whitespace, '.', '$', '\\]' or
    '\\)' follows it. The one implementation: gold answers here, rewards (megarl/reward/answers.py)
    and the evaluation's scorer (megarl/controller/evaluation.py) read replies with it."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text) and depth:
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace \{ \} is content, not structure
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    if depth:
        return None  # the last \boxed is unclosed: the reply never finished its answer
    if at_end and not _BOXED_TAIL.fullmatch(text[i:]):
        return None
    return text[starts[-1]:i - 1].strip()


def after_hash(answer: str) -> str:
    """GSM8K puts the final answer after '####'; thousands separators are dropped."""
    return answer.split("####")[-1].strip().replace(",", "")


def code_gold(prompt: str, test: str, entry_point: object) -> tuple[str, str]:
    """(gold, why not) of a code row: the JSON task the code reward runs."""
    import json

    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        return "", f"'entry_point' must be the tested function's name, got {str(entry_point)[:40]!r}"
    if "def check(" not in test:
        return "", "'test' must define check(candidate), the function the code reward calls"
    return json.dumps({"prompt": prompt, "test": test, "entry_point": entry_point}), ""


def gold_of(schema: RowSchema, answer: str) -> tuple[str, str]:
    """(gold final answer, '' or why there is none) of one row's answer column."""
    how = schema.gold
    if how == "auto":
        how = "boxed" if _BOXED.search(answer) else "hash" if "####" in answer else "as_is"
    if how == "hash":
        gold = after_hash(answer)
        return gold, "" if gold else f"{schema.answer_key!r} has nothing after its last '####'; put the final answer there"
    if how == "boxed":
        gold = last_boxed(answer)
        return (gold or "", "" if gold else f"{schema.answer_key!r} has no closed, non-empty \\boxed{{...}}: the gold "
                                            f"answer of a {schema.label} row is its last \\boxed{{}}")
    gold = answer.strip()
    return gold, "" if gold else f"empty {schema.answer_key!r}"
