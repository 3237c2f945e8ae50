"""The data decides what it can: each data file's row schema, and ``reward.fn: auto``.

Run by the loader after validation (so every file is known readable): recognises the schema of
``data.train_path`` and ``data.eval_path`` from their first rows (megarl/data/schemas.py), sets
``reward.fn`` to the training data's schema reward when it is ``auto`` (an explicit value wins), and
records all of it, with the keys and rows it came from, in ``data.choice``, which the run logs in its
first lines and ``megarl train --dry-run`` prints.
"""

from __future__ import annotations

import re
from pathlib import Path

from megarl.data.tasks import source_schema
from megarl.reward.config import AUTO


def apply_data_choice(cfg, *, missing_ok: bool = False) -> None:
    """Resolve ``reward.fn: auto`` from the training data and write ``data.choice``. ``missing_ok``
    (a dry run): data not on this machine leaves ``reward.fn: auto`` to be decided at start."""
    d = cfg.data
    keys = {"prompt_key": d.prompt_key, "answer_key": d.answer_key}
    if missing_ok and not _here(d.train_path):
        d.choice = (f"data.train_path={d.train_path!r} is not on this machine: its row schema"
                    f"{' and reward.fn (auto)' if cfg.reward.fn == AUTO else ''} are decided when the job starts"
                    f"{'' if cfg.reward.fn == AUTO else f'; reward.fn={cfg.reward.fn} (set in the config)'}")
        return
    train, where = source_schema(d.train_path, **keys)
    parts = [f"data.train_path: {train.describe()}, recognised from {where}"]
    if d.eval_path and (not missing_ok or _here(d.eval_path)):
        held, held_where = source_schema(d.eval_path, **keys)
        parts.append(f"data.eval_path: {held.describe()}, recognised from {held_where}")
    for name, path in eval_sets(d):
        if not missing_ok or _here(path):
            held, held_where = source_schema(path, **keys)
            parts.append(f"data.eval_paths {name}: {held.describe()}, recognised from {held_where}")
    if cfg.reward.fn == AUTO:
        cfg.reward.fn = train.reward
        parts.append(f"reward.fn={train.reward} (auto: the {train.label} schema's reward"
                     f"{'; reward.env scores instead' if cfg.reward.env else ''})")
    else:
        parts.append(f"reward.fn={cfg.reward.fn} (set in the config)")
    if d.instruction == "auto":
        parts.append(f"text prompts get {instruction_for(cfg, train)!r} (data.instruction auto"
                     f"{f', reward.env={cfg.reward.env}' if cfg.reward.env else ''})")
    d.choice = "; ".join(parts)


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def eval_sets(data) -> list[tuple[str, str]]:
    """``data.eval_paths`` as (name, path): 'NAME=PATH' as written, a bare path named by its file name
    without extension or shard pattern ('data/gsm8k/main/test-*.parquet' -> 'test')."""
    out = []
    for entry in data.eval_paths:
        name, sep, path = entry.partition("=")
        if not sep or not _NAME.fullmatch(name.strip()):
            path = entry
            stem = Path(entry.rstrip("/")).name
            name = re.split(r"[*?\[]|-\d{3,}|\.(?:jsonl|json|parquet)$", stem)[0].rstrip("-_.")
        out.append((name.strip(), path.strip()))
    return out


def eval_set_problems(data) -> list[str]:
    """data.eval_paths against data.eval_path, and its names: one line each, naming the knob."""
    if not data.eval_paths:
        return []
    out = []
    if data.eval_path:
        out.append(f"data.eval_paths and data.eval_path={data.eval_path!r} are both set: give every held-out set in "
                   f"data.eval_paths (the first is the headline eval/accuracy) and set data.eval_path=''")
    names = [n for n, _ in eval_sets(data)]
    for (name, path), entry in zip(eval_sets(data), data.eval_paths):
        if not _NAME.fullmatch(name) or not path:
            out.append(f"data.eval_paths: {entry!r} gives no usable name or path; write 'NAME=PATH' (NAME of letters, "
                       f"digits, '_', '-', '.')")
        elif names.count(name) > 1:
            out.append(f"data.eval_paths: two held-out sets are named {name!r} (metrics eval/{name}/...); name them, "
                       f"e.g. 'math500={path}'")
            names = [n for n in names if n != name]
    return out


def _here(source: str) -> bool:
    from megarl.data.sources import DataError, data_files

    if source == "builtin:arithmetic":
        return True
    try:
        data_files(source)
    except DataError:
        return False
    return True


def instruction_for(cfg, schema) -> str:
    """What a text prompt of ``schema`` gets appended: data.instruction, or the schema's own when auto."""
    if cfg.data.instruction != "auto":
        return cfg.data.instruction
    if cfg.reward.env:  # reward.env: the environment says how to call its tool (megarl/reward/environment.py)
        from megarl.reward.environment import environment_instruction

        return environment_instruction(cfg.reward.env) or schema.instruction
    return schema.instruction
