"""Workload model for ``megarl simulate``: model dims, FLOPs and bytes per token, response lengths,
and the per-phase cost functions the discrete-event simulation (``events.py``) runs on.

Formulas (N = parameters in matmuls a token passes through: every HF tensor but the input embedding,
whose lookup is free; for MoE only the ``moe_topk`` routed experts of each sparse layer count, the
active parameters, e.g. 3.3 B of Qwen3-30B-A3B's 30.5 B. Weight bytes, memory and the sync always count
every expert):
- train FLOPs per token (fwd + bwd) = 6 N + 12 L d_attn s  (Chowdhery et al. 2022, PaLM, appendix B;
  L layers, d_attn = heads x head_dim, s the sequence length); T_train = FLOPs / (GPUs x peak x MFU).
- decode FLOPs per token = 2 N + 4 L d_attn ctx (QK^T and AV over ctx cached tokens).
- decode step of one replica with n active sequences whose contexts sum to S:
  max(compute, memory) + TP communication, where compute = (2 N n + 4 L d_attn S) / (F x eff),
  memory = (weight bytes + KV bytes per token x S) / (HBM bw x eff): weights are read once per step
  for the whole batch, which is why decode is memory bound at small batch. MoE (assumption): a step
  reads every expert, since a batch of n sequences leaves an expert idle with probability (1-k/E)^n
  (8 of 128 experts: 13% idle at n = 32, 2% at n = 64).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any, Mapping

from megarl.sim.hardware import Hardware
from megarl.models.layouts import ModelDims, hf_tensor_shapes

BYTES = {"bf16": 2, "fp8": 1}
REPO_ROOT = Path(__file__).resolve().parents[2]


def load_dims(path: str | Path) -> ModelDims:
    """ModelDims from an HF config.json (a family megarl trains; anything else is one ValueError line)."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p
    cfg = dict(json.loads(p.read_text()))
    return ModelDims.from_hf_config(cfg)


