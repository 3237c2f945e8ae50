"""Damaged checkpoints, a kill between the trainer's save and the controller's state, a full disk,
retention: a real tiny Megatron trainer (one rank) saves; the files are then damaged on disk and
resume must name the damaged file once and fall back to the previous complete checkpoint."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megarl.utils.dist import run_multiprocess

CONTROLLER_STATE = "controller_state.json"


def _objects(hf_dir: str):
    """Model + optimizer of the tiny model after one real optimizer step (Adam state exists)."""
    import torch

    from megarl.batch import RolloutBatch
    from megarl.models.layouts import ModelDims
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=1)
    model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)))
    load_hf_into_model(model, hf_dir)
    objs = build_training(TrainerConfig(lr=1e-4), model, total_steps=4)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 1000, (8,), generator=g).tolist() for _ in range(2)]
    batch = RolloutBatch.from_sequences(tokens, [[0.0] * 2 + [1.0] * 6] * 2, behav_logprobs=[[-1.0] * 8] * 2,
                                        advantages=[1.0, -1.0], versions=[[0] * 8] * 2)
    train_step(objs, batch, loss_name="aipo", loss_params={"rho": 2.0}, micro_batch_size=2, current_version=0)
    return objs


def _save_worker(rank, world, hf_dir, root, steps, staged_steps, keep):
    """Save ``steps`` under ``root``; for ``staged_steps`` stage the controller's state first."""
    import time

    from megarl.trainer.checkpoint import TrainProgress, save_checkpoint, stage_file

    objs = _objects(hf_dir)
    out = {}
    for step in steps:
        if step in staged_steps:
            stage_file(root, step, CONTROLLER_STATE, json.dumps({"policy_version": step}))
        t0 = time.monotonic()
        path = save_checkpoint(root, model=objs.model, optimizer=objs.optimizer, scheduler=objs.scheduler,
                               progress=TrainProgress(step=step, consumed_samples=2 * step), keep_last=keep)
        out[step] = {"seconds": time.monotonic() - t0,
                     "bytes": sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())}
    return out


def _full_disk_worker(rank, world, hf_dir, root):
    """Step 1 fits; step 2 is refused before writing (free space < the previous checkpoint); with
    that check defeated, step 3 runs into ENOSPC while writing. Both leave step 1 as it was."""
    from megarl.trainer import checkpoint as ck

    objs = _objects(hf_dir)
    save = dict(model=objs.model, optimizer=objs.optimizer, scheduler=objs.scheduler)
    ck.save_checkpoint(root, progress=ck.TrainProgress(step=1), **save)
    out = {"free_after_1": shutil.disk_usage(root).free}
    for step, precheck in ((2, True), (3, False)):
        if not precheck:
            ck._free_bytes = lambda root: 1 << 50  # as if the disk filled up after the check
        ck.stage_file(root, step, CONTROLLER_STATE, "{}")
        try:
            ck.save_checkpoint(root, progress=ck.TrainProgress(step=step), **save)
            out[step] = None
        except ck.CheckpointNoSpace as e:
            out[step] = {"msg": str(e), "needed": e.needed, "free": e.free, "path": str(e.path),
                         "left": sorted(p.name for p in Path(root).iterdir())}
    return out


