"""Tasks (a prompt and its gold final answer) from data files, or procedural arithmetic.

``data.train_path`` / ``data.eval_path`` name a ``.jsonl``, ``.json`` or ``.parquet`` file, a folder of
them, or a glob of parquet shards (:mod:`megarl.data.sources`, read as streams); the row schema
(GSM8K, MATH, verl / DAPO, plain, or ``data.prompt_key`` / ``data.answer_key``) is recognised from a
file's first row (:mod:`megarl.data.schemas`) and names the prompt, the gold answer, the default
reward and the default instruction.

Bad data is refused before anything starts, each case in one line that begins with ``file:line``
(``file:row N`` for parquet and JSON arrays; :class:`DataError`; ``megarl/config/validate.py`` reports
it with the config key): a row that is not valid JSON or not UTF-8, a row that is not a JSON object,
a row without the schema's prompt or answer key, an empty prompt, a prompt given as messages that
are not ``[{"role", "content"}, ...]`` with a user turn, an empty answer, an answer without its gold
final answer (nothing after ``####``, no ``\\boxed{}``). A prompt too long for the model (longer than
``min(data.max_prompt_tokens, generator.max_model_len - generator.max_new_tokens)`` tokens once
formatted) is not an error: ``controller/prompts.py`` skips it and counts it, in one WARNING naming
the first such row's ``file:line``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

from megarl.data.schemas import (ANSWER_NUMBER, ARITHMETIC, KNOWN, MISSING, RowSchema, after_hash, code_gold, detect, gold_of,
                                 lookup, root_columns)
from megarl.data.sources import DataError, data_files, first_row, iter_rows

BUILTIN_ARITHMETIC = "builtin:arithmetic"
INSTRUCTION = ANSWER_NUMBER  # what a string prompt of GSM8K / plain / arithmetic data gets by default
ROLES = ("system", "user", "assistant")

__all__ = ["BUILTIN_ARITHMETIC", "DataError", "INSTRUCTION", "Task", "data_problems", "format_prompt", "load_tasks",
           "read_tasks", "source_schema", "split_train_eval"]


@dataclass(frozen=True)
class Task:
    question: str  # the prompt's text (for a chat prompt: its last user turn), what disjointness compares
    answer: str  # the gold final answer, e.g. "72"
    where: str = field(default="", compare=False)  # 'file:line' it came from ('' for generated tasks)
    # A prompt given as chat messages ((role, content), ...), system turn included: used as it is.
    messages: tuple[tuple[str, str], ...] = ()


def source_schema(source: str, *, prompt_key: str = "", answer_key: str = "") -> tuple[RowSchema, str]:
    """The row schema of ``source`` and the row it was recognised from ('file:line'); DataError when
    no schema fits the first row."""
    if source == BUILTIN_ARITHMETIC:
        return ARITHMETIC, BUILTIN_ARITHMETIC
    where, row = first_row(source)
    schema = detect(row, prompt_key, answer_key)
    if schema is None:
        keys = sorted(row)[:8]
        hint = ("" if not (prompt_key or answer_key) else
                f" with data.prompt_key={prompt_key!r} data.answer_key={answer_key!r}")
        raise DataError(f"{where}: no known row schema{hint} (keys here: {keys}); known: {KNOWN}; or name the "
                        f"columns with data.prompt_key and data.answer_key (dotted paths into nested columns)")
    return schema, where


def read_tasks(source: str, *, limit: int | None = None, seed: int = 0, prompt_key: str = "",
               answer_key: str = "", dedupe: bool = False,
               counts: dict | None = None) -> tuple[RowSchema, list[Task]]:
    """The schema of ``source`` and its tasks (the first ``limit`` of them when given). ``dedupe``: a
    row whose prompt (case and whitespace aside, chat turns included) repeats an earlier one is not
    kept, while streaming, so a file that repeats each prompt many times costs only its distinct
    prompts; ``counts['duplicates']`` and ``counts['first_duplicate']`` ('file:line') say what was
    dropped."""
    if source == BUILTIN_ARITHMETIC:
        return ARITHMETIC, arithmetic_tasks(limit or 4096, seed=seed)
    schema, _ = source_schema(source, prompt_key=prompt_key, answer_key=answer_key)
    tasks: list[Task] = []
    seen: set[int] = set()
    dropped, first = 0, ""
    for task in iter_tasks(source, schema):
        if dedupe:
            key = hash(prompt_key_of(task))
            if key in seen:
                dropped, first = dropped + 1, first or task.where
                continue
            seen.add(key)
        tasks.append(task)
        if limit and len(tasks) >= limit:
            break
    if counts is not None:
        counts.update(duplicates=dropped, first_duplicate=first)
    return schema, tasks


def prompt_key_of(task: Task) -> str:
    """What makes two prompts the same: the turns' text, case and whitespace aside."""
    text = "\n".join(f"{r}: {c}" for r, c in task.messages) if task.messages else task.question
    return " ".join(text.split()).lower()


