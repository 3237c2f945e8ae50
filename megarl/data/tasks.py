"""Tasks (a question and its gold final answer) from GSM8K-format jsonl or procedural arithmetic."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

BUILTIN_ARITHMETIC = "builtin:arithmetic"
INSTRUCTION = "Reply with only the final number."


@dataclass(frozen=True)
class Task:
    question: str
    answer: str  # the gold final answer, e.g. "72"


def load_tasks(source: str, *, limit: int | None = None, seed: int = 0) -> list[Task]:
    """Read ``source``: a GSM8K-format jsonl ({"question", "answer": "... #### 72"}) or
    'builtin:arithmetic' (a fixed, seeded set of small-number additions/subtractions/products)."""
    if source == BUILTIN_ARITHMETIC:
        return arithmetic_tasks(limit or 4096, seed=seed)
    tasks = []
    with Path(source).open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{source}:{lineno}: each line needs 'question' and 'answer' keys")
            tasks.append(Task(row["question"], gold_answer(row["answer"])))
            if limit and len(tasks) >= limit:
                break
    return tasks


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
        tasks.append(Task(question, str(eval(f"{a}{op}{b}"))))  # noqa: S307 - operands are ints we made
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
