"""The data decides what it can: each data file's row schema, and ``reward.fn: auto``.

Run by the loader after validation (so every file is known readable): recognises the schema of
``data.train_path`` and ``data.eval_path`` from their first rows (megarl/data/schemas.py), sets
``reward.fn`` to the training data's schema reward when it is ``auto`` (an explicit value wins), and
records all of it, with the keys and rows it came from, in ``data.choice``, which the run logs in its
first lines and ``megarl train --dry-run`` prints.
"""

from __future__ import annotations

from megarl.data.tasks import source_schema
from megarl.reward.config import AUTO


def apply_data_choice(cfg) -> None:
    """Resolve ``reward.fn: auto`` from the training data and write ``data.choice``."""
    d = cfg.data
    keys = {"prompt_key": d.prompt_key, "answer_key": d.answer_key}
    train, where = source_schema(d.train_path, **keys)
    parts = [f"data.train_path: {train.describe()}, recognised from {where}"]
    if d.eval_path:
        held, held_where = source_schema(d.eval_path, **keys)
        parts.append(f"data.eval_path: {held.describe()}, recognised from {held_where}")
    if cfg.reward.fn == AUTO:
        cfg.reward.fn = train.reward
        parts.append(f"reward.fn={train.reward} (auto: the {train.label} schema's reward)")
    else:
        parts.append(f"reward.fn={cfg.reward.fn} (set in the config)")
    if d.instruction == "auto":
        parts.append(f"text prompts get {train.instruction!r} (data.instruction auto)")
    d.choice = "; ".join(parts)


def instruction_for(cfg, schema) -> str:
    """What a text prompt of ``schema`` gets appended: data.instruction, or the schema's own when auto."""
    return schema.instruction if cfg.data.instruction == "auto" else cfg.data.instruction
