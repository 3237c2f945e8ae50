"""The distillation teacher's checks before anything starts (``algorithm.teacher``).

On-policy distillation compares the teacher's and the student's logprobs of the same token ids,
so the two tokenizers must be the same: vocabulary (token -> id), added tokens and the special
tokens (bos/eos/pad/unk). A mismatch is refused in one line naming what differs. Torch-free: it
reads ``tokenizer.json`` and ``tokenizer_config.json`` of both HF folders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def teacher_dir(path: str) -> Path:
    """The folder ``algorithm.teacher`` names here: a folder, or an HF id's snapshot in the local HF
    cache (as model.path); the path itself when neither is here."""
    from megarl.utils.model_source import local_model_dir

    return local_model_dir(path) or Path(path)


def _special(value) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_identity(folder: Path) -> dict:
    """What must agree between two tokenizers: ``vocab`` (token -> id, added tokens included) and the
    special tokens of ``tokenizer_config.json``. Raises ValueError when the folder has no tokenizer.json."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    data = json.loads(path.read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    if isinstance(data.get("model", {}).get("vocab"), list):  # unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(data["model"]["vocab"])}
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return {"vocab": vocab, "special": {k: _special(config.get(k)) for k in SPECIAL_KEYS}}


def tokenizer_mismatch(policy_dir: Path, teacher_dir: Path) -> Optional[str]:
    """None when the two folders' tokenizers agree; else one line saying what differs."""
    try:
        mine, theirs = tokenizer_identity(policy_dir), tokenizer_identity(teacher_dir)
    except ValueError as e:
        return str(e)
    parts = []
    a, b = mine["vocab"], theirs["vocab"]
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        token = differ[0][0]
        parts.append(f"vocab: {len(a)} vs {len(b)} tokens, {len({t for t, _ in differ})} differ (e.g. {token!r}: id "
                     f"{a.get(token)} vs {b.get(token)})")
    special = [f"{k} {mine['special'][k]!r} vs {theirs['special'][k]!r}" for k in SPECIAL_KEYS
               if mine["special"][k] != theirs["special"][k]]
    if special:
        parts.append("special tokens: " + ", ".join(special))
    return "; ".join(parts) or None


def teacher_problems(algo, policy_dir: Optional[Path], *, dry_run: bool = False) -> list[str]:
    """``algorithm.teacher`` is an HF folder whose tokenizer is the policy's (``policy_dir``: the
    model.path folder, None when it is not here). ``dry_run``: a teacher folder not here is no problem."""
    if not algo.teacher or not algo.distill_coef > 0:
        return []
    teacher = teacher_dir(algo.teacher)
    if not (teacher / "config.json").is_file():
        if dry_run and not teacher.exists():
            return []
        return [f"algorithm.teacher={algo.teacher!r}: no config.json there; point it at the teacher's HF folder"]
    if policy_dir is None:
        return []
    why = tokenizer_mismatch(policy_dir, teacher)
    if why:
        return [f"algorithm.teacher={algo.teacher!r}: its tokenizer is not model.path's ({why}); distillation "
                f"compares logprobs of the same token ids, so use a teacher with the policy's tokenizer"]
    return []