@pytest.fixture(scope="module")
def saved(tiny_llama_tied_dir, tmp_path_factory):
    """Steps 1..3 saved with keep 2 (step 1 pruned); steps 2 and 3 carry the controller's state."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    (res,) = run_multiprocess(_save_worker, 1, str(tiny_llama_tied_dir), str(root), [1, 2, 3], [2, 3], 2,
                              timeout_s=600)
    return root, res


def _copy(saved, tmp_path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved[0], root)
    return root


def test_manifest_has_a_checksum_per_file_and_covers_the_controller_state(saved):
    from megarl.trainer.checkpoint import checkpoint_problem, file_crc32

    root, res = saved
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]  # keep 2
    assert (root / "latest").read_text() == "step_00000003"
    meta = json.loads((root / "step_00000003" / "meta.json").read_text())
    assert set(meta["files"]) == set(meta["crc32"])
    assert CONTROLLER_STATE in meta["files"] and any(k.startswith("dist/") for k in meta["files"])
    for rel, crc in meta["crc32"].items():
        assert file_crc32(root / "step_00000003" / rel) == crc, rel
    assert json.loads((root / "step_00000003" / CONTROLLER_STATE).read_text()) == {"policy_version": 3}
    assert not list(root.glob(".stage_*")) and not list(root.glob(".tmp_*"))
    assert checkpoint_problem(root / "step_00000003", require=(CONTROLLER_STATE,)) is None
    print({s: (round(r["seconds"], 2), r["bytes"]) for s, r in res.items()})  # time, size per save


def _damage_flip(step: Path) -> str:
    shard = max((p for p in (step / "dist").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    return str(shard)


def _damage_truncate(step: Path) -> str:
    shard = max((p for p in (step / "dist").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 3)
    return str(shard)


def _damage_no_controller_state(step: Path) -> str:
    """A kill between `latest` and controller_state.json, as the save before the manifest covered it."""
    (step / CONTROLLER_STATE).unlink()
    return str(step / CONTROLLER_STATE)


def _damage_meta(step: Path) -> str:
    meta = step / "meta.json"
    meta.write_text(meta.read_text()[:100])
    return str(meta)


@pytest.mark.parametrize("damage", [_damage_flip, _damage_truncate, _damage_no_controller_state, _damage_meta],
                         ids=["corrupt", "truncated", "no-controller-state", "meta-cut"])
def test_damaged_latest_falls_back_with_one_warning_naming_the_file(saved, tmp_path, caplog, damage):
    from megarl.trainer.checkpoint import resume_path
    from megarl.trainer.config import TrainerConfig

    root = _copy(saved, tmp_path)
    victim = damage(root / "step_00000003")
    cfg = TrainerConfig(resume_from="auto", checkpoint_dir=str(root))
    with caplog.at_level(logging.WARNING):
        got = resume_path(cfg, tmp_path, require=(CONTROLLER_STATE,))
    assert got == root / "step_00000002"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = [w for w in warnings if victim in w]
    assert len(named) == 1, warnings
    assert "falling back to the previous checkpoint" in named[0]


def test_resume_after_a_fallback_with_nothing_left_is_an_error(saved, tmp_path):
    from megarl.trainer.checkpoint import CheckpointError, resume_path
    from megarl.trainer.config import TrainerConfig

    root = _copy(saved, tmp_path)
    _damage_flip(root / "step_00000003")
    _damage_truncate(root / "step_00000002")
    with pytest.raises(CheckpointError, match="no complete checkpoint under .*is corrupt.*is truncated"):
        resume_path(TrainerConfig(resume_from="auto", checkpoint_dir=str(root)), tmp_path)
    # an explicit step folder is taken as it is, or refused naming the file (no silent fallback)
    with pytest.raises(CheckpointError, match="step_00000002/dist/.* is truncated"):
        resume_path(TrainerConfig(resume_from=str(root / "step_00000002")), tmp_path)


def test_pin_resume_gives_every_process_the_same_verified_folder(saved, tmp_path):
    from megarl.config import ConfigError, load_config
    from megarl.controller.state import pin_resume

    root = _copy(saved, tmp_path)
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml",
                      [f"trainer.checkpoint_dir={root}", "trainer.resume_from=auto",
                       "model.path=builtin:smollm2"])
    assert pin_resume(cfg, tmp_path) == root / "step_00000003"
    assert cfg.trainer.resume_from == "auto"  # the input config is left as written (the job holds the folder)
    _damage_no_controller_state(root / "step_00000003")
    assert pin_resume(cfg, tmp_path) == root / "step_00000002"
    _damage_meta(root / "step_00000002")
    with pytest.raises(ConfigError, match="trainer.resume_from='auto': no complete checkpoint"):
        pin_resume(cfg, tmp_path)
    fresh = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml",
                        [f"trainer.checkpoint_dir={tmp_path / 'none'}", "trainer.resume_from=auto",
                         "model.path=builtin:smollm2"])
    assert pin_resume(fresh, tmp_path) is None  # nothing saved yet: fresh


def test_pin_resume_with_a_critic_falls_back_past_a_damaged_critic_step(saved, tmp_path, caplog):
    """gae/vtrace: a step counts only with the critic's verified checkpoint of it. The trainer's step
    folders stand in for the critic's here (the same format: manifest and CRC32s). Before, a corrupt
    critic step 3 was pinned with the trainer's and its load failed at every rerun."""
    from megarl.config import ConfigError, load_config
    from megarl.controller.state import pin_resume

    root = _copy(saved, tmp_path)
    critic = root / "critic"
    critic.mkdir()
    for step in ("step_00000002", "step_00000003"):
        shutil.copytree(root / step, critic / step)
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml",
                      [f"trainer.checkpoint_dir={root}", "trainer.resume_from=auto", "model.path=builtin:smollm2",
                       "algorithm.advantage=gae"])
    assert pin_resume(cfg, tmp_path) == root / "step_00000003"
    victim = _damage_flip(critic / "step_00000003")
    with caplog.at_level(logging.WARNING):
        assert pin_resume(cfg, tmp_path) == root / "step_00000002"
    assert any("step_00000003" in r.getMessage() and "its critic checkpoint" in r.getMessage() and victim in r.getMessage()
               for r in caplog.records), caplog.text
    shutil.rmtree(critic / "step_00000002")  # no common step left: refused, naming both
    with pytest.raises(ConfigError, match="the critic has no checkpoint of step_00000002"):
        pin_resume(cfg, tmp_path)
    shutil.rmtree(critic)  # a run that never had a critic: the trainer's step, the critic starts fresh
    assert pin_resume(cfg, tmp_path) == root / "step_00000003"


