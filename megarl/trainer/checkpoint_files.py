"""The trainer checkpoint's own files: the source HF folder's extra files, and the CRCs an asynchronous
writer records for its own shard files (so the commit, which runs on the trainer's step, does not read
the shards again). fsync, atomic writes and full-disk detection: megarl/utils/checkpoint_store.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megarl.utils.checkpoint_store import file_crc32, write_text_atomic

_HF_EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_NOT_EXTRA = {"config.json", "model.safetensors.index.json"}
SHARD_CRC_PREFIX = ".shard_crc_rank_"  # <step tmp>/.shard_crc_rank_<rank>.json: {relpath: [size, crc32]}


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
    by :func:`megarl.utils.checkpoint_store.manifest`, which reads it again."""
    known: dict[str, tuple[int, int]] = {}
    for f in sorted(tmp.glob(f"{SHARD_CRC_PREFIX}*.json")):
        known.update({k: (int(v[0]), int(v[1])) for k, v in json.loads(f.read_text()).items()})
        f.unlink()
    return known
