"""The memory plan of a GPU job, per GPU, from the config and the model's config.json alone (no
weights, no torch): what ``megarl train CONFIG --dry-run`` prints and checks.

Trainer rank (Megatron GPTModel, the largest pipeline stage, tensor-parallel shard of it):

- weights: the rank's parameters (exact local shapes, vocab padded, from megarl/models/layouts.py)
  x 2 bytes (bf16/fp16) or 4 (fp32), ``trainer.params_dtype``;
- gradients: 4 bytes/param, Megatron's fp32 main-grad buffer (``grad_reduce_in_fp32=True`` in
  megarl/trainer/optimizer.py), not sharded;
- optimizer: Adam m and v in fp32 (8 bytes/param) plus the fp32 master copy when the weights are not
  fp32 (4), divided by ``trainer.dp`` with the distributed optimizer. With bf16 weights that is
  Megatron's documented 6 + 12/d bytes per parameter (Megatron-LM docs, "Distributed Optimizer":
  "bf16 param, fp32 grads: 6 + 12/d"); the same accounting with 2-byte gradients gives ZeRO stage 1,
  whose published example is checked in tests: 7.5B params on 64 GPUs -> 31.4 GB (Rajbhandari et al.
  2020, "ZeRO", Figure 1: 2+2+12/64 bytes x 7.5e9 = 31.4 GB; we get 31.4).
- activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198, sec. 4), selective recomputation, i.e. no s x s attention scores kept
  (as flash attention), tensor parallel without sequence parallel: per layer and micro-batch
  ``s b (10 h + (4 h + 4 kv + 2 m F) / t)`` bytes, where kv = KV heads x head_dim (GQA) and m the
  FFN-wide tensors kept (SwiGLU: gate, up and their product, m = 3); for GPT (kv = h, GeLU 4h MLP,
  m = 2) this is their ``s b h (10 + 24 / t)``. All layers of the model (1F1B keeps pp micro-batches
  on the first stage, each of L/pp layers), plus the last stage's fp32 logits and their gradient:
  ``8 s b V / t``. s = ``data.max_prompt_tokens + generator.max_new_tokens``, b =
  ``trainer.micro_batch_size``.
- overhead: CUDA context, NCCL buffers and allocator slack, ``OVERHEAD_GB`` (an assumption).

Generator worker (one GPU of a vLLM replica):

- weights: all parameters / ``generator.tp`` (KV projections replicated past the KV head count),
  x 2 bytes (bf16), 4 (fp32), 1 for the layers' linear weights with an fp8 ``generator.quantization``;
- KV cache: ``generator.kv_cache_gib`` per GPU, or with ``generator.gpu_memory_utilization`` > 0
  what that fraction of the GPU leaves after weights and overhead; it must hold at least one
  ``generator.max_model_len`` sequence (vLLM refuses to start otherwise); the plan prints how many
  full-length sequences fit beside ``generator.max_num_seqs``;
- overhead: as above (vLLM's activation peak and CUDA graphs).

The weight sync: DDMA moves every generator worker its shard once, straight from the trainer ranks
holding it; the busiest link carries max(a worker's shard, the replicas' bytes spread over the trainer
ranks), over one NIC of ``SYNC_LINK_GBPS`` per rank: a lower bound (``megarl plan-sync`` plans the
exact messages).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megarl.models.dims import ModelDims, divisors, parallel_problems, vllm_tp_problems

GB = 1e9
OVERHEAD_GB = 2.0           # per GPU: CUDA context (~0.5 GB), NCCL buffers, allocator slack (assumption)
SYNC_LINK_GBPS = 400.0      # one NIC per GPU (DGX H100: 8x ConnectX-7 400 Gb/s)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FP8_QUANTIZATIONS = ("fp8_per_channel", "fp8_per_tensor", "fp8_per_block")


def param_counts(dims: ModelDims) -> dict[str, int]:
    """HF element counts: 'total', 'embed' (input embedding), 'head' (lm_head, 0 when tied),
    'layers' (all decoder layers), 'linear' (the layers' matmul weights)."""
    from megarl.models.layouts import hf_tensor_shapes

    shapes = hf_tensor_shapes(dims)
    numel = {k: math.prod(v) for k, v in shapes.items()}
    layers = sum(v for k, v in numel.items() if ".layers." in k)
    linear = sum(v for k, v in numel.items() if ".layers." in k and k.endswith("proj.weight"))
    return {"total": sum(numel.values()), "embed": numel.get("model.embed_tokens.weight", 0),
            "head": numel.get("lm_head.weight", 0), "layers": layers, "linear": linear}


def trainer_rank_params(dims: ModelDims, tp: int, pp: int) -> int:
    """Parameters of the largest (tp, pp) Megatron rank, vocab padding included."""
    from megarl.models.layouts import local_param_layouts

    return max(sum(math.prod(lay.local_shape) for lay in local_param_layouts(dims, tp, 0, pp, stage).values())
               for stage in range(pp))


def activation_bytes_per_layer(dims: ModelDims, seq: int, micro_batch: int, tp: int, mlp_tensors: int = 3) -> float:
    """Korthikanti et al. 2022, selective recompute, TP without SP, 16-bit activations, generalised to
    GQA and SwiGLU (``mlp_tensors`` FFN-wide tensors kept: 3 for SwiGLU, 2 for GPT's GeLU MLP)."""
    h = dims.hidden_size
    kv = dims.num_kv_heads * dims.head_dim
    return seq * micro_batch * (10 * h + (4 * h + 4 * kv + 2 * mlp_tensors * dims.ffn_hidden_size) / tp)


def trainer_plan(dims: ModelDims, *, tp: int, pp: int, dp: int, params_dtype: str, distributed_optimizer: bool,
                 seq: int, micro_batch: int, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes per GPU of the largest trainer rank, by part (see the module doc)."""
    n = trainer_rank_params(dims, tp, pp)
    w, g, o = state_bytes_per_param(params_dtype, dp=dp, distributed=distributed_optimizer, grad_bytes=grad_bytes)
    acts = dims.num_layers * activation_bytes_per_layer(dims, seq, micro_batch, tp)
    logits = 8 * seq * micro_batch * dims.vocab_size / tp
    return {"weights": n * w, "gradients": n * g, "optimizer": n * o, "activations": acts + logits,
            "overhead": OVERHEAD_GB * GB}


def state_bytes_per_param(params_dtype: str, *, dp: int, distributed: bool, grad_bytes: int = 4) -> tuple[float, ...]:
    """(weights, gradients, optimizer) bytes per parameter on one rank: Adam m, v in fp32 and an fp32
    master copy unless the weights are fp32, sharded over ``dp`` with the distributed optimizer."""
    opt = 8 + (0 if params_dtype == "float32" else 4)
    return float(DTYPE_BYTES[params_dtype]), float(grad_bytes), opt / (dp if distributed else 1)


def generator_weight_bytes(dims: ModelDims, tp: int, dtype: str, quantization: str) -> float:
    """Weight bytes of one generator GPU (KV projections replicated when tp > KV heads)."""
    c = param_counts(dims)
    b = DTYPE_BYTES[dtype]
    linear_b = 1 if quantization in FP8_QUANTIZATIONS else b
    kv_rep = max(1, tp // dims.num_kv_heads) if tp > dims.num_kv_heads else 1
    kv_params = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * dims.hidden_size
    linear = c["linear"] + kv_params * (kv_rep - 1)
    rest = c["total"] - c["linear"]
    return (linear * linear_b + rest * b) / tp


def kv_bytes_per_token(dims: ModelDims, tp: int, dtype: str) -> float:
    """KV-cache bytes one token costs on one GPU of a TP-``tp`` engine."""
    heads = max(1, dims.num_kv_heads // tp) if tp <= dims.num_kv_heads else 1
    return 2 * dims.num_layers * heads * dims.head_dim * DTYPE_BYTES[dtype]


@dataclasses.dataclass
class MemoryPlan:
    trainer: dict[str, float]
    generator: dict[str, float]
    gpu_bytes: float
    kv_tokens: float           # tokens the KV cache holds per replica
    max_model_len: int
    max_num_seqs: int
    sync_bytes: float          # busiest link's bytes per sync
    sync_s: float              # projected (lower bound) sync time
    model_bytes: float         # bf16 bytes of the whole model
    problems: list[str]
    gpu_source: str = ""       # where the GPU's memory figure comes from

    @property
    def trainer_total(self) -> float:
        return sum(self.trainer.values())

    @property
    def generator_total(self) -> float:
        return sum(self.generator.values())

    def lines(self) -> list[str]:
        def part(d: dict[str, float]) -> str:
            return ", ".join(f"{k} {v / GB:.1f}" for k, v in d.items())

        seqs = self.kv_tokens / self.max_model_len if self.max_model_len else 0
        return [f"trainer, per GPU:   {self.trainer_total / GB:6.1f} GB of {self.gpu_bytes / GB:.0f} ({part(self.trainer)})",
                f"generator, per GPU: {self.generator_total / GB:6.1f} GB of {self.gpu_bytes / GB:.0f} "
                f"({part(self.generator)}); KV holds {self.kv_tokens:,.0f} tokens = {seqs:.1f} sequences of "
                f"max_model_len {self.max_model_len} (max_num_seqs {self.max_num_seqs})",
                f"weight sync: {self.model_bytes / GB:.1f} GB model (bf16); busiest link {self.sync_bytes / GB:.1f} GB "
                f"-> >= {self.sync_s:.2f} s at {SYNC_LINK_GBPS:.0f} Gb/s per GPU (megarl plan-sync for the exact plan)"]


DEFAULT_GPU_GB = 80.0  # H100 80GB, when neither the config nor this machine says


def gpu_memory(cfg) -> tuple[float, str]:
    """(GB of one GPU, where the number comes from): ``cluster.gpu_memory_gb``, else this machine's
    first GPU as nvidia-smi reports it, else :data:`DEFAULT_GPU_GB`."""
    if cfg.cluster.gpu_memory_gb > 0:
        return cfg.cluster.gpu_memory_gb, "cluster.gpu_memory_gb"
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            if out and out[0].isdigit():
                return int(out[0]) * 2**20 / GB, "this machine's GPU (nvidia-smi)"
        except (OSError, subprocess.SubprocessError):
            pass
    return DEFAULT_GPU_GB, "cluster.gpu_memory_gb=0 and no GPU here: H100 80GB assumed"


def plan_memory(cfg, dims: ModelDims) -> MemoryPlan:
    """The memory plan of ``cfg`` (a MegaRLConfig) for the model ``dims``; ``problems``: one line per
    executor that does not fit, naming the knob to change."""
    t, g = cfg.trainer, cfg.generator
    gpu_gb, gpu_source = gpu_memory(cfg)
    gpu = gpu_gb * GB
    seq = cfg.data.max_prompt_tokens + g.max_new_tokens

    def trainer_at(tp: int, pp: int, mb: int) -> dict[str, float]:
        return trainer_plan(dims, tp=tp, pp=pp, dp=t.dp, params_dtype=t.params_dtype,
                            distributed_optimizer=t.use_distributed_optimizer, seq=seq, micro_batch=mb)

    tr = trainer_at(t.tp, t.pp, t.micro_batch_size)
    gw = generator_weight_bytes(dims, g.tp, g.dtype, g.quantization)
    if g.gpu_memory_utilization > 0:
        kv = max(0.0, g.gpu_memory_utilization * gpu - gw - OVERHEAD_GB * GB)
    else:
        kv = float(g.kv_cache_gib * 2**30)
    ge = {"weights": gw, "kv_cache": kv, "overhead": OVERHEAD_GB * GB}
    per_token = kv_bytes_per_token(dims, g.tp, g.dtype)
    kv_tokens = kv / per_token

    problems = []
    total = sum(tr.values())
    if total > gpu:
        fix = _trainer_fix(dims, cfg, gpu, trainer_at)
        problems.append(f"trainer.tp={t.tp} trainer.pp={t.pp}: {total / GB:.1f} GB per GPU (weights "
                        f"{tr['weights'] / GB:.1f}, gradients {tr['gradients'] / GB:.1f}, optimizer "
                        f"{tr['optimizer'] / GB:.1f}, activations {tr['activations'] / GB:.1f}) does not fit "
                        f"{gpu_gb:g} GB ({gpu_source}); {fix}")
    gtotal = sum(ge.values())
    need_kv = g.max_model_len * per_token
    if gw + OVERHEAD_GB * GB > gpu or (g.gpu_memory_utilization > 0 and kv < need_kv):
        problems.append(f"generator.tp={g.tp}: weights {gw / GB:.1f} GB per GPU leave no room for the KV cache of "
                        f"one {g.max_model_len}-token sequence ({need_kv / GB:.2f} GB) in {gpu_gb:g} GB ({gpu_source}); "
                        f"{_generator_tp_fix(dims, cfg, gpu, need_kv)}")
    elif gtotal > gpu:
        room = int((gpu - gw - OVERHEAD_GB * GB) / 2**30)
        problems.append(f"generator.kv_cache_gib={g.kv_cache_gib}: weights {gw / GB:.1f} GB + KV cache {kv / GB:.1f} GB "
                        f"per GPU do not fit {gpu_gb:g} GB ({gpu_source}); set "
                        f"generator.kv_cache_gib={room} or less")
    elif kv < need_kv:
        problems.append(f"generator.kv_cache_gib={g.kv_cache_gib}: holds {kv_tokens:,.0f} tokens, less than one "
                        f"generator.max_model_len={g.max_model_len} sequence; set generator.kv_cache_gib="
                        f"{math.ceil(need_kv / 2**30)} or more")

    model_bytes = param_counts(dims)["total"] * 2
    trainer_ranks = t.tp * t.pp * t.dp
    busiest = max(model_bytes / g.tp, model_bytes * g.replicas / trainer_ranks)
    return MemoryPlan(tr, ge, gpu, kv_tokens, g.max_model_len, g.max_num_seqs, busiest,
                      busiest * 8 / (SYNC_LINK_GBPS * 1e9), model_bytes, problems, gpu_source)


def _trainer_fix(dims: ModelDims, cfg, gpu: float, trainer_at) -> str:
    """The first change that fits: more TP, more PP, a smaller micro-batch."""
    t = cfg.trainer
    for tp in (d for d in divisors(dims.num_heads) if d > t.tp and d <= 64):
        if not parallel_problems(dims, tp, t.pp) and sum(trainer_at(tp, t.pp, t.micro_batch_size).values()) <= gpu:
            return f"set trainer.tp={tp} (or more GPUs per replica via trainer.pp)"
    for pp in (d for d in divisors(dims.num_layers) if d > t.pp):
        if not parallel_problems(dims, t.tp, pp) and sum(trainer_at(t.tp, pp, t.micro_batch_size).values()) <= gpu:
            return f"set trainer.pp={pp}"
    for mb in range(t.micro_batch_size - 1, 0, -1):
        if sum(trainer_at(t.tp, t.pp, mb).values()) <= gpu:
            return f"set trainer.micro_batch_size={mb}"
    return "use more GPUs per model replica (trainer.tp x trainer.pp) or a bigger GPU"


def _generator_tp_fix(dims: ModelDims, cfg, gpu: float, need_kv_at_tp1: float) -> str:
    g = cfg.generator
    for tp in (d for d in divisors(dims.num_heads) if d > g.tp and d <= 64):
        w = generator_weight_bytes(dims, tp, g.dtype, g.quantization)
        kv_need = g.max_model_len * kv_bytes_per_token(dims, tp, g.dtype)
        if not vllm_tp_problems(dims, tp) and w + OVERHEAD_GB * GB + kv_need <= gpu * 0.95:
            return f"set generator.tp={tp}"
    if g.quantization == "none":
        return "set generator.quantization=fp8_per_tensor or raise generator.tp"
    return "raise generator.tp or lower generator.max_model_len"


def plan_for(cfg) -> Optional[MemoryPlan]:
    """The plan of ``cfg`` when its model's shape is known here (else None)."""
    from megarl.config.validate import model_shape

    shape = model_shape(cfg.model.path, shipped_ok=True)
    if not shape or "_error" in shape:
        return None
    return plan_memory(cfg, ModelDims.from_hf_config(shape))


def dry_run_report(cfg) -> tuple[list[str], list[str]]:
    """(lines to print, problems) for ``megarl train CONFIG --dry-run``: ranks and nodes, what was
    not on this machine, the data choice, and on GPUs the memory plan."""
    from megarl.config.validate import absent_paths, cuda_expected, rank_counts

    counts = rank_counts(cfg)
    t, g = cfg.trainer, cfg.generator
    per_node = cfg.cluster.ranks_per_node or 8
    if cfg.cluster.launcher == "slurm":  # separate node pools (docs/slurm.md)
        nodes = (f"{cfg.cluster.trainer_nodes or math.ceil(counts['trainer'] / per_node)} trainer + "
                 f"{cfg.cluster.generator_nodes or math.ceil(counts['generator'] / per_node)} generator node(s)")
    else:  # the controller spawns both executors on its own node
        nodes = f"{math.ceil(counts['total'] / per_node)} node(s), trainer and generator side by side"
    lines = [f"ranks: trainer tp{t.tp} x pp{t.pp} x dp{t.dp} = {counts['trainer']}, generator tp{g.tp} x "
             f"{g.replicas} replica(s) = {counts['generator']}; {counts['total']} GPUs: {nodes} (launcher "
             f"{cfg.cluster.launcher}), {per_node} GPUs a node (cluster.ranks_per_node"
             f"{'' if cfg.cluster.ranks_per_node else ' 0: 8 assumed'})"]
    lines += [f"not here: {line}" for line in absent_paths(cfg)]
    if cfg.data.choice:
        lines.append(f"data: {cfg.data.choice}")
    if not cuda_expected(cfg.cluster.device):
        return lines + ["memory plan: none (cluster.device is not cuda)"], []
    plan = plan_for(cfg)
    if plan is None:
        return lines + ["memory plan: none (the model's config.json is not here nor in configs/models/)"], []
    lines.append(f"memory plan against {plan.gpu_bytes / GB:g} GB per GPU ({plan.gpu_source}); estimates, "
                 f"megarl/config/memory.py says how each is counted:")
    return lines + [f"  {ln}" for ln in plan.lines()], plan.problems
