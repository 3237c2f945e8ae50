"""Which DDMA transport a sync uses: one pure function of where the bytes live and where the peers run.

No torch import (config validation calls it before anything starts). The cluster launcher calls
:func:`choose_transport` for multi-node jobs; ``megarl train`` calls it for local ones
(``config/job.py`` ``resolved_sync``). It is the only place an alias (``auto``, ``p2p``) resolves:
:class:`megarl.ddma.sync.SyncSpec` takes only a concrete transport and refuses an alias.
"""

from __future__ import annotations

TRANSPORTS = ("zero_copy", "cuda_ipc", "gloo", "nccl")
ALIASES = ("auto", "p2p")
TRANSPORT_CHOICES = ALIASES + TRANSPORTS
DEVICES = ("cpu", "cuda")

_NEEDS = {  # transport -> (device it moves, needs a shared host)
    "zero_copy": ("cpu", True),
    "cuda_ipc": ("cuda", True),
    "gloo": ("cpu", False),
    "nccl": ("cuda", False),
}


def choose_transport(requested: str = "auto", *, device: str, same_host: bool, peer_access: bool | None = None) -> str:
    """The DDMA transport for one job.

    Args:
        requested: ``sync.transport`` as configured: ``"auto"`` (pick), ``"p2p"`` (the old name for
            point-to-point: gloo or nccl by device), or a transport name, returned unchanged (check it
            with :func:`transport_problem`).
        device: where the trainer's wire tensors and the engine's parameters live: ``"cpu"`` (host
            memory) or ``"cuda"``.
        same_host: whether every trainer rank shares a host with every generator worker it sends to
            (a local job: yes; trainer and generator pools on different Slurm nodes: no).
        peer_access: whether each trainer GPU can access each generator GPU it sends to (CUDA peer access,
            which opening another GPU's IPC handle needs; ``megarl.utils.devices.cuda_peer_access``); None
            = not known (assumed). Without it ``auto`` picks nccl on one host too.

    Returns one of ``zero_copy`` (same host, host memory), ``cuda_ipc`` (same host, CUDA),
    ``gloo`` (other host, host memory) or ``nccl`` (other host, CUDA).
    """
    if device not in DEVICES:
        raise ValueError(f"choose_transport: device {device!r}: choose one of {DEVICES}")
    if requested == "auto":
        if same_host:
            return "zero_copy" if device == "cpu" else ("nccl" if peer_access is False else "cuda_ipc")
        return "gloo" if device == "cpu" else "nccl"
    if requested == "p2p":
        return "gloo" if device == "cpu" else "nccl"
    if requested not in TRANSPORTS:
        raise ValueError(f"ddma transport {requested!r}: choose one of {TRANSPORT_CHOICES}")
    return requested


def transport_problem(requested: str, *, device: str, same_host: bool, peer_access: bool | None = None) -> str | None:
    """Why ``requested`` cannot run with bytes on ``device`` (``same_host``, ``peer_access`` as in
    :func:`choose_transport`), as a config error naming what to set; None when it can."""
    if requested not in TRANSPORT_CHOICES:
        return f"sync.transport={requested!r}: choose one of {', '.join(TRANSPORT_CHOICES)}"
    if requested in ALIASES:
        return None
    want_device, want_same_host = _NEEDS[requested]
    fits = choose_transport("auto", device=device, same_host=same_host, peer_access=peer_access)
    where = f"{'CUDA' if device == 'cuda' else 'CPU'} run{'' if same_host else ' across hosts'}"
    if want_device != device:
        return (f"sync.transport={requested} moves {'CUDA' if want_device == 'cuda' else 'host'} memory, but this is "
                f"a {where}: set sync.transport=auto (picks {fits}) or sync.transport={fits}")
    if want_same_host and not same_host:
        return (f"sync.transport={requested} reads the trainer's memory from the same host, but trainer and "
                f"generator are on different hosts: set sync.transport=auto (picks {fits}) or sync.transport={fits}")
    if requested == "cuda_ipc" and peer_access is False:
        return ("sync.transport=cuda_ipc opens the trainer GPUs' memory on the generator's GPUs, which needs CUDA peer "
                "access between them, and these GPUs have none (nvidia-smi topo -p2p r shows it): set "
                "sync.transport=auto (picks nccl) or sync.transport=nccl, or place trainer and generator on GPUs "
                "with peer access (cluster.trainer_devices / cluster.generator_devices)")
    return None


# NCCL reads NCCL_CUMEM_ENABLE once per process, at its first communicator, and the processes of one
# communicator must agree on it (cuMem buffers and legacy CUDA IPC buffers do not mix in NCCL's P2P
# transport). The DDMA nccl group joins trainer ranks (which made their Megatron communicators first) and
# vLLM workers (which made theirs, under whatever vLLM set in its own environment overrides; some versions
# set 0), so the job fixes one value for every process before any starts: the user's if set, else 0.
NCCL_CUMEM_ENV = "NCCL_CUMEM_ENABLE"


def job_nccl_env(environ) -> dict[str, str]:
    """The NCCL variables every process of the job gets, the same everywhere (see above)."""
    return {NCCL_CUMEM_ENV: environ.get(NCCL_CUMEM_ENV) or "0"}


__all__ = ["NCCL_CUMEM_ENV", "TRANSPORTS", "TRANSPORT_CHOICES", "choose_transport", "job_nccl_env",
           "transport_problem"]
