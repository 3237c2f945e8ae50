"""What a GPU job settles before it starts: its weight-sync transport, its NCCL setting, its layer spec.

CUDA IPC on one host opens trainer GPUs' memory on the generator's GPUs, which needs CUDA peer access: the
job asks before it starts (megarl.utils.devices.cuda_peer_access, in a child process), ``auto`` then picks
nccl where there is none, and an explicit ``cuda_ipc`` is refused naming the fix. Every process of the job
gets one NCCL_CUMEM_ENABLE (the DDMA nccl group joins trainer ranks and vLLM workers, which must agree). The
layer spec ``auto`` picks is said once, with its memory cost on a GPU without Transformer Engine.
The GPU's answer is the one boundary faked here (``..._faked_gpu``); no GPU on this machine."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.placement import DevicePlan
from megarl.ddma.transport import choose_transport
from megarl.ddma.transport.choice import job_nccl_env, transport_problem
from megarl.utils import devices


@pytest.mark.parametrize("peer, want", [(None, "cuda_ipc"), (True, "cuda_ipc"), (False, "nccl")])
def test_auto_on_one_host_takes_cuda_ipc_only_with_peer_access(peer, want):
    assert choose_transport("auto", device="cuda", same_host=True, peer_access=peer) == want
    assert choose_transport("auto", device="cpu", same_host=True, peer_access=peer) == "zero_copy"
    assert choose_transport("auto", device="cuda", same_host=False, peer_access=peer) == "nccl"


def test_an_explicit_cuda_ipc_without_peer_access_is_refused_naming_the_fix():
    problem = transport_problem("cuda_ipc", device="cuda", same_host=True, peer_access=False)
    assert "needs CUDA peer access" in problem and "sync.transport=auto (picks nccl)" in problem
    assert transport_problem("cuda_ipc", device="cuda", same_host=True, peer_access=True) is None
    assert transport_problem("nccl", device="cuda", same_host=True, peer_access=False) is None


def test_peer_access_of_one_device_needs_no_question_and_no_cuda_here_is_unknown():
    assert devices.cuda_peer_access([(0, 0), (1, 1)]) is True  # shared devices: no peer access needed
    assert devices.cuda_peer_access([(0, 1)]) is None  # CPU torch: the child cannot say


@pytest.mark.parametrize("transport, peer, want", [("auto", False, "nccl"), ("auto", True, "cuda_ipc"),
                                                    ("auto", None, "cuda_ipc"), ("nccl", False, "nccl")])
def test_the_job_resolves_its_transport_from_its_own_gpus_faked_gpu(monkeypatch, transport, peer, want):
    from megarl.config.job import describe_sync, resolved_sync

    asked = []
    monkeypatch.setattr(devices, "cuda_peer_access", lambda pairs: asked.append(sorted(pairs)) or peer)
    cfg = load_config("configs/gpu_smoke.yaml", [f"sync.transport={transport}"])
    sync = resolved_sync(cfg, DevicePlan(trainer=[0], generator=[1], note=""))
    assert sync.transport == want
    assert asked == ([[(0, 1)]] if transport == "auto" else [])  # only where cuda_ipc is in question
    assert describe_sync(cfg, sync).startswith(f"DDMA {want}")


def test_the_job_refuses_cuda_ipc_between_gpus_without_peer_access_faked_gpu(monkeypatch):
    from megarl.config.job import resolved_sync

    monkeypatch.setattr(devices, "cuda_peer_access", lambda pairs: False)
    cfg = load_config("configs/gpu_smoke.yaml", ["sync.transport=cuda_ipc"])
    with pytest.raises(ConfigError, match="needs CUDA peer access"):
        resolved_sync(cfg, DevicePlan(trainer=[0], generator=[1], note=""))


def test_one_nccl_cumem_setting_for_the_whole_job_the_users_if_set(monkeypatch):
    from megarl.cluster.slurm import SlurmEnv, build_role_map

    assert job_nccl_env({}) == {"NCCL_CUMEM_ENABLE": "0"}
    assert job_nccl_env({"NCCL_CUMEM_ENABLE": "1"}) == {"NCCL_CUMEM_ENABLE": "1"}
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
                             "SLURM_GPUS_ON_NODE": "8"})
    cfg = load_config("configs/tiny_test.yaml", ["cluster.launcher=slurm"])
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert build_role_map(env, cfg).job_env()["NCCL_CUMEM_ENABLE"] == "0"  # every srun task of the job
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    assert build_role_map(env, cfg).job_env()["NCCL_CUMEM_ENABLE"] == "1"


@pytest.mark.parametrize("cuda, level, words", [(True, "WARNING", "stores its [batch, heads, seq, seq] scores"),
                                                (False, "INFO", "layer spec local")])
def test_the_layer_spec_auto_picks_is_said_once_and_its_cost_on_a_gpu_faked_gpu(monkeypatch, caplog, cuda, level,
                                                                                 words):
    import logging

    import torch

    from megarl.trainer import model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(model, "_said_spec", False)
    with caplog.at_level(logging.INFO, logger="megarl.trainer.model"):
        model._say_spec("local")
        model._say_spec("local")
    said = [r for r in caplog.records if r.name == "megarl.trainer.model"]
    assert len(said) == 1 and said[0].levelname == level and words in said[0].getMessage(), said