@dataclasses.dataclass(frozen=True)
class ModelCost:
    dims: ModelDims
    params: int          # every HF element
    matmul_params: int   # params minus the input embedding (counted in lm_head when tied)
    active_params: int = -1  # N: matmul_params with only moe_topk of num_experts routed experts per
                             # sparse layer (== matmul_params for a dense model; -1: the same)

    def __post_init__(self):
        if self.active_params < 0:
            object.__setattr__(self, "active_params", self.matmul_params)

    @classmethod
    def of(cls, dims: ModelDims) -> "ModelCost":
        shapes = hf_tensor_shapes(dims)
        total = sum(math.prod(s) for s in shapes.values())
        embed = math.prod(shapes["model.embed_tokens.weight"])
        matmul = total if dims.tie_word_embeddings else total - embed
        experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
        idle = experts - experts * dims.moe_topk // dims.num_experts if dims.is_moe else 0
        return cls(dims, total, matmul, matmul - idle)

    @property
    def d_attn(self) -> int:
        return self.dims.num_heads * self.dims.head_dim

    def train_flops_per_token(self, seq: float) -> float:
        return 6 * self.active_params + 12 * self.dims.num_layers * self.d_attn * seq

    def kv_bytes_per_token(self, kv_bytes: int = 2) -> int:
        return 2 * self.dims.num_layers * self.dims.num_kv_heads * self.dims.head_dim * kv_bytes

    def weight_bytes(self, dtype: str) -> int:
        return self.params * BYTES[dtype]


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak each phase reaches: modelling choices, each with its reason (printed)."""

    train_mfu: float = 0.40
    decode_bw: float = 0.75
    decode_flops: float = 0.50
    prefill_flops: float = 0.50
    gpu_mem_util: float = 0.90
    tp_allreduce_latency_s: float = 10e-6
    ib_allreduce_latency_s: float = 30e-6
    max_num_seqs: int = 256

    SOURCES = {
        "train_mfu": "Llama 3 paper (arXiv 2407.21783) Table 4: 38-43% bf16 MFU training 405B on H100; "
                     "taken at 40% for an RL trainer (shorter, variable sequences would lower it)",
        "decode_bw": "assumption: fraction of HBM peak a decode step's weight/KV reads reach (GEMV-like "
                     "kernels typically sustain 70-80% of peak)",
        "decode_flops": "assumption: fraction of peak FLOP/s when a decode step is compute bound",
        "prefill_flops": "assumption: fraction of peak FLOP/s for prefill (and re-prefill of resumed rollouts)",
        "gpu_mem_util": "vLLM default gpu_memory_utilization=0.9 (weights + KV cache budget per GPU)",
        "tp_allreduce_latency_s": "assumption: latency of one small NCCL all-reduce inside an NVLink node; "
                                  "2 all-reduces per layer per decode step",
        "ib_allreduce_latency_s": "assumption: the same across nodes (TP wider than a node goes over IB)",
        "max_num_seqs": "vLLM default max_num_seqs=256 (sequences decoded together per replica)",
    }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Efficiency":
        d = dict(d or {})
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"efficiency: unknown keys {sorted(unknown)}")
        return cls(**d)

    def assumptions(self, overridden: set[str] = frozenset()) -> list[tuple[str, str, str]]:
        return [(f"efficiency.{f.name}", f"{getattr(self, f.name):g}",
                 "setup yaml (overrides the default)" if f.name in overridden else self.SOURCES[f.name])
                for f in dataclasses.fields(self)]


class LengthDist:
    """Response lengths (tokens), truncated at ``max_new_tokens``; a seeded stream.

    kinds: ``fixed`` (value), ``list`` (values, cycled: deterministic cases a test can work by hand),
    ``lognormal`` (median, sigma: a long right tail, as reasoning RL replies have)."""

    def __init__(self, spec: Mapping[str, Any]):
        self.spec = dict(spec)
        self.kind = self.spec.get("kind", "lognormal")
        self.max_new = int(self.spec["max_new_tokens"])
        if self.kind not in ("fixed", "list", "lognormal"):
            raise ValueError(f"lengths.kind={self.kind!r}: expected fixed, list or lognormal")
        self.rng = random.Random(int(self.spec.get("seed", 0)))
        self.i = 0

    def next(self) -> int:
        if self.kind == "fixed":
            n = int(self.spec["value"])
        elif self.kind == "list":
            vals = self.spec["values"]
            n = int(vals[self.i % len(vals)])
        else:
            n = int(round(self.rng.lognormvariate(math.log(float(self.spec["median"])), float(self.spec["sigma"]))))
        self.i += 1
        return max(1, min(n, self.max_new))

    def mean(self, samples: int = 20000) -> float:
        probe = LengthDist(self.spec)
        return sum(probe.next() for _ in range(samples)) / samples


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """One generator replica's decode-step time, linear pieces in (n active, S = context sum)."""

    mem_base_s: float = 0.0      # weight bytes / bandwidth
    mem_per_ctx_s: float = 0.0   # KV bytes per cached token / bandwidth
    flop_per_seq_s: float = 0.0  # 2N / FLOP/s
    flop_per_ctx_s: float = 0.0  # 4 L d_attn / FLOP/s
    comm_base_s: float = 0.0     # TP all-reduce latencies per step
    comm_per_seq_s: float = 0.0  # TP all-reduce bytes per active sequence per step
    prefill_per_token_s: float = 0.0
    max_seqs: int = 1
    gpus: int = 1
    static: bool = False  # static batches (no refill until the whole batch is done), padded to the longest

    def step(self, n: int, s: float) -> float:
        return (max(self.mem_base_s + self.mem_per_ctx_s * s, self.flop_per_seq_s * n + self.flop_per_ctx_s * s)
                + self.comm_base_s + self.comm_per_seq_s * n)

    def run_time(self, n: int, s0: float, k: int) -> float:
        """Exact sum of ``step(n, s0 + n j)`` for j in [0, k): both lines are linear in j, so split at
        their crossing and sum each arithmetic series."""
        if k <= 0:
            return 0.0
        a1, b1 = self.mem_base_s + self.mem_per_ctx_s * s0, self.mem_per_ctx_s * n
        a2, b2 = self.flop_per_seq_s * n + self.flop_per_ctx_s * s0, self.flop_per_ctx_s * n
        series = lambda a, b, j0, j1: (j1 - j0) * a + b * (j0 + j1 - 1) * (j1 - j0) / 2  # noqa: E731
        first_is_1 = a1 >= a2
        if b1 == b2:
            split = k
        else:
            split = min(k, max(0, math.ceil((a2 - a1) / (b1 - b2))))
            if (first_is_1 and b1 >= b2) or (not first_is_1 and b2 >= b1):
                split = k  # the line on top at j=0 also grows faster: it stays on top
        head = series(a1, b1, 0, split) if first_is_1 else series(a2, b2, 0, split)
        tail = series(a2, b2, split, k) if first_is_1 else series(a1, b1, split, k)
        return head + tail + k * (self.comm_base_s + self.comm_per_seq_s * n)

    def steps_within(self, n: int, s0: float, dt: float, k_max: int) -> int:
        """The most whole steps that fit in ``dt`` (at most ``k_max``), by bisection over run_time."""
        lo, hi = 0, k_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.run_time(n, s0, mid) <= dt + 1e-12:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefill(self, tokens: int) -> float:
        return max(tokens * self.prefill_per_token_s, self.mem_base_s) if tokens else 0.0