def test_a_save_prunes_an_abandoned_timeline_and_keeps_the_newest(tmp_path):
    from megarl.utils.checkpoint_store import prune as _prune

    root = tmp_path
    for s in (1, 2, 3, 5, 6):
        (root / f"step_{s:08d}").mkdir()
    (root / ".stage_step_00000004").mkdir()
    # a preemption's save of step 7 cut by the grace's SIGKILL, and a re-save of 2 killed mid-swap: the
    # only save that clears them is a later one (they grew by a checkpoint each time, until the disk was full)
    (root / ".tmp_step_00000007" / "dist").mkdir(parents=True)
    (root / ".trash_step_00000002").mkdir()
    (root / "notes").mkdir()  # not the store's: left alone
    _prune(root, root / "step_00000003", keep_last=2)  # resumed from 2 (5, 6 damaged), saved 3
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step_00000002", "step_00000003"]


@pytest.fixture
def small_disk(tmp_path):
    """A 120 MiB tmpfs: one tiny-model checkpoint (~101 MiB) fits, two do not."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    # CI (.ci/run, root) sets MEGARL_REQUIRE_TMPFS=1: there a refused mount fails the test instead of
    # skipping it, so the full-disk path is exercised in every CI run, as MEGARL_REQUIRE_SLURM does.
    skip = pytest.fail if os.environ.get("MEGARL_REQUIRE_TMPFS") == "1" else pytest.skip
    if os.geteuid() != 0:
        skip("mounting a tmpfs needs root; the full-disk path is not exercised here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        skip(f"mount -t tmpfs was refused ({done.stderr.strip()}); the full-disk path is not exercised")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_keeps_the_previous_checkpoint_and_names_path_and_bytes(tiny_llama_tied_dir, small_disk):
    from megarl.trainer.checkpoint import checkpoint_problem

    root = small_disk / "checkpoints"
    (res,) = run_multiprocess(_full_disk_worker, 1, str(tiny_llama_tied_dir), str(root), timeout_s=600)
    for step in (2, 3):
        err = res[step]
        assert err is not None, f"step {step} saved on a full disk"
        assert "\n" not in err["msg"] and str(root) in err["msg"] and f"{err['needed']} bytes" in err["msg"]
        assert err["needed"] > err["free"] and err["path"] == str(root)
        # nothing half-written is left: the previous checkpoint and `latest`, no temp or staged folders
        assert err["left"] == ["latest", "step_00000001"], err["left"]
    assert res[2]["needed"] > res["free_after_1"]  # refused before writing a byte
    assert (root / "latest").read_text() == "step_00000001"
    assert checkpoint_problem(root / "step_00000001") is None
