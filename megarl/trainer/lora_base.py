"""Which base a LoRA checkpoint's adapters train on (trainer.lora_rank > 0): what a checkpoint records about
them (rank, alpha, targets, the base folder and a content hash of its weights), and the refusal to load them
into a model with another LoRA setting or other base weights (megarl/trainer/checkpoint.py calls both)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megarl.trainer.model import unwrap
from megarl.utils.checkpoint_store import CheckpointError

WEIGHT_FILES = (".safetensors", ".bin")  # the files of an HF folder that hold its weights


def _file_sha256(f: Path) -> str:
    """sha256 of a file's bytes. A file of the HF hub cache (``snapshots/<rev>/x -> ../../blobs/<sha256>``) is
    named by the sha256 of its content (git-lfs's oid): taken from the name, nothing read."""
    import hashlib

    target = f.resolve()
    if f.is_symlink() and target.parent.name == "blobs" and len(target.name) == 64 \
            and all(c in "0123456789abcdef" for c in target.name):
        return target.name
    h = hashlib.sha256()
    with open(target, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


_BASE_HASHES: dict[tuple, str] = {}


def base_hash(path: str | Path) -> str:
    """A content hash of a base model's weights: sha256 over ``<file name> <file sha256>`` lines of its
    weight files (an HF folder's top-level *.safetensors / *.bin; a folder without them, e.g. a megarl
    Megatron checkpoint: every file under it but *.json), so a copy of the same files elsewhere has the
    same hash and a changed weight file another. Memoized per process on (path, names, sizes, mtimes)."""
    import hashlib

    root = Path(path)
    files = sorted(f for f in root.iterdir() if f.is_file() and f.name.endswith(WEIGHT_FILES))
    if not files:
        files = sorted(f for f in root.rglob("*") if f.is_file() and not f.name.endswith(".json"))
    if not files:
        raise CheckpointError(f"{root}: no weight files to name the LoRA base by")
    k = (str(root.resolve()), *((str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if k not in _BASE_HASHES:
        lines = "".join(f"{f.relative_to(root)} {_file_sha256(f)}\n" for f in files)
        _BASE_HASHES[k] = hashlib.sha256(lines.encode()).hexdigest()
    return _BASE_HASHES[k]


def lora_meta(model: torch.nn.Module, base_from: str | Path | None = None) -> Optional[dict]:
    """What a checkpoint of a LoRA model (trainer.lora_rank > 0) records about its adapters: rank, alpha,
    targets and the base they train on (the folder the model's weights came from, ``load_pretrained``, else
    ``base_from``; and :func:`base_hash` of its weights). None for full fine-tuning."""
    m = unwrap(model)
    lora = getattr(m, "megarl_lora", None)
    if lora is None:
        return None
    src = getattr(m, "megarl_source", None) or base_from
    base = {"path": str(Path(src).resolve()), "sha256": base_hash(src)} if src is not None else None
    return {**lora, "base": base}


def check_lora(meta: dict, model: torch.nn.Module, step_dir: Path) -> None:
    """Refuse (CheckpointError, saying what to change) to load a checkpoint into a model whose LoRA setting
    or base differs from the one it was saved with."""
    saved, now = meta.get("lora"), getattr(unwrap(model), "megarl_lora", None)
    knobs = lambda lo: (f"trainer.lora_rank={lo['rank']} trainer.lora_alpha={lo['alpha']:g} "  # noqa: E731
                        f"trainer.lora_targets=[{','.join(lo['targets'])}]")
    if saved is None and now is None:
        return
    if saved is None:
        raise CheckpointError(f"{step_dir} is a full fine-tuning checkpoint (no LoRA adapters); this job trains LoRA "
                              f"adapters ({knobs(now)}): set trainer.lora_rank=0 to resume it, or export it "
                              f"(megarl convert mcore-to-hf) and train LoRA on it as model.path")
    if now is None or (saved["rank"], saved["targets"]) != (now["rank"], now["targets"]):
        have = "trains every weight (trainer.lora_rank=0)" if now is None else f"has {knobs(now)}"
        raise CheckpointError(f"{step_dir} holds LoRA adapters ({knobs(saved)}); this job {have}: set "
                              f"{knobs(saved)} to resume it")
    src = getattr(unwrap(model), "megarl_source", None)
    if saved.get("base") is None or src is None:
        return  # a checkpoint that did not name its base, or a model not loaded from a folder (convert)
    if base_hash(src) != saved["base"]["sha256"]:
        raise CheckpointError(
            f"{step_dir} holds LoRA adapters trained on the base {saved['base']['path']} (weights sha256 "
            f"{saved['base']['sha256'][:16]}...); this job's model.path {Path(src).resolve()} has other weights "
            f"(sha256 {base_hash(src)[:16]}...). Adapters on another base compute another policy: set "
            f"model.path={saved['base']['path']} (or a folder with the same weight files) to resume them")


__all__ = ["WEIGHT_FILES", "base_hash", "lora_meta", "check_lora"]
