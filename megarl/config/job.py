"""The resolved job: what ``megarl train`` decided from the config, frozen before any executor starts.

The input config (:class:`MegaRLConfig`) is what the user wrote and stays so (the run folder's
config.yaml is it); everything the job derives from it and from the machine is here, once:

* ``model_dir``: the HF folder ``model.path`` names (a folder, an HF id's cached snapshot, the built-in SmolLM2);
* ``device``: where the executors' weights live, by :func:`job_device`, THE device rule of the job, which the
  Slurm launcher (megarl/cluster/slurm.py) applies to the allocation's GPUs and the controller to its own;
* ``devices``: each executor's GPUs (config/placement.py);
* ``sync``: ``cfg.sync`` with the transport chosen (megarl/ddma/transport/choice.py) and the probe bound set
  (megarl/ddma/config.py :func:`default_probe_gap`);
* ``resume_dir``: the one verified step folder the controller and every trainer rank load (None: fresh).

Under ``cluster.launcher=slurm`` the role map puts its device in the job environment
(:data:`JOB_DEVICE_ENV`), and the controller task takes it from there: launcher and controller cannot
disagree about the transport. Torch is imported only to count the visible GPUs, after the controller
chose its device (controller/startup.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config.placement import DevicePlan, device_plan
from megarl.config.schema import BUILTIN_SMOLLM2
from megarl.ddma.config import SyncConfig, default_probe_gap
from megarl.config.loader import ConfigError

if TYPE_CHECKING:
    from megarl.config.schema import MegaRLConfig

log = logging.getLogger("megarl")

JOB_DEVICE_ENV = "MEGARL_JOB_DEVICE"  # the launcher's job_device, in every task's environment (Slurm jobs)


@dataclass(frozen=True)
class ResolvedJob:
    model_dir: Path            # the HF folder of model.path
    device: str                # 'cpu' or 'cuda': where the trainer's and the engines' weights live (job_device)
    devices: DevicePlan        # each executor's GPUs
    sync: SyncConfig           # cfg.sync with a concrete transport and the probe bound (nats)
    resume_dir: Path | None    # the step folder every trainer rank loads; None: a fresh start


def job_device(setting: str, gpus: int) -> str:
    """The job's one device rule: ``cluster.device`` 'cpu' / 'cuda' as set; 'auto': 'cuda' when the job has
    GPUs (``gpus``: a local job's visible ones, a Slurm job's allocated ones in its pools), else 'cpu'."""
    if setting in ("cpu", "cuda"):
        return setting
    return "cuda" if gpus > 0 else "cpu"


def resolve_job(cfg: MegaRLConfig, resume_dir: Path | None) -> ResolvedJob:
    """The job ``cfg`` describes on this machine (``resume_dir``: controller/run.py claim_run_folder's
    pick). A layout that does not fit, or a transport that cannot run here, is a ConfigError."""
    model_dir = resolve_model(cfg.model.path)
    visible = visible_gpus(cfg.cluster.device)
    devices = place_devices(cfg, visible)
    if cfg.cluster.launcher == "slurm" and os.environ.get(JOB_DEVICE_ENV) in ("cpu", "cuda"):
        device = os.environ[JOB_DEVICE_ENV]  # the allocation's, as the launcher placed the pools
    else:
        device = job_device(cfg.cluster.device, visible)
    sync = resolved_sync(cfg, devices, device=device)  # may ask CUDA about peer access: before any executor
    slow = bf16_cpu_problem(device, cfg.trainer.params_dtype, cpu_flags())
    if slow:
        log.warning("%s", slow)
    return ResolvedJob(model_dir, device, devices, sync, resume_dir)


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of the bf16 matmul hardware oneDNN uses


def cpu_flags(path: str = "/proc/cpuinfo") -> str | None:
    """The first ``flags`` line of ``path`` (Linux), or None when it cannot be read."""
    try:
        with open(path) as fh:
            return next((line.split(":", 1)[1] for line in fh if line.startswith("flags")), None)
    except OSError:
        return None


def bf16_cpu_problem(device: str, params_dtype: str, flags: str | None) -> str | None:
    """A warning when the trainer computes in bf16 on a CPU without bf16 matmul hardware (``flags``: the
    cpuinfo flags, None: unknown, no warning): oneDNN then emulates it, far slower than float32."""
    if device != "cpu" or params_dtype != "bfloat16" or flags is None or set(flags.split()) & set(BF16_CPU_FLAGS):
        return None
    return ("trainer.params_dtype=bfloat16 on a CPU without bf16 matmul hardware (no amx_bf16 or avx512_bf16 in "
            "/proc/cpuinfo): oneDNN emulates bf16 and a train step is far slower than in float32 (docs/results.md: "
            "the quickstart's first step had not finished after 6 minutes). Set trainer.params_dtype=float32 "
            "(the quickstart's fp32 setting also takes trainer.lr=2e-5 trainer.min_lr=2e-6)")


def resolve_model(path: str) -> Path:
    """An HF folder for ``model.path``: a folder, an HF id's snapshot in the local HF cache, or the
    built-in SmolLM2 (converted once and cached)."""
    if path == BUILTIN_SMOLLM2:
        from megarl.models.smollm2 import ensure_smollm2_hf

        # converted once, then cached: said only when it converts (and without transformers' progress bars,
        # which leave empty lines between the log lines)
        return ensure_smollm2_hf(progress=False, announce=lambda out: log.info(
            "converting the built-in SmolLM2-135M-Instruct from its GGUF (once, ~1 min) into %s", out))
    from megarl.utils.model_source import local_model_dir

    return local_model_dir(path) or Path(path)  # an HF id: its snapshot in the local HF cache


def visible_gpus(setting: str) -> int:
    """CUDA devices this process sees (0 with cluster.device=cpu, which hid them)."""
    if setting == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_devices(cfg: MegaRLConfig, visible: int) -> DevicePlan:
    """Each executor's GPUs (megarl.config.placement); a layout that does not fit is a ConfigError."""
    try:
        plan = device_plan(cfg, visible)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    log.info("placement: %s", plan.note)
    return plan


