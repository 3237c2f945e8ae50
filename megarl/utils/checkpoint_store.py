"""The checkpoint folder, one owner: names, the step-folder index, atomic writes, staging, deletion.

A checkpoint folder (``trainer.checkpoint_dir``, or ``<run folder>/checkpoints``) holds::

    step_00000012/        a step folder: complete when its meta.json (the manifest, written last) parses and
                          every file it lists is there with its size and CRC32 (:func:`checkpoint_problem`)
    latest                the name of the newest complete step folder, written after it is in place
    .tmp_step_00000012/   a save being written (renamed to step_... when complete)
    .stage_step_00000012/ files the controller staged for that save (:func:`stage_file`), adopted by it
    .trash_step_.../      a step folder being replaced by a re-save of its step

Who deletes what: the trainer's save (rank 0, after it moved ``latest``) prunes older step folders, a step
folder after the one it saved (an abandoned timeline) and stages no save will adopt (:func:`prune`); the
controller, before any rank starts and only under ``logging.overwrite``, deletes the whole store
(:func:`delete_all`). Nothing else removes a file here. No torch: the controller reads the index before
any rank starts, and the trainer's save (megarl/trainer/checkpoint.py) writes through these names.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence

log = logging.getLogger("megarl.trainer.checkpoint")

FORMAT = "megarl-trainer-checkpoint-v1"
LATEST = "latest"
STEP_PREFIX = "step_"
META = "meta.json"
TMP_PREFIX = ".tmp_"      # a save being written
STAGE_PREFIX = ".stage_"  # files a save adopts into the step folder (the controller's state)
TRASH_PREFIX = ".trash_"  # a step folder a re-save of its step replaces
STRAY_PREFIXES = (TMP_PREFIX, STAGE_PREFIX, TRASH_PREFIX)
_CRC_CHUNK = 1 << 20  # bytes read per crc32 update


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model it is loaded into."""


class CheckpointNoSpace(CheckpointError):
    """A save ran out of disk: ``path``, ``needed`` and ``free`` bytes; the previous checkpoint is intact."""

    def __init__(self, path: Path, needed: int, free: int, step: int):
        self.path, self.needed, self.free = Path(path), int(needed), int(free)
        super().__init__(f"checkpoint: no space for step {step} at {path}: it needs about {needed} bytes "
                         f"({needed / 2**20:.1f} MiB), {free} are free; the previous checkpoint is intact. "
                         f"Free space there or set trainer.checkpoint_dir to a larger disk")


# ----------------------------------------------------------------------------- names and the index

def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step a step folder's name holds (``step_00000012`` -> 12), else None."""
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{TMP_PREFIX}{step_dir_name(step)}"


def stage_dir(root: str | Path, step: int) -> Path:
    """Where files for the step-``step`` checkpoint wait for the save that adopts them."""
    return Path(root) / f"{STAGE_PREFIX}{step_dir_name(step)}"


def step_folders(root: str | Path) -> list[Path]:
    """Every step folder under ``root``, complete or not, oldest step first (the one scan of the folder)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None),
                  key=lambda p: step_of(p.name))


def stray_folders(root: str | Path, prefix: str | None = None) -> list[Path]:
    """Folders a save left or will adopt (``prefix``: one of :data:`STRAY_PREFIXES`; None: all)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and any(
        p.name.startswith(x) and step_of(p.name[len(x):]) is not None for x in ([prefix] if prefix else STRAY_PREFIXES)))


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Step folders that have a meta.json (written last), oldest first; not verified."""
    return [p for p in step_folders(checkpoint_dir) if (p / META).is_file()]


def checkpoint_root(checkpoint_dir: str, run_dir: str | Path) -> Path:
    """``trainer.checkpoint_dir``, or <run dir>/checkpoints when it is ''."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


# ----------------------------------------------------------------------------- files

def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest(root: Path, known: Optional[dict[str, tuple[int, int]]] = None) -> tuple[dict, dict]:
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


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file beside ``path``, fsync, rename, fsync the folder: ``path`` is the old text or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def no_space(e: Optional[BaseException], _depth: int = 0) -> bool:
    """A full disk (ENOSPC, EDQUOT), also when megatron / torch DCP wrap it: their writer reports a
    worker's OSError as text inside a CheckpointException (its ``failures``, rank -> exception)."""
    if e is None or _depth > 8:
        return False
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(os.strerror(code) in str(e) for code in (errno.ENOSPC, errno.EDQUOT)):
        return True
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and any(no_space(f, _depth + 1) for f in failures.values()
                                          if isinstance(f, BaseException)):
        return True
    return no_space(e.__cause__ or e.__context__, _depth + 1)


def stage_file(checkpoint_dir: str | Path, step: int, name: str, text: str) -> Path:
    """Write ``name`` for the step-``step`` checkpoint before the trainer saves it (the controller's
    state): the save moves it into the step folder before writing the manifest, so the checkpoint is
    complete with it or not at all. Raises :class:`CheckpointNoSpace` on a full disk."""
    d = stage_dir(checkpoint_dir, step)
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_text_atomic(d / name, text)
    except OSError as e:
        if not no_space(e):
            raise
        shutil.rmtree(d, ignore_errors=True)
        raise CheckpointNoSpace(d, len(text.encode()), shutil.disk_usage(Path(checkpoint_dir)).free, step) from None
    return d / name


