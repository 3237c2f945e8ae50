"""The checkpoint's file mechanics: fsync, atomic text writes, full-disk detection, the source HF
folder's extra files, and the CRCs an asynchronous writer records for its own shard files (so the
commit, which runs on the trainer's step, does not read the shards again)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from megarl.trainer.checkpoint_index import file_crc32

_HF_EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_NOT_EXTRA = {"config.json", "model.safetensors.index.json"}
SHARD_CRC_PREFIX = ".shard_crc_rank_"  # <step tmp>/.shard_crc_rank_<rank>.json: {relpath: [size, crc32]}


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _no_space(e: Optional[BaseException], _depth: int = 0) -> bool:
    """A full disk (ENOSPC, EDQUOT), also when megatron / torch DCP wrap it: their writer reports a
    worker's OSError as text inside a CheckpointException (its ``failures``, rank -> exception)."""
    if e is None or _depth > 8:
        return False
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(os.strerror(code) in str(e) for code in (errno.ENOSPC, errno.EDQUOT)):
        return True
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and any(_no_space(f, _depth + 1) for f in failures.values()
                                          if isinstance(f, BaseException)):
        return True
    return _no_space(e.__cause__ or e.__context__, _depth + 1)


def copy_hf_extra(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy an HF folder's tokenizer / generation-config / chat-template files (not config.json,
    not weights) into dst_dir; returns the names copied."""
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    names = []
    for f in sorted(Path(src_dir).iterdir()):
        if f.is_file() and f.suffix in _HF_EXTRA_SUFFIXES and f.name not in _NOT_EXTRA:
            shutil.copy2(f, dst / f.name)
            names.append(f.name)
    return names


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def record_shard_crcs(tmp: Path, rank: int) -> Path:
    """In the writer, after its shards are on disk: (size, crc32) of this rank's shard files
    (megatron names them ``dist/__<rank>_<n>.distcp``), written atomically beside them."""
    rows = {p.relative_to(tmp).as_posix(): [p.stat().st_size, file_crc32(p)]
            for p in sorted((tmp / "dist").glob(f"__{rank}_*")) if p.is_file()}
    out = tmp / f"{SHARD_CRC_PREFIX}{rank:05d}.json"
    write_text_atomic(out, json.dumps(rows))
    return out


def known_shard_crcs(tmp: Path) -> dict[str, tuple[int, int]]:
    """At the commit: every rank's recorded (size, crc32) by relative path; the record files are
    removed (they are not part of the checkpoint). A file whose size changed since is not trusted
    by :func:`megarl.trainer.checkpoint_index._manifest`, which reads it again."""
    known: dict[str, tuple[int, int]] = {}
    for f in sorted(tmp.glob(f"{SHARD_CRC_PREFIX}*.json")):
        known.update({k: (int(v[0]), int(v[1])) for k, v in json.loads(f.read_text()).items()})
        f.unlink()
    return known
