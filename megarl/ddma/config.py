"""The ``sync`` config section: how weights travel from the trainer to the generator after a step."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES
from megarl.ddma.transport.choice import TRANSPORT_CHOICES, transport_problem
from megarl.utils.knobs import knob

METHODS = ("ddma", "shm")
NATIVE = ("auto", "required")


def native_extension_present() -> bool:
    """Whether megarl._C is there to load, found without importing it or torch (validation stays
    light); ``megarl train`` imports it at start and a broken build is caught then."""
    if os.environ.get("MEGARL_NO_NATIVE") == "1":
        return False
    try:
        return importlib.util.find_spec("megarl._C") is not None
    except (ImportError, ValueError):
        return False


def default_probe_gap(dtype: str, quantization: str, trainer_dtype: str = "float32", wire: str = "engine") -> float:
    """The probe bound (nats) for an engine of ``dtype`` fed by a trainer whose weights are ``trainer_dtype``
    over a DDMA ``wire`` (where each number comes from: megarl/controller/weight_sync.py's docstring): the
    coarsest of the three sets it. ``wire="fp8"`` lands e4m3-rounded weights, so an fp32 engine then holds FP8
    values. The job resolves it once (megarl/config/job.py resolved_sync)."""
    if quantization != "none" or wire == "fp8":
        return 1.0
    return 1e-3 if dtype == trainer_dtype == "float32" else 0.25


@dataclass
class SyncConfig:
    method: str = knob("ddma", choices=METHODS, help=(
        "'ddma': every trainer rank sends its shards straight to the generator workers that need them "
        "(docs/ddma.md); 'shm': the old path, full HF tensors assembled by the trainer and pushed through "
        "one shared-memory file (single-rank trainer only). Default ddma."))
    transport: str = knob("auto", choices=TRANSPORT_CHOICES, help=(
        "DDMA transport (megarl/ddma/transport/): 'auto' picks from where the bytes live and whether trainer and "
        "generator share a host (same host: 'zero_copy' for host memory, 'cuda_ipc' for CUDA; other hosts: 'gloo' "
        "on CPU, 'nccl' on CUDA). 'zero_copy': workers copy straight out of the trainer's shared memory; "
        "'cuda_ipc': workers copy device-to-device out of the trainer's exported CUDA buffers; 'gloo' / 'nccl': "
        "point-to-point over a DDMA process group of its own; 'p2p' = 'gloo' on CPU, 'nccl' on CUDA (the old "
        "name). The sync log line names the choice. Default auto."))
    bucket_mb: int = knob(DEFAULT_BUCKET_BYTES >> 20, help=(
        "Memory budget of the gloo and nccl transports and of cuda_ipc's export buckets (MiB): gloo / nccl move "
        "each group of parameters (at most this much staging) in messages of half this size per (sender, worker) "
        "pair, two in flight, so a sender holds at most this much per worker it feeds and a worker this much per "
        "sender (plus the parameters being landed); cuda_ipc packs its converted wire buffers into buckets of this "
        "size, one IPC handle each. Smaller: more messages (each costs the backend's per-message latency); "
        "larger: less overlap of packing with sending. Default 32 (measured: docs/ddma.md, bench sync)."))
    native: str = knob("auto", choices=NATIVE, help=(
        "The C++ extension megarl._C: 'auto' uses it when built and otherwise logs one WARNING at start naming "
        "what runs in Python (planner, checksums, transport copies); 'required' makes a missing extension a "
        "config error. Default auto."))
    wire: str = knob("engine", choices=("engine", "fp8"), help=(
        "DDMA bytes on the wire: 'engine' (the generator's dtype) or 'fp8' (e4m3 with per-row scales, "
        "quantized before sending: half the bytes of bf16; the engine re-quantizes on arrival). Default engine."))
    verify_every: int = knob(1, help=(
        "Checksum every destination slice on both sides every N syncs; a mismatch names the tensor and stops "
        "the job (syncs; 0 = never). Default 1."))
    probe_every: int = knob(10, help=(
        "Logprob probe at the first sync, always, then every N syncs: the generator's greedy logprobs on a fixed "
        "prompt against the trainer's own on the same tokens; a gap over probe_max_gap stops the job, naming the "
        "version and the gap (syncs; 0 = only the first sync). Default 10."))
    probe_max_gap: float = knob(0.0, help=(
        "Largest allowed |generator - trainer| logprob on the probe (nats; 0 = by the coarsest of the trainer's "
        "weights, the wire and the engine: 1e-3 float32, 0.25 bfloat16/float16, 1.0 with FP8 weights or "
        "sync.wire=fp8; see megarl/controller/weight_sync.py). Default 0."))
    timeout_s: float = knob(300.0, help="Longest wait of any sync step (seconds). Default 300.")
    every: int = knob(1, help=(
        "Sync period: the trainer's weights are pushed to the generator after every K-th step (steps K, 2K, ... "
        "of the run, counted from step 0 also across a resume) and after the last step, so the generator holds "
        "version K*floor(v/K) while the trainer is at version v; the sync period is a hyperparameter of its own "
        "(e.g. K rollout batches from one policy). Versions stay the trainer's step count; "
        "controller.max_policy_lag still bounds trainer version - token version, so it must be >= K-1 (a batch "
        "generated just before training is up to K-1 versions old), and batches are admitted ahead of the "
        "generator's version, not the trainer's (megarl/controller/staleness.py). controller.eval_every must "
        "be a multiple of K (an eval measures the generator's weights). A resume pushes the resumed weights at "
        "start (steps, >= 1). Default 1."))

    def problems(self, trainer_ranks: int, on_cuda: bool | None = None, same_host: bool = True) -> list[str]:
        """Range checks, and (with ``on_cuda`` known: an explicit cluster.device) whether ``transport`` fits
        where the bytes live; with cluster.device=auto the resolved job checks it (megarl/config/job.py)."""
        out = []
        if self.native == "required" and not native_extension_present():
            out.append("sync.native=required: the C++ extension megarl._C is not built; build it with `pip install "
                       "--no-build-isolation --no-deps -e .` or set sync.native=auto (Python fallbacks, one warning)")
        if self.method == "ddma" and on_cuda is not None:
            problem = transport_problem(self.transport, device="cuda" if on_cuda else "cpu", same_host=same_host)
            if problem:
                out.append(problem)
        if self.bucket_mb < 1:
            out.append(f"sync.bucket_mb={self.bucket_mb}: must be >= 1 (MiB)")
        if self.method == "shm" and trainer_ranks > 1:
            out.append(f"sync.method=shm: needs a single-rank trainer (it assembles the whole model in one "
                       f"process); this trainer has {trainer_ranks} ranks: use sync.method=ddma")
        for key, zero in (("verify_every", "never"), ("probe_every", "only the first sync")):
            if getattr(self, key) < 0:
                out.append(f"sync.{key}={getattr(self, key)}: must be >= 0 (0 = {zero})")
        if self.every < 1:
            out.append(f"sync.every={self.every}: must be >= 1 (steps between weight pushes; 1 = every step)")
        if self.probe_max_gap < 0 or self.timeout_s <= 0:
            out.append("sync.probe_max_gap must be >= 0 and sync.timeout_s > 0")
        return out