# ----------------------------------------------------------------------------- which checkpoint

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
                    checksums: bool = True, also: Optional[Callable[[Path], Optional[str]]] = None) -> Optional[Path]:
    """The newest complete step folder at or before the one `latest` names; None when the folder
    holds no checkpoint at all. Each newer one that is damaged is reported in one WARNING naming
    the file, and the previous one is tried; none complete raises :class:`CheckpointError`.
    ``also(step_dir)``: what else a step needs (e.g. the critic's checkpoint of it), a problem or None."""
    root = Path(checkpoint_dir)
    pointer = root / LATEST
    steps = step_folders(root)[::-1]
    problems = []
    if pointer.is_file():
        named = pointer.read_text().strip()
        limit = step_of(named)
        if limit is not None:  # a folder after `latest`: a save killed before it moved `latest`
            steps = [p for p in steps if step_of(p.name) <= limit]
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
        if problem is None and also is not None:
            problem = also(step_dir)
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


def resume_folder(resume_from: Optional[str], root: Path, *, require: Sequence[str] = (),
                  checksums: Optional[bool] = None,
                  also: Optional[Callable[[Path], Optional[str]]] = None) -> Optional[Path]:
    """The step folder ``trainer.resume_from`` asks for under checkpoint folder ``root``; None = start fresh.

    'auto' resumes from the newest complete checkpoint under ``root``, if there is one, and a checkpoint
    dir from its newest complete one (:func:`newest_complete`: a damaged newest one is reported and
    skipped). A step folder is taken as it is, or refused naming the damaged file. ``checksums``: also
    compare every file's CRC32 (default: for 'auto' and checkpoint dirs, not for an explicit step folder,
    which the controller has verified before the ranks start). ``also``: :func:`newest_complete`'s."""
    if resume_from in (None, ""):
        return None
    if resume_from == "auto":
        return newest_complete(root, require=require, checksums=True if checksums is None else checksums, also=also)
    p = Path(resume_from)
    if (p / META).is_file():
        problem = checkpoint_problem(p, checksums=bool(checksums))
        if problem:
            raise CheckpointError(f"trainer.resume_from={resume_from}: {problem}; resume from another "
                                  f"step folder or from the checkpoint dir {p.parent} (its newest complete one)")
        return p
    if (p / LATEST).is_file() or list_checkpoints(p):
        return newest_complete(p, require=require, checksums=True if checksums is None else checksums, also=also)
    return resolve_checkpoint(p)  # raises, naming what is wrong


# ----------------------------------------------------------------------------- deletion

def prune(root: Path, saved: Path, keep_last: int, later_stages_since: Optional[float] = None) -> None:
    """The trainer's save, after ``latest`` names ``saved``: keep the newest ``keep_last`` step folders up
    to it; folders after it were left by a run that resumed from an earlier checkpoint (a timeline that
    was abandoned) and go too, as do the temp and trash folders of saves that did not finish.

    Staged controller states go too, except, for an asynchronous save (``later_stages_since``: the
    wall time its snapshot was taken), a later step's staged after that time: the next save's,
    staged while this one was written. An abandoned timeline's stages are older than the snapshot
    (they precede the resume); the next save's is at least one training step newer, so a clock
    skew between the controller's and this host below a step's time cannot confuse the two."""
    mine = step_of(saved.name)
    steps = step_folders(root)
    for p in steps:
        if step_of(p.name) > mine:
            log.info("checkpoint: removing %s (after the resumed step; not this run's)", p.name)
            shutil.rmtree(p, ignore_errors=True)
    older = [p for p in steps if step_of(p.name) < mine]
    for old in older[:max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    # A killed save's temp folder (a preemption's off-schedule step, cut by the grace's SIGKILL: close to a
    # whole checkpoint) and a killed re-save's trash: never this save's (renamed into place above, and
    # the next save starts writing only after this commit), and nothing else clears them.
    for d in stray_folders(root, TMP_PREFIX) + stray_folders(root, TRASH_PREFIX):
        log.info("checkpoint: removing %s (left by a save that did not finish)", d.name)
        shutil.rmtree(d, ignore_errors=True)
    for d in stray_folders(root, STAGE_PREFIX):  # staged for a save that never happened
        staged = step_of(d.name[len(STAGE_PREFIX):])
        try:
            next_save = (later_stages_since is not None and staged is not None and staged > mine
                         and d.stat().st_mtime >= later_stages_since)
        except FileNotFoundError:
            continue  # adopted or removed meanwhile
        if not next_save:
            shutil.rmtree(d, ignore_errors=True)


def delete_all(root: Path) -> None:
    """The controller's ``logging.overwrite``, before any rank starts: every step folder, every stray
    folder and ``latest``; other files in ``root`` are left alone."""
    for p in step_folders(root) + stray_folders(root):
        shutil.rmtree(p, ignore_errors=True)
    (Path(root) / LATEST).unlink(missing_ok=True)


__all__ = ["CheckpointError", "CheckpointNoSpace", "FORMAT", "LATEST", "META", "STAGE_PREFIX", "STEP_PREFIX",
           "STRAY_PREFIXES", "TMP_PREFIX", "TRASH_PREFIX", "checkpoint_problem", "checkpoint_root", "delete_all",
           "file_crc32", "fsync_dir", "fsync_tree", "latest_checkpoint", "list_checkpoints", "manifest",
           "newest_complete", "no_space", "prune", "resolve_checkpoint", "resume_folder", "stage_dir", "stage_file",
           "step_dir_name", "step_folders", "step_of", "stray_folders", "tmp_dir", "tree_bytes", "write_text_atomic"]
