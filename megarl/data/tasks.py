"""Tasks (a question and its gold final answer) from GSM8K-format jsonl or procedural arithmetic.

Bad data is refused before anything starts, each case in one line that begins with ``file:line``
(:class:`DataError`; ``megarl/config/validate.py`` reports it with the config key): a row that is
not valid JSON or not UTF-8, a row that is not a JSON object, a row without its ``question`` (the
prompt) or ``answer`` key, an empty question, an empty answer. A prompt too long for the model
(longer than ``min(data.max_prompt_tokens, generator.max_model_len - generator.max_new_tokens)``
tokens once formatted) is not an error: ``controller/prompts.py`` skips it and counts it, in one
WARNING naming the first such row's ``file:line``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN_ARITHMETIC = "builtin:arithmetic"
INSTRUCTION = "Reply with only the final number."
KEYS = ("question", "answer")


class DataError(ValueError):
    """A data row that cannot be used; the message is one line starting with ``file:line``."""


@dataclass(frozen=True)
class Task:
    question: str
    answer: str  # the gold final answer, e.g. "72"
    where: str = field(default="", compare=False)  # 'file:line' it came from ('' for generated tasks)


def load_tasks(source: str, *, limit: int | None = None, seed: int = 0) -> list[Task]:
    """Read ``source``: a GSM8K-format jsonl ({"question", "answer": "... #### 72"}) or
    'builtin:arithmetic' (a fixed, seeded set of small-number additions/subtractions/products).
    Raises :class:`DataError` naming ``file:line`` for the first bad row."""
    if source == BUILTIN_ARITHMETIC:
        return arithmetic_tasks(limit or 4096, seed=seed)
    tasks = []
    with Path(source).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            task = parse_row(raw, f"{source}:{lineno}")
            if task is None:
                continue
            tasks.append(task)
            if limit and len(tasks) >= limit:
                break
    return tasks


def parse_row(raw: bytes, where: str) -> Task | None:
    """One jsonl line as a Task (None for a blank line); :class:`DataError` naming ``where`` if bad."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 (byte {e.start}); save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                        f"object with 'question' and 'answer'") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a JSON {type(row).__name__}, not an object with 'question' and 'answer'")
    missing = [k for k in KEYS if k not in row]
    if missing:
        raise DataError(f"{where}: no {' and no '.join(repr(k) for k in missing)} key; each line needs 'question' "
                        f"(the prompt) and 'answer' (keys here: {sorted(row)[:6]})")
    question, answer = row["question"], row["answer"]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: empty 'question' (the prompt is {question!r}); fill it in or drop the row")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(f"{where}: empty or non-text 'answer' ({answer!r}); give the gold answer, e.g. '... #### 72'")
    gold = gold_answer(str(answer))
    if not gold:
        raise DataError(f"{where}: 'answer' has nothing after its last '####'; put the final answer there")
    return Task(question, gold, where=where)


def data_problems(paths: dict[str, str]) -> list[str]:
    """For each config key -> jsonl path that exists: the first bad row, as '<key>: <file:line>: why'."""
    out = []
    for key, path in paths.items():
        if path and path != BUILTIN_ARITHMETIC and Path(path).is_file():
            try:
                load_tasks(path)
            except DataError as e:
                out.append(f"{key}: {e}")
    return out


def gold_answer(answer: str) -> str:
    """GSM8K puts the final answer after '####'; thousands separators are dropped."""
    return answer.split("####")[-1].strip().replace(",", "")


def arithmetic_tasks(n: int, *, seed: int = 0) -> list[Task]:
    """Distinct small-number problems; the space has ~30k items, so train/eval splits stay disjoint."""
    rng = random.Random(seed)
    seen: set[str] = set()
    tasks: list[Task] = []
    while len(tasks) < n:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        if op == "*":
            a, b = a % 13, b % 13
        question = f"What is {a} {op} {b}?"
        if question in seen:
            continue
        seen.add(question)
        tasks.append(Task(question, str(eval(f"{a}{op}{b}")), where=f"{BUILTIN_ARITHMETIC}#{len(tasks)}"))  # noqa: S307
    return tasks


def split_train_eval(tasks: list[Task], eval_size: int, *, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Shuffle once, hold out ``eval_size`` tasks whose questions never appear in train."""
    order = list(tasks)
    random.Random(seed).shuffle(order)
    held = order[:eval_size]
    held_q = {t.question for t in held}
    return [t for t in order[eval_size:] if t.question not in held_q], held


def format_prompt(task: Task, tokenizer=None, *, chat_template: bool = True) -> str:
    """The text the generator sees. With a chat template, one user turn + the generation prompt."""
    text = f"{task.question} {INSTRUCTION}"
    if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return f"Question: {text}\nAnswer:"
