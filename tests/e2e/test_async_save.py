"""trainer.async_save: the background checkpoint writer (megarl/trainer/async_save.py).

One 2-rank job (TP=2, plain fp32 optimizer, the model of tests/e2e/test_checkpoint.py: its parameters and
Adam moments are tensors of their own, which megatron's planner does not copy, so only the writer's
fork keeps the step-1 values while step 2 updates them in place):
  - step 1, async save: until the writer's commit nothing counts (no step folder, no `latest`); step 2
    trains while the write is in flight (a real snapshot: the weights change under it); the step-2 save
    waits for it. The step-1 checkpoint holds the step-1 weights, not the step-2 ones, and a job that
    resumes from it trains step 2 bit-exactly (optimizer and RNG of step 1 included).
  - step 3: the writer is held by the fault pause point after writing its shards, and the ranks die
    (os._exit) mid-write: `latest` stays on step 2, the newest complete checkpoint is step 2, and the
    writer process dies with its rank.
  - each checkpoint adopts the file staged for its own step (the controller's state), also when it
    commits after the next step's file was staged.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from megarl.utils.dist import MultiprocessError, run_multiprocess
from tests.harness.checkpoint import LAYOUTS, _setup, _train_step, _weights

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo path (2 ranks on one host)")
KILLED = 23
HOLD_S = 120.0  # the pause point's hold; the ranks die long before it ends


def _save(objs, root: Path, step: int, writer):
    from megarl.trainer.checkpoint import TrainProgress, save_checkpoint

    return save_checkpoint(root, model=objs.model, optimizer=objs.optimizer, scheduler=objs.scheduler,
                           progress=TrainProgress(step=step, consumed_samples=8 * step), keep_last=3, writer=writer)


def _write_job(rank: int, world_size: int, root: str) -> None:
    from megarl.trainer.async_save import PAUSE, AsyncWriter
    from megarl.utils.faults import ENV

    root_ = Path(root) / "ckpt"
    from megarl.trainer.checkpoint import stage_file

    cfg, objs, _ = _setup(LAYOUTS["tp2"])
    writer = AsyncWriter(timeout_s=300)
    out: dict = {"loss1": _train_step(objs, cfg)}
    if rank == 0:
        stage_file(root_, 1, "controller_state.json", "step 1")
    _save(objs, root_, 1, writer)
    out["w1"] = _weights(objs.model)
    out["in_flight"] = writer.in_flight
    out["before_commit"] = sorted(p.name for p in root_.iterdir())  # only the staged and the temp folder
    out["loss2"] = _train_step(objs, cfg)  # the step goes on while the writer writes
    out["w2"] = _weights(objs.model)
    if rank == 0:  # staged before the step-1 write commits (the controller stages, then saves)
        stage_file(root_, 2, "controller_state.json", "step 2")
    _save(objs, root_, 2, writer)  # waits for step 1 and commits it first
    writer.wait("the test")
    out["after_wait"] = sorted(p.name for p in root_.iterdir())
    torch.save(out, Path(root) / f"write_rank{rank}.pt")

    _train_step(objs, cfg)
    os.environ[ENV] = f"{PAUSE}={HOLD_S}"
    _save(objs, root_, 3, writer)
    shards = root_ / ".tmp_step_00000003" / "dist"
    deadline = time.monotonic() + 120
    while len(list(shards.glob("*.distcp"))) < world_size:  # every rank's shard file is on disk
        assert time.monotonic() < deadline, "the step-3 shards were not written within 120 s"
        time.sleep(0.05)
    (Path(root) / f"writer_rank{rank}.json").write_text(json.dumps(
        {"pid": writer._proc.pid, "alive": writer._proc.is_alive(), "in_flight": writer.in_flight}))
    os._exit(KILLED)  # mid-write: the writer holds at the pause point, nothing committed


def _resume_job(rank: int, world_size: int, root: str) -> None:
    from megarl.trainer.checkpoint import load_checkpoint

    cfg, objs, _ = _setup(LAYOUTS["tp2"])
    progress = load_checkpoint(Path(root) / "ckpt" / "step_00000001", model=objs.model, optimizer=objs.optimizer,
                               scheduler=objs.scheduler)
    out = {"step": progress.step, "w1": _weights(objs.model)}
    out["loss2"] = _train_step(objs, cfg)
    out["w2"] = _weights(objs.model)
    torch.save(out, Path(root) / f"resume_rank{rank}.pt")  # a file: tensors sent back by the pipe share fds


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    with pytest.raises(MultiprocessError, match=f"exit code {KILLED}"):
        run_multiprocess(_write_job, 2, str(root), timeout_s=600)
    written = [torch.load(root / f"write_rank{r}.pt", weights_only=False) for r in range(2)]
    run_multiprocess(_resume_job, 2, str(root), timeout_s=600)
    resumed = [torch.load(root / f"resume_rank{r}.pt", weights_only=False) for r in range(2)]
    return root, written, resumed


def test_nothing_counts_before_the_commit_and_the_step_goes_on(job):
    _, written, _ = job
    for w in written:
        assert w["in_flight"] == 1
        assert w["before_commit"] == [".stage_step_00000001", ".tmp_step_00000001"], w["before_commit"]
        assert "latest" in w["after_wait"] and "step_00000001" in w["after_wait"] and "step_00000002" in w["after_wait"]
        # the weights moved under the write in flight (else the snapshot check below proves nothing)
        assert any(not torch.equal(w["w1"][n], w["w2"][n]) for n in w["w1"])


def test_the_checkpoint_is_the_snapshot_and_resumes_bit_exact(job):
    _, written, resumed = job
    root = job[0] / "ckpt"
    from megarl.trainer.checkpoint_index import file_crc32

    for step in (1, 2):  # each its own step's staged file
        folder = root / f"step_{step:08d}"
        assert (folder / "controller_state.json").read_text() == f"step {step}"
        # the writers' CRCs of their own shards are the manifest's, and their record files are gone
        meta = json.loads((folder / "meta.json").read_text())
        shards = sorted(p.relative_to(folder).as_posix() for p in (folder / "dist").glob("__*.distcp"))
        assert len(shards) >= 2 and all(meta["crc32"][s] == file_crc32(folder / s) for s in shards)
        assert not list(folder.glob(".shard_crc_rank_*"))
    for w, r in zip(written, resumed):
        assert r["step"] == 1
        for n in w["w1"]:
            assert torch.equal(r["w1"][n], w["w1"][n]), f"{n}: not the step-1 weights"
        assert r["loss2"] == w["loss2"]  # optimizer, scheduler and RNG of step 1
        for n in w["w2"]:
            assert torch.equal(r["w2"][n], w["w2"][n]), f"{n}: step 2 after the resume differs"


def test_a_kill_mid_write_leaves_the_previous_checkpoint_complete(job):
    import psutil

    from megarl.trainer.checkpoint import newest_complete

    root, _, _ = job
    ckpt = root / "ckpt"
    for rank in range(2):
        info = json.loads((root / f"writer_rank{rank}.json").read_text())
        assert info["alive"] and info["in_flight"] == 3, info  # the kill was mid-write
        deadline = time.monotonic() + 30
        while psutil.pid_exists(info["pid"]) and psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"rank {rank}'s writer outlived it"
            time.sleep(0.1)
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert not (ckpt / "step_00000003").exists()
    assert (ckpt / ".tmp_step_00000003" / "dist").is_dir()  # the shards were on disk, uncommitted
    assert newest_complete(ckpt) == ckpt / "step_00000002"


class _CloneRequest:
    """megatron's AsyncRequest shape, with an async_fn that does what its writers do to a real model's
    tensors: a copy of one over ATen's parallel grain size (32768 elements, at::internal::GRAIN_SIZE)."""

    def __init__(self, tensor: torch.Tensor, out: Path) -> None:
        self.async_fn, self.async_fn_args, self.async_fn_kwargs = self._write, [tensor, str(out)], {}
        self.preload_fn, self.finalize_fns = None, []

    @staticmethod
    def _write(tensor: torch.Tensor, out: str) -> None:
        torch.save(tensor.clone() * 2, out)


