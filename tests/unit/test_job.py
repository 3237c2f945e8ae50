"""megarl/config/job.py: the resolved job, frozen before any executor starts, with the job's one device
rule, shared by the Slurm launcher and the controller; the input config is left as written.
Torch-free apart from counting visible GPUs; no executor is started."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megarl.cluster.slurm import SlurmEnv, build_role_map, placement_lines
from megarl.config import load_config
from megarl.config.job import ResolvedJob, job_device, resolve_job, resolved_sync

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml")


def test_the_one_device_rule():
    assert [job_device("cpu", 8), job_device("cuda", 0), job_device("auto", 0), job_device("auto", 2)] == \
        ["cpu", "cuda", "cpu", "cuda"]


def test_an_allocation_without_gpus_launcher_and_controller_agree(monkeypatch, tiny_llama_dir):
    """Slurm nodes that look like GPU nodes (CUDA_VISIBLE_DEVICES set: the validator's cuda_expected says
    CUDA) in an allocation that asked for no GPUs: the launcher placed the pools on the CPU (gloo), and the
    controller task, which takes the role map's job environment, resolves the same device and transport.
    Before step 1b the controller chose nccl here by its own rule (planted back: this test fails)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("MEGARL_JOB_DEVICE", raising=False)
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"})
    cfg = load_config(TINY, [f"model.path={tiny_llama_dir}", "cluster.launcher=slurm", "cluster.device=auto", "cluster.ranks_per_node=1",
                             "sync.transport=auto"])
    rmap = build_role_map(env, cfg)
    assert (rmap.device, rmap.transport) == ("cpu", "gloo")
    for key, value in rmap.job_env().items():  # what megarl rank --role controller puts in its environment
        monkeypatch.setenv(key, value)
    job = resolve_job(cfg, None)
    assert (job.device, job.sync.transport) == (rmap.device, rmap.transport)
    # GPUs in the allocation: both say CUDA over other hosts
    gpu_map = build_role_map(SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
                                                "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "2"}), cfg)
    for key, value in gpu_map.job_env().items():
        monkeypatch.setenv(key, value)
    assert (gpu_map.device, gpu_map.transport) == ("cuda", "nccl") == (resolve_job(cfg, None).device,
                                                                      resolve_job(cfg, None).sync.transport)


def test_the_job_is_frozen_and_the_input_config_is_left_as_written(tiny_llama_dir, tmp_path):
    cfg = load_config(TINY, [f"model.path={tiny_llama_dir}", "cluster.device=cpu", "sync.transport=auto",
                             "sync.probe_max_gap=0", "generator.dtype=float32", "trainer.params_dtype=float32"])
    before = dataclasses.asdict(cfg)
    job = resolve_job(cfg, tmp_path / "step_00000002")
    assert isinstance(job, ResolvedJob) and job.model_dir == Path(tiny_llama_dir)
    assert (job.device, job.sync.transport, job.devices.trainer) == ("cpu", "zero_copy", None)
    assert job.sync.probe_max_gap == 1e-3  # fp32 engine, fp32 trainer, engine wire (ddma/config.py default_probe_gap)
    assert job.resume_dir == tmp_path / "step_00000002"
    assert dataclasses.asdict(cfg) == before  # transport 'auto', probe bound 0: as the user wrote them
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.device = "cuda"  # type: ignore[misc]
    assert resolved_sync(cfg).transport == "zero_copy"


def test_the_launcher_lists_every_role_of_the_device_plan(monkeypatch):
    """A role (a critic, a judge, a teacher) appears in `megarl launch slurm --dry-run` by being a field of
    config/placement.py's DevicePlan: here a plan with an extra role the launcher never names."""
    import megarl.config.placement as placement

    @dataclasses.dataclass(frozen=True)
    class Plan:
        trainer: list[int] | None
        generator: list[int] | None
        verifier: list[int] | None
        note: str

    monkeypatch.setattr(placement, "DevicePlan", Plan)
    monkeypatch.setattr(placement, "device_plan", lambda cfg, gpus: Plan(None, [0], [1, 2], "n"))
    (line,) = placement_lines(None, 4, "n3")
    assert line == ("device plan on n3: trainer no GPU here (its pool, or the CPU); generator GPU(s) 0; "
                    "verifier GPU(s) 1,2")


def test_validation_does_not_guess_the_device_the_job_decides(monkeypatch, tiny_llama_dir):
    """cluster.device=auto on a node that looks like a GPU node, sync.transport=gloo, an allocation without
    GPUs: validation no longer refuses gloo by its own guess (CUDA), the job's rule picks the CPU and gloo
    fits; an explicit cluster.device=cuda is still refused before anything starts."""
    from megarl.config import ConfigError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    over = [f"model.path={tiny_llama_dir}", "cluster.launcher=slurm", "cluster.ranks_per_node=1", "sync.transport=gloo"]
    cfg = load_config(TINY, over + ["cluster.device=auto"])
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"})
    assert build_role_map(env, cfg).transport == "gloo"
    with pytest.raises(ConfigError, match="sync.transport=gloo moves host memory"):
        load_config(TINY, over + ["cluster.device=cuda"])