def load_tasks(source: str, *, limit: int | None = None, seed: int = 0, prompt_key: str = "",
               answer_key: str = "") -> list[Task]:
    """Read ``source`` (see the module doc) or 'builtin:arithmetic' (a fixed, seeded set of
    small-number additions/subtractions/products). Raises :class:`DataError` naming the first bad row."""
    return read_tasks(source, limit=limit, seed=seed, prompt_key=prompt_key, answer_key=answer_key)[1]


def iter_tasks(source: str, schema: RowSchema) -> Iterator[Task]:
    """The tasks of ``source`` read with ``schema``, one row at a time."""
    for where, row in iter_rows(source, columns=root_columns(schema)):
        yield parse_row(row, schema, where)


def parse_row(row: dict, schema: RowSchema, where: str) -> Task:
    """One row as a Task; :class:`DataError` naming ``where`` if it cannot be used."""
    p, a = schema.prompt_key, schema.answer_key
    prompt, answer = lookup(row, p), lookup(row, a)
    missing = [k for k, v in ((p, prompt), (a, answer)) if v is MISSING]
    if missing:
        raise DataError(f"{where}: no {' and no '.join(repr(k) for k in missing)} key (or a null); rows of this file are "
                        f"{schema.label} rows: {p!r} (the prompt) and {a!r} (the answer) (keys here: {sorted(row)[:6]})")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty {p!r} (the prompt is {prompt!r}); fill it in or drop the row")
        question, messages = prompt, ()
    else:
        messages = _messages(prompt, p, where)
        question = [c for r, c in messages if r == "user"][-1]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(f"{where}: empty or non-text {a!r} ({str(answer)[:60]!r}); give the gold answer, "
                        f"e.g. '... #### 72'")
    if schema.gold == "code":
        gold, why = code_gold(question, str(answer), lookup(row, schema.extra_keys[0]))
    else:
        gold, why = gold_of(schema, str(answer))
    if why:
        raise DataError(f"{where}: {why}")
    return Task(question, gold, where=where, messages=messages)


def _messages(prompt: object, key: str, where: str) -> tuple[tuple[str, str], ...]:
    """A chat prompt as ((role, content), ...); DataError unless it is a list of {role, content}
    objects with known roles, text contents and at least one non-empty user turn."""
    ok = isinstance(prompt, (list, tuple)) and bool(prompt)
    out = []
    for m in prompt if ok else ():
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            ok = False
            break
        out.append((m["role"], m["content"]))
    if not ok or not any(r == "user" and c.strip() for r, c in out):
        raise DataError(f"{where}: {key!r} is neither text nor a list of chat messages [{{'role': "
                        f"'system'|'user'|'assistant', 'content': '...'}}, ...] with a non-empty user turn "
                        f"(got {str(prompt)[:80]!r})")
    return tuple(out)


def data_problems(paths: dict[str, str], *, prompt_key: str = "", answer_key: str = "",
                  missing_ok: bool = False, scan_rows: bool = True) -> list[str]:
    """For each config key -> data source: why it cannot be read (no such file, the first bad row),
    as '<key>: <file:line>: why'. Reads every row (a stream: no row is kept), or with ``scan_rows=False``
    only the first rows that give its schema. ``missing_ok``: a source that is not on this machine is
    no problem (a dry run)."""
    out = []
    for key, path in paths.items():
        if not path or path == BUILTIN_ARITHMETIC:
            continue
        try:
            data_files(path)
        except DataError as e:  # the source itself: no such file, an empty folder or glob
            if missing_ok:
                continue
            out.append(f"{key}={path!r}: {str(e).removeprefix(f'{path}: ')}; give a .jsonl, .json or .parquet file, "
                       f"a folder or glob of them, or '{BUILTIN_ARITHMETIC}'")
            continue
        try:
            schema, _ = source_schema(path, prompt_key=prompt_key, answer_key=answer_key)
            for _ in iter_tasks(path, schema) if scan_rows else ():
                pass
        except DataError as e:
            out.append(f"{key}: {e}")
    return out


def gold_answer(answer: str) -> str:
    """GSM8K puts the final answer after '####'; thousands separators are dropped."""
    return after_hash(answer)


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


def format_prompt(task: Task, tokenizer=None, *, chat_template: bool = True, instruction: str = INSTRUCTION,
                  system_prompt: str = "") -> str:
    """The text the generator sees. A chat prompt (``task.messages``) goes through the chat template
    as it is; a text prompt gets ``instruction`` appended and, when given, ``system_prompt`` as a
    system turn. Without a chat template: the turns as plain text, ending where the reply starts."""
    if task.messages:
        messages = [{"role": r, "content": c} for r, c in task.messages]
    else:
        text = f"{task.question} {instruction}".strip() if instruction else task.question
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": text}]
    if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if len(messages) == 1:
        return f"Question: {messages[0]['content']}\nAnswer:"
    turns = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return f"{turns}\nAssistant:"