def decode_cost(cost: ModelCost, hw: Hardware, eff: Efficiency, tp: int, pp: int, dtype: str,
                mean_ctx: float, resident_bytes_per_gpu: float = 0.0, static: bool = False) -> DecodeCost:
    """A vLLM-like replica over ``tp x pp`` GPUs holding ``dtype`` weights and a bf16 KV cache.

    PP in decode is not micro-batched (assumption, printed): a step walks the stages in turn, so the
    replica reads its weights at one stage's bandwidth (tp GPUs) while its KV room spans tp x pp GPUs.
    Slots: min(max_num_seqs, KV room / (KV bytes x mean context)), since paged KV grows with the
    context and a replica admits as long as the average sequence fits. ``static`` (HF-style
    ``generate``): ``mean_ctx`` is then prompt + max_new_tokens, the KV every sequence reserves, and
    the DES pads each static batch to its longest reply."""
    gpus = tp * pp
    flops = (hw.flops_fp8 if dtype == "fp8" else hw.flops_bf16) * tp
    bw = hw.hbm_bytes_per_s * tp * eff.decode_bw
    wbytes = cost.weight_bytes(dtype)
    # vLLM replicates KV heads when TP exceeds them (each rank keeps a whole head): tp / kv_heads copies
    kv_tok = cost.kv_bytes_per_token(2) * max(1, tp // cost.dims.num_kv_heads)
    room = gpus * (hw.hbm_bytes * eff.gpu_mem_util - resident_bytes_per_gpu) - wbytes
    if room <= kv_tok * mean_ctx:
        raise ValueError(f"generator TP{tp} x PP{pp} ({dtype}) has no KV room: {wbytes / 1e9:.0f} GB weights + "
                         f"{resident_bytes_per_gpu / 1e9:.1f} GB/GPU resident on {gpus} x {hw.hbm_bytes / 1e9:.0f} GB")
    slots = max(1, min(eff.max_num_seqs, int(room // (kv_tok * mean_ctx))))
    layers = cost.dims.num_layers
    cross_node = tp > hw.gpus_per_node
    link = hw.ib_bytes_per_s if cross_node else hw.nvlink_bytes_per_s
    lat = eff.ib_allreduce_latency_s if cross_node else eff.tp_allreduce_latency_s
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0  # ring all-reduce moves 2(tp-1)/tp of the buffer per GPU
    return DecodeCost(
        mem_base_s=wbytes / bw, mem_per_ctx_s=kv_tok / bw,
        flop_per_seq_s=2 * cost.active_params / (flops * eff.decode_flops),
        flop_per_ctx_s=4 * layers * cost.d_attn / (flops * eff.decode_flops),
        comm_base_s=(2 * layers * lat if tp > 1 else 0.0),
        comm_per_seq_s=2 * layers * ring * cost.dims.hidden_size * 2 / link,
        prefill_per_token_s=2 * cost.active_params / (flops * pp * eff.prefill_flops),
        max_seqs=slots, gpus=gpus, static=static)


def train_seconds(cost: ModelCost, hw: Hardware, eff: Efficiency, gpus: int, seqs: list[int]) -> float:
    """Fwd + bwd of the given sequence lengths on ``gpus`` GPUs at ``train_mfu`` of bf16 peak."""
    flops = sum(s * cost.train_flops_per_token(s) for s in seqs)
    return flops / (gpus * hw.flops_bf16 * eff.train_mfu)


def _numel(p) -> int:
    return p.length * math.prod(p.hf_shape) // p.hf_shape[p.dim]


def analytic_sync(dims: ModelDims, trainer: tuple[int, int, int], generator: tuple[int, int], dtype: str,
                  link_bytes_per_s: float, message_us: float = 0.0) -> dict:
    """The same two numbers as the projection, from layouts alone (no copy plan): each generator
    worker receives its shard; the trainer ranks share the sending evenly (the planner's least-loaded
    rule, idealised), so busiest link = max(largest worker shard, total / trainer ranks). Messages: the
    bucket model's count for the busiest link's bytes (``ddma/bucket_model.py``; a lower bound: it
    leaves out each pair's last partial message) times ``message_us``."""
    from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES, pair_messages
    from megarl.ddma.layouts import TrainerTopology, source_rank_layouts, vllm_param_layouts

    tp, pp, dp = trainer
    gtp, reps = generator
    bpe = BYTES[dtype]
    shard = [sum(_numel(p) for lay in vllm_param_layouts(dims, gtp, r).values() for p in lay.pieces) * bpe
             for r in range(gtp)]
    total = sum(shard) * reps
    model = sum(math.prod(x) for x in hf_tensor_shapes(dims).values()) * bpe
    rank0 = sum(_numel(p) for lay in source_rank_layouts(dims, TrainerTopology(tp, pp, dp), 0, 0).values()
                for p in lay.pieces) * bpe
    busiest = max(max(shard), total / (tp * pp * dp))
    base = (model - rank0) + total
    messages = pair_messages(int(busiest), DEFAULT_BUCKET_BYTES)
    return {"ddma_s": busiest / link_bytes_per_s + messages * message_us * 1e-6,
            "gather_broadcast_s": base / link_bytes_per_s, "messages_busiest_rank": messages,
            "busiest_link_bytes": busiest, "busiest_rank": "analytic", "baseline_link_bytes": base,
            "planned_as": "analytic (layouts only)", "dtype": dtype, "model_bytes": model}


def sync_seconds(dims: ModelDims, trainer: tuple[int, int, int], generator: tuple[int, int], dtype: str,
                 link_bytes_per_s: float, message_us: float = 0.0) -> dict:
    """DDMA projection (``megarl plan-sync``'s) and the gather+broadcast baseline at full scale.

    The plan is built at TP x PP x (dp/g) -> TP x (replicas/g), g = gcd(dp, replicas): a full-scale
    plan over ~1000 x ~1000 ranks does not fit this machine's memory, and per-rank bytes depend on
    replicas/dp only (DP replicas share the sending), while the baseline's broadcast is linear in the
    replica count (scaled back up here) and its gather does not depend on dp. A generator TP wider
    than the trainer's splits every trainer row run into pieces (405B TP8 -> TP16: 66M copy runs,
    over a minute to plan), so that case uses :func:`analytic_sync`, and so does an MoE model (Qwen3-30B-A3B:
    18,432 expert tensors, 207 s to plan at trainer TP4 x DP4 -> generator TP2 x 8, against 0.4 s
    analytic; projected sync 0.6114 s planned vs 0.6109 s analytic). ``message_us``: per-message latency
    of the p2p transports' bucket model (``megarl/ddma/bucket_model.py``), added per rank as
    ``megarl plan-sync --message-us`` does (0: bytes only)."""
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, validate_vllm_tp
    from megarl.ddma.project import project_sync
    from megarl.models.layouts import validate_parallel

    tp, pp, dp = trainer
    gtp, reps = generator
    validate_parallel(dims, tp, pp)
    validate_vllm_tp(dims, gtp)
    if gtp > tp or dims.is_moe:
        return analytic_sync(dims, trainer, generator, dtype, link_bytes_per_s, message_us)
    g = math.gcd(dp, reps)
    r = project_sync(dims, TrainerTopology(tp, pp, dp // g), GeneratorTopology(gtp, reps // g), dtype=dtype,
                     link_gbps=link_bytes_per_s * 8 / 1e9, message_us=message_us)
    b = r["baseline"]
    base_bytes = b["gather_bytes"] + b["broadcast_bytes"] * g
    return {"ddma_s": r["projected_sync_latency_s"], "gather_broadcast_s": base_bytes / link_bytes_per_s,
            "messages_busiest_rank": r["bucket_messages_per_rank_max"],
            "busiest_link_bytes": r["busiest_link_bytes"], "busiest_rank": r["busiest_rank"],
            "baseline_link_bytes": base_bytes, "planned_as": f"plan {tp}x{pp}x{dp // g} -> {gtp}x{reps // g} (g={g})",
            "dtype": dtype, "model_bytes": r["model_bytes"]}


__all__ = ["load_dims", "ModelCost", "Efficiency", "LengthDist", "DecodeCost", "decode_cost", "train_seconds",
           "sync_seconds", "analytic_sync", "BYTES"]