def resolved_sync(cfg: MegaRLConfig, devices: DevicePlan | None = None, *, device: str | None = None,
                 same_host: bool | None = None) -> SyncConfig:
    """``cfg.sync`` with ``transport`` resolved (auto / p2p -> the transport this job uses) and
    ``probe_max_gap`` 0 replaced by the bound for the coarsest of the trainer's weights, the DDMA wire and
    the engine. ``device``: :func:`job_device`'s (default: by the GPUs in ``devices``); ``same_host``:
    default a local job. A one-host CUDA job asks whether its trainer and generator GPUs have peer access,
    which CUDA IPC needs: auto picks nccl without it, and an explicit cuda_ipc is refused naming the fix."""
    from megarl.ddma.transport.choice import choose_transport, transport_problem
    from megarl.utils import devices as cuda

    s = cfg.sync
    gpus = len((devices and devices.trainer) or []) + len((devices and devices.generator) or [])
    device = device or job_device(cfg.cluster.device, gpus)
    same_host = cfg.cluster.launcher == "local" if same_host is None else same_host
    gap = s.probe_max_gap or default_probe_gap(cfg.generator.dtype, cfg.generator.quantization,
                                               cfg.trainer.params_dtype, s.wire if s.method == "ddma" else "engine")
    if s.method != "ddma":
        return dataclasses.replace(s, probe_max_gap=gap)
    peer = None
    if (device == "cuda" and same_host and s.transport in ("auto", "cuda_ipc")
            and devices is not None and devices.trainer and devices.generator):
        peer = cuda.cuda_peer_access([(t, g) for t in set(devices.trainer) for g in set(devices.generator)])
    problem = transport_problem(s.transport, device=device, same_host=same_host, peer_access=peer)
    if problem:
        raise ConfigError([problem])
    if peer is False and s.transport == "auto":
        log.warning("weight sync: the trainer's and the generator's GPUs have no CUDA peer access, which CUDA "
                    "IPC needs: sync.transport=auto picks nccl")
    return dataclasses.replace(s, probe_max_gap=gap, transport=choose_transport(
        s.transport, device=device, same_host=same_host, peer_access=peer))


def describe_sync(cfg: MegaRLConfig, sync: SyncConfig | None = None) -> str:
    """One line for the log: how the weights travel and how often they are proven (``sync``: the resolved
    ``cfg.sync``, :func:`resolved_sync`'s, when the job has it)."""
    s = cfg.sync
    if s.method == "shm":
        return "full HF tensors through one shared-memory file (sync.method=shm)"
    chosen = (sync or resolved_sync(cfg)).transport
    how = chosen if chosen == s.transport else f"{chosen} (sync.transport={s.transport})"
    return (f"DDMA {how}, wire {s.wire}, checksums every {s.verify_every or 'never'} sync(s), "
            f"logprob probe every {s.probe_every or 'never'}")


__all__ = ["JOB_DEVICE_ENV", "ResolvedJob", "bf16_cpu_problem", "cpu_flags", "describe_sync", "job_device",
           "place_devices", "resolve_job", "resolve_model", "resolved_sync", "visible_gpus"]