def _big_tensor_job(rank: int, world_size: int, root: str) -> None:
    from megarl.trainer.async_save import AsyncWriter

    torch.set_num_threads(2)  # the trainer's OpenMP pool, up (as on any machine with 2+ cores)
    big = torch.randn(1 << 20)
    _ = (big * 3).sum()  # a parallel op: the pool's threads now exist in this process, not in a fork
    writer = AsyncWriter(timeout_s=30)  # the fixed writer takes ~0.1 s; a hung one never ends
    committed = []
    writer.start(_CloneRequest(big, Path(root) / "big.pt"), lambda failed: committed.append(failed) or Path(root), 1)
    writer.wait("the test")
    assert committed == [None]
    assert torch.equal(torch.load(Path(root) / "big.pt"), big * 2)


def test_the_writer_survives_a_fork_of_a_threaded_trainer(tmp_path):
    """The quickstart-size hang: the forked writer's first parallel op on a real model's tensors waited
    forever on the parent's OpenMP threads (tiny test models stay under the grain size, so they never
    showed it). Without `torch.set_num_threads(1)` in the writer this times out after 30 s."""
    run_multiprocess(_big_tensor_job, 1, str(tmp_path), timeout_s=120)


def test_a_recorded_crc_is_used_only_while_the_file_size_matches(tmp_path):
    from megarl.trainer.checkpoint_files import known_shard_crcs, record_shard_crcs
    from megarl.trainer.checkpoint_index import _manifest, file_crc32

    (tmp_path / "dist").mkdir()
    shard = tmp_path / "dist" / "__0_0.distcp"
    shard.write_bytes(b"x" * 1000)
    record_shard_crcs(tmp_path, 0)
    assert _manifest(tmp_path, known_shard_crcs(tmp_path))[1] == {"dist/__0_0.distcp": file_crc32(shard)}
    assert not list(tmp_path.glob(".shard_crc_rank_*"))  # not part of the checkpoint
    # a record that no longer fits its file (size changed) is read again, not trusted
    assert _manifest(tmp_path, {"dist/__0_0.distcp": (999, 12345)})[1]["dist/__0_0.distcp"] == file_crc32(shard)
    assert _manifest(tmp_path, {"dist/__0_0.distcp": (1000, 12345)})[1]["dist/__0_0.distcp"] == 12345


