"""Which checkpoint: step folders, the `latest` pointer, the manifest check, and where a run resumes.

A step folder is complete when its ``meta.json`` (written last by a save) parses and every file of
its manifest is there with its size and CRC32 (:func:`checkpoint_problem`). :func:`resume_path`
turns ``trainer.resume_from`` into the step folder to load, skipping a damaged newest checkpoint
with one WARNING naming the file (:func:`newest_complete`). No torch here: the controller picks
the folder before any rank starts. Saving and loading: :mod:`megarl.trainer.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from megarl.trainer.config import TrainerConfig

log = logging.getLogger("megarl.trainer.checkpoint")

FORMAT = "megarl-trainer-checkpoint-v1"
LATEST = "latest"
STEP_PREFIX = "step_"
META = "meta.json"
_CRC_CHUNK = 1 << 20  # bytes read per crc32 update


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model it is loaded into."""


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _manifest(root: Path, known: Optional[dict[str, tuple[int, int]]] = None) -> tuple[dict, dict]:
    """(size, crc32) of every file under ``root`` but meta.json, by relative path. ``known``: CRCs
    taken already (an async writer's, of its own shards), used where the size still matches."""
    known = known or {}
    sizes, crcs = {}, {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or rel == META:
            continue
        sizes[rel] = p.stat().st_size
        crcs[rel] = known[rel][1] if rel in known and known[rel][0] == sizes[rel] else file_crc32(p)
    return sizes, crcs


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Step folders that have a meta.json (written last), oldest first; not verified."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if (p / META).is_file())


def _step_of(name: str) -> Optional[int]:
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def latest_checkpoint(checkpoint_dir: str | Path) -> Optional[Path]:
    """The folder `latest` names, or None when the directory has no checkpoint yet."""
    root = Path(checkpoint_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    target = root / pointer.read_text().strip()
    if not (target / META).is_file():
        raise CheckpointError(f"{pointer} names {target.name}, which is not a complete checkpoint "
                              f"(no meta.json); point `latest` at one of "
                              f"{[p.name for p in list_checkpoints(root)]} or remove it")
    return target


def checkpoint_problem(step_dir: str | Path, *, checksums: bool = True, require: Sequence[str] = ()) -> Optional[str]:
    """Why ``step_dir`` is not a complete checkpoint, naming the file; None when it is.

    Complete: meta.json parses, and every file of its manifest is there with its size (and, with
    ``checksums``, its CRC32; checkpoints of older megarl have sizes only). ``require``: files that
    must be in the manifest (the controller requires its ``controller_state.json``)."""
    step_dir = Path(step_dir)
    meta_path = step_dir / META
    if not meta_path.is_file():
        return f"{meta_path} is missing (the save did not finish)"
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{meta_path} is corrupt ({e})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"{meta_path} has format {meta.get('format') if isinstance(meta, dict) else None!r}; expected {FORMAT!r}"
    files, crcs = meta.get("files") or {}, (meta.get("crc32") or {}) if checksums else {}
    for rel in require:
        if rel not in files:
            return f"{step_dir / rel} is missing (the checkpoint was saved without it)"
    for rel, size in files.items():
        f = step_dir / rel
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} is truncated or damaged: {f.stat().st_size} bytes, the manifest says {size}"
        if rel in crcs:
            got = file_crc32(f)
            if got != crcs[rel]:
                return f"{f} is corrupt: CRC32 {got:08x}, the manifest says {crcs[rel]:08x}"
    return None


def newest_complete(checkpoint_dir: str | Path, *, require: Sequence[str] = (),
                    checksums: bool = True) -> Optional[Path]:
    """The newest complete step folder at or before the one `latest` names; None when the folder
    holds no checkpoint at all. Each newer one that is damaged is reported in one WARNING naming
    the file, and the previous one is tried; none complete raises :class:`CheckpointError`."""
    root = Path(checkpoint_dir)
    pointer = root / LATEST
    steps = sorted((p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and _step_of(p.name) is not None),
                   key=lambda p: _step_of(p.name), reverse=True) if root.is_dir() else []
    problems = []
    if pointer.is_file():
        named = pointer.read_text().strip()
        limit = _step_of(named)
        if limit is not None:  # a folder after `latest`: a save killed before it moved `latest`
            steps = [p for p in steps if _step_of(p.name) <= limit]
            if not (root / named).is_dir():
                problems.append(f"{pointer} names {named}, which does not exist")
                log.warning("checkpoint: %s; falling back to the previous checkpoint", problems[-1])
        else:
            problems.append(f"{pointer} holds {named[:40]!r}, not a step folder name")
            log.warning("checkpoint: %s; using the newest complete step folder", problems[-1])
    elif not steps:
        return None
    for step_dir in steps:
        problem = checkpoint_problem(step_dir, checksums=checksums, require=require)
        if problem is None:
            if problems:
                log.warning("checkpoint: resuming from %s, the newest complete checkpoint", step_dir)
            return step_dir
        problems.append(problem)
        log.warning("checkpoint: %s is not complete: %s; falling back to the previous checkpoint",
                    step_dir.name, problem)
    raise CheckpointError(f"no complete checkpoint under {root}: {'; '.join(problems) or 'no step folder'}. "
                          f"Resume from an earlier step folder by path, or start fresh (trainer.resume_from=null)")


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, or a checkpoint dir (its `latest`), as the step folder to load."""
    p = Path(path)
    if (p / META).is_file():
        return p
    if (p / LATEST).is_file():
        return latest_checkpoint(p)  # type: ignore[return-value]
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    raise CheckpointError(f"{p} is not a megarl checkpoint: no meta.json (a step folder) and no "
                          f"`{LATEST}` file (a checkpoint dir)")


def checkpoint_root(cfg: "TrainerConfig", run_dir: str | Path) -> Path:
    """trainer.checkpoint_dir, or <run dir>/checkpoints when it is ''."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(run_dir) / "checkpoints"


def resume_path(cfg: "TrainerConfig", run_dir: str | Path, *, require: Sequence[str] = (),
                checksums: Optional[bool] = None) -> Optional[Path]:
    """The step folder trainer.resume_from asks for; None = start fresh.

    'auto' resumes from the newest complete checkpoint under checkpoint_root, if there is one, and
    a checkpoint dir from its newest complete one (:func:`newest_complete`: a damaged newest one is
    reported and skipped). A step folder is taken as it is, or refused naming the damaged file.
    ``checksums``: also compare every file's CRC32 (default: for 'auto' and checkpoint dirs, not for
    an explicit step folder, which the controller has verified before the ranks start)."""
    if cfg.resume_from in (None, ""):
        return None
    if cfg.resume_from == "auto":
        return newest_complete(checkpoint_root(cfg, run_dir), require=require,
                               checksums=True if checksums is None else checksums)
    p = Path(cfg.resume_from)
    if (p / META).is_file():
        problem = checkpoint_problem(p, checksums=bool(checksums))
        if problem:
            raise CheckpointError(f"trainer.resume_from={cfg.resume_from}: {problem}; resume from another "
                                  f"step folder or from the checkpoint dir {p.parent} (its newest complete one)")
        return p
    if (p / LATEST).is_file() or list_checkpoints(p):
        return newest_complete(p, require=require, checksums=True if checksums is None else checksums)
    return resolve_checkpoint(p)  # raises, naming what is wrong


def should_save(cfg: "TrainerConfig", step: int, last_step: int) -> bool:
    """Save after `step` (1-based count of finished steps)? Every checkpoint_interval steps (0 = off)
    and always after the last step."""
    every = cfg.checkpoint_interval
    return step == last_step or (every > 0 and step % every == 0)


__all__ = ["CheckpointError", "FORMAT", "LATEST", "META", "STEP_PREFIX", "checkpoint_problem", "checkpoint_root",
           "file_crc32", "latest_checkpoint", "list_checkpoints", "newest_complete", "resolve_checkpoint",
           "resume_path", "should_save", "step_dir_name"]
