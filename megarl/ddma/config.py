"""The ``sync`` config section: how weights travel from the trainer to the generator after a step."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.utils.knobs import knob

METHODS = ("ddma", "shm")


@dataclass
class SyncConfig:
    method: str = knob("ddma", choices=METHODS, help=(
        "'ddma': every trainer rank sends its shards straight to the generator workers that need them "
        "(docs/ddma.md); 'shm': the old path, full HF tensors assembled by the trainer and pushed through "
        "one shared-memory file (single-rank trainer only). Default ddma."))
    transport: str = knob("zero_copy", choices=("zero_copy", "p2p"), help=(
        "DDMA transport: 'zero_copy' (same host: workers copy straight out of the trainer's shared memory) "
        "or 'p2p' (gloo point-to-point, any host). Default zero_copy."))
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
        "Largest allowed |generator - trainer| logprob on the probe (nats; 0 = by the engine's precision: "
        "1e-3 float32, 0.25 bfloat16/float16, 1.0 with FP8 weights; see megarl/controller/weight_sync.py)."))
    timeout_s: float = knob(300.0, help="Longest wait of any sync step (seconds). Default 300.")

    def problems(self, trainer_ranks: int) -> list[str]:
        out = []
        if self.method == "shm" and trainer_ranks > 1:
            out.append(f"sync.method=shm: needs a single-rank trainer (it assembles the whole model in one "
                       f"process); this trainer has {trainer_ranks} ranks: use sync.method=ddma")
        for key, zero in (("verify_every", "never"), ("probe_every", "only the first sync")):
            if getattr(self, key) < 0:
                out.append(f"sync.{key}={getattr(self, key)}: must be >= 0 (0 = {zero})")
        if self.probe_max_gap < 0 or self.timeout_s <= 0:
            out.append("sync.probe_max_gap must be >= 0 and sync.timeout_s > 0")
        return out