class _BigResultsRequest:
    """An async_fn that reports as megatron's writer does (``results_queue.put`` of its write
    results), with results over the pipe's 64 KiB buffer, as a real model's are."""

    def __init__(self, results_queue, size: int) -> None:
        self.async_fn, self.async_fn_args, self.async_fn_kwargs = self._write, [results_queue, size], {}
        self.preload_fn, self.got = None, []
        self.finalize_fns = [lambda: self.got.append(results_queue.get_nowait())]

    @staticmethod
    def _write(results_queue, size: int) -> None:
        results_queue.put({0: [b"r" * size]})


def _big_results_job(rank: int, world_size: int, root: str) -> None:
    from megarl.trainer.async_save import AsyncWriter

    writer = AsyncWriter(timeout_s=30)  # the fixed writer exits at once; a blocked one never does
    request = _BigResultsRequest(writer.results_queue(), 4 << 20)
    writer.start(request, lambda failed: Path(root) if failed is None else None, 1)
    assert writer.wait("the test") == Path(root)
    assert request.got == [{0: [b"r" * (4 << 20)]}]  # megatron's finalize reads them back whole


def test_the_writer_exits_when_its_results_outgrow_the_pipe(tmp_path):
    """The second quickstart-size hang: the writer's results sat in its queue's feeder thread, which
    a process waits for at exit, while this process waited for the exit to read them."""
    run_multiprocess(_big_results_job, 1, str(tmp_path), timeout_s=120)


def _forks_a_sleeper(pid_file: str) -> None:
    """What megatron's writer does (forks a process per write bucket), with a process that would
    never end by itself."""
    import multiprocessing as mp

    p = mp.get_context("fork").Process(target=time.sleep, args=(3600,))
    p.start()
    Path(pid_file).write_text(str(p.pid))
    time.sleep(3600)


class _SleeperRequest:
    def __init__(self, pid_file: str) -> None:
        self.async_fn, self.async_fn_args, self.async_fn_kwargs = _forks_a_sleeper, [pid_file], {}
        self.preload_fn, self.finalize_fns = None, []


def _killed_mid_write_job(rank: int, world_size: int, root: str) -> None:
    from megarl.trainer.async_save import AsyncWriter

    pid_file = Path(root) / "bucket_writer.pid"
    writer = AsyncWriter(timeout_s=60)
    writer.start(_SleeperRequest(str(pid_file)), lambda failed: Path(root), 1)
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the writer's child did not start within 60 s"
        time.sleep(0.05)
    os._exit(KILLED)  # the rank dies mid-write


def test_a_killed_rank_takes_the_writers_own_children_with_it(tmp_path):
    """megatron's per-bucket writer processes (children of our writer) outlived a rank killed
    mid-write: orphans blocked forever on their queue's condition (one per killed async save)."""
    import psutil

    with pytest.raises(MultiprocessError, match=f"exit code {KILLED}"):
        run_multiprocess(_killed_mid_write_job, 1, str(tmp_path), timeout_s=120)
    pid = int((tmp_path / "bucket_writer.pid").read_text())
    deadline = time.monotonic() + 30  # PDEATHSIG is immediate; the parent poll (procs.POLL_S) is the fallback
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the writer's child (pid {pid}) outlived the killed rank"
        time.sleep(0.1)
