"""megarl/utils/checkpoint_store.py: the checkpoint folder's one owner (names, the step-folder index,
atomic writes, staging, who deletes what), torch-free, used by the trainer's save and the controller's
run folder alike. Real files in tmp_path; no process is started (the torch-free check aside)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.utils import checkpoint_store as store


def _complete(root: Path, step: int, payload: bytes = b"weights") -> Path:
    """A complete step folder as a save leaves it: a file, and meta.json with its size and CRC32 (last)."""
    d = root / store.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(payload)
    files, crcs = store.manifest(d)
    store.write_text_atomic(d / store.META, json.dumps({"format": store.FORMAT, "step": step, "files": files,
                                                        "crc32": crcs}))
    return d


def test_the_store_imports_no_torch():
    code = "import sys, megarl.utils.checkpoint_store, megarl.trainer.checkpoint_index; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_one_index_of_step_folders_and_strays(tmp_path):
    for step in (10, 2, 9):
        _complete(tmp_path, step)
    (tmp_path / "step_notes").mkdir()  # not a step number: not a step folder
    (tmp_path / "step_00000011").write_text("a file, not a folder")
    for prefix in store.STRAY_PREFIXES:
        (tmp_path / f"{prefix}{store.step_dir_name(11)}").mkdir()
    (tmp_path / ".tmp_other").mkdir()  # a stray prefix without a step folder name: not the store's
    assert [p.name for p in store.step_folders(tmp_path)] == ["step_00000002", "step_00000009", "step_00000010"]
    assert [p.name for p in store.stray_folders(tmp_path)] == [".stage_step_00000011", ".tmp_step_00000011",
                                                               ".trash_step_00000011"]
    assert store.stray_folders(tmp_path, store.STAGE_PREFIX) == [store.stage_dir(tmp_path, 11)]
    assert store.tmp_dir(tmp_path, 11).is_dir() and store.step_of("step_00000011") == 11
    assert store.step_folders(tmp_path / "missing") == [] and store.stray_folders(tmp_path / "missing") == []


def test_overwrite_deletes_the_store_and_nothing_else(tmp_path):
    """The controller's deletion right (logging.overwrite): every step folder, stray and `latest`."""
    _complete(tmp_path, 1)
    (tmp_path / store.LATEST).write_text("step_00000001\n")
    store.stage_file(tmp_path, 2, "controller_state.json", "{}")
    store.tmp_dir(tmp_path, 2).mkdir()
    (tmp_path / "README.txt").write_text("the user's")
    (tmp_path / ".tmp_other").mkdir()
    store.delete_all(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_other", "README.txt"]


def test_prune_keeps_the_newest_and_drops_an_abandoned_timeline(tmp_path):
    """The trainer's deletion right, after `latest` names step 5 (a run resumed at 4 and saved 5): step 7
    of the abandoned timeline goes, keep_last=2 keeps 4 and 5, a stage of a save that never happened
    goes; an async save keeps the next save's stage, staged after its snapshot."""
    for step in (3, 4, 7):
        _complete(tmp_path, step)
    saved = _complete(tmp_path, 5)
    store.stage_file(tmp_path, 1, "controller_state.json", "{}")  # never adopted
    nxt = store.stage_file(tmp_path, 6, "controller_state.json", "{}").parent
    store.prune(tmp_path, saved, keep_last=2, later_stages_since=nxt.stat().st_mtime)
    assert [p.name for p in store.step_folders(tmp_path)] == ["step_00000004", "step_00000005"]
    assert store.stray_folders(tmp_path) == [nxt]


def test_atomic_text_and_staging(tmp_path):
    target = tmp_path / "latest"
    store.write_text_atomic(target, "step_00000001")
    store.write_text_atomic(target, "step_00000002")
    assert target.read_text() == "step_00000002" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    path = store.stage_file(tmp_path, 3, "controller_state.json", '{"a": 1}')
    assert path == tmp_path / ".stage_step_00000003" / "controller_state.json" and json.loads(path.read_text()) == {"a": 1}


def test_resume_takes_the_newest_complete_and_names_the_damage(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _complete(root, 1)
    newest = _complete(root, 2, payload=b"good bytes")
    (root / store.LATEST).write_text(newest.name)
    assert store.resume_folder("auto", root) == newest
    (newest / "w.bin").write_bytes(b"bad  bytes")  # same size, other CRC32
    assert store.resume_folder("auto", root) == root / "step_00000001"
    assert "w.bin is corrupt: CRC32" in caplog.text
    assert store.resume_folder(None, root) is None and store.resume_folder("auto", tmp_path / "none") is None
    with pytest.raises(store.CheckpointError, match="w.bin is corrupt"):
        store.resume_folder(str(newest), root, checksums=True)
    assert store.checkpoint_root("", tmp_path) == tmp_path / "checkpoints"
    assert store.checkpoint_root("/ckpt", tmp_path) == Path("/ckpt")
