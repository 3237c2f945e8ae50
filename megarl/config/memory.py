"""The memory plan of a GPU job, per GPU, from the config and the model's config.json alone (no
weights, no torch): what ``megarl train CONFIG --dry-run`` prints and checks.

Trainer rank (Megatron GPTModel, the largest pipeline stage, tensor-parallel shard of it), one term
per line of the printout (docs/memory.md walks through them):

- weights: the rank's parameters (exact local shapes, vocab padded, experts split over ``trainer.ep``,
  from megarl/models/layouts.py) x 2 bytes (bf16/fp16) or 4 (fp32), ``trainer.params_dtype``;
- gradients: 4 bytes/param, Megatron's fp32 main-grad buffer (``grad_reduce_in_fp32=True`` in
  megarl/trainer/optimizer.py), not sharded;
- optimizer: Adam m and v in fp32 (8 bytes/param) plus the fp32 master copy when the weights are not
  fp32 (4), divided by ``trainer.dp`` with the distributed optimizer (expert parameters by dp / ep,
  their expert-data-parallel group). With bf16 weights that is
  Megatron's documented 6 + 12/d bytes per parameter (Megatron-LM docs, "Distributed Optimizer":
  "bf16 param, fp32 grads: 6 + 12/d"); the same accounting with 2-byte gradients gives ZeRO stage 1,
  whose published example is checked in tests: 7.5B params on 64 GPUs -> 31.4 GB (Rajbhandari et al.
  2020, "ZeRO", Figure 1: 2+2+12/64 bytes x 7.5e9 = 31.4 GB; we get 31.4).
- reference: the frozen KL reference model (``algorithm.kl_coef > 0``; megarl/trainer/train_step.py
  build_reference_model): a second copy of the weights, same dtype and layout, no grads or optimizer.
- LoRA (``trainer.lora_rank`` > 0): gradients and optimizer state for the adapters only (the base is
  frozen), the adapters beside the weights, and ``lora_merged``: the sender's merged copy of the adapted
  weights (megarl/trainer/ddma.py LoraMergedSender).
- fp8_wire: ``sync.wire: fp8`` quantizes the rank's weights to e4m3 before sending: 1 byte/param
  (plus a 4-byte scale a row, counted) held on the trainer GPU while the sync runs.
- activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198, sec. 4), tensor parallel without sequence parallel, per layer and
  micro-batch ``s b (10 h + (4 h + 4 kv + 2 m F) / t)`` bytes at 16-bit (x2 at fp32), where kv = KV
  heads x head_dim (GQA) and m the FFN-wide tensors kept (SwiGLU: gate, up and their product, m = 3);
  for GPT (kv = h, GeLU 4h MLP, m = 2) this is their ``s b h (10 + 24 / t)``. All layers of the model
  (1F1B keeps pp micro-batches on the first stage, each of L/pp layers). ``trainer.recompute: full``
  keeps only each layer's input (``2 s b h`` at 16-bit) plus one layer's full activations, rebuilt
  in the backward.
- attention_scores: without transformer-engine megatron's local DotProductAttention materializes the
  [b, heads/t, s, s] scores and keeps, per layer, softmax's fp32 output (4 bytes; megatron computes
  the softmax in fp32, ``attention_softmax_in_fp32``) and, with 16-bit weights, its 16-bit cast that
  probs @ V saves (2 more; dropout is 0 in megarl, so no mask or dropout copy: Korthikanti's 5 a s^2 b
  becomes 6 a s^2 b at 16-bit, 4 a s^2 b at fp32). 0 with TE's fused attention or
  ``trainer.recompute: selective`` (core attention recomputed); under ``full`` one layer's worth.
- tokens of a micro-batch (s, rows): ``trainer.max_tokens_per_micro_batch`` = T > 0 bounds a
  micro-batch at max(T, S) real tokens (a longer sequence goes alone), packed into rows of at most S =
  ``data.max_prompt_tokens + generator.max_new_tokens``: ceil(max(T, S) / S) rows of S; without a
  budget, ``trainer.micro_batch_size`` rows of S (padded or packed, the longest row is S).
- logits: the last stage's [tokens, V/t] logits as megarl/trainer/logprobs.py handles them: the
  model's output (2 or 4 bytes), its fp32 working copy when it must cast, mask vocab padding or divide
  by a temperature (4; the cross entropy then works in place on it and saves it for the backward),
  the fp32 gradient of the logits (4) and, at 16-bit, that gradient cast back through the output
  layer (2). bf16: 12 bytes per logit where the old plan counted 8.
- entropy: ``algorithm.entropy_coef > 0`` differentiates the entropy (vocab_parallel_entropy): its
  graph keeps z = logits - max and exp(z) and forms exp(z) * z (4 bytes each): 12 bytes per logit.
- overhead: CUDA context, NCCL buffers and allocator slack, ``OVERHEAD_GB`` (an assumption).

Shared devices (``cluster.share_devices``): trainer and generator run on the same GPUs, so one GPU holds
the trainer rank's total plus the generator worker's (with ``gpu_memory_utilization`` u vLLM takes u of
the whole GPU, whatever else is there), checked once against the GPU.

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


def trainer_rank_params(dims: ModelDims, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters of the largest (tp, pp, ep) Megatron rank, vocab padding included."""
    return sum(trainer_rank_param_split(dims, tp, pp, ep))


def trainer_rank_param_split(dims: ModelDims, tp: int, pp: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of the largest (tp, pp, ep) Megatron rank: the routed experts split
    over ``ep`` (megarl/models/layouts.py), everything else on every rank."""
    from megarl.models.layouts import local_param_layouts

    best = (0, 0)
    for stage in range(pp):
        lays = local_param_layouts(dims, tp, 0, pp, stage, ep=ep)
        exp = sum(math.prod(lay.local_shape) for k, lay in lays.items() if ".experts." in k)
        dense = sum(math.prod(lay.local_shape) for k, lay in lays.items() if ".experts." not in k)
        if dense + exp > sum(best):
            best = (dense, exp)
    return best


def activation_bytes_per_layer(dims: ModelDims, seq: int, micro_batch: int, tp: int, mlp_tensors: int = 3) -> float:
    """Korthikanti et al. 2022, selective recompute, TP without SP, 16-bit activations, generalised to
    GQA and SwiGLU (``mlp_tensors`` FFN-wide tensors kept: 3 for SwiGLU, 2 for GPT's GeLU MLP)."""
    h = dims.hidden_size
    kv = dims.num_kv_heads * dims.head_dim
    return seq * micro_batch * (10 * h + (4 * h + 4 * kv + 2 * mlp_tensors * dims.ffn_hidden_size) / tp)


def attention_score_bytes_per_layer(dims: ModelDims, seq: int, rows: int, tp: int, params_dtype: str) -> float:
    """The [rows, heads/t, s, s] scores one layer keeps without fused attention: softmax's fp32 output
    (4 B) and, with 16-bit weights, its 16-bit cast (2 B) that probs @ V saves (see the module doc)."""
    per = 4 + (0 if params_dtype == "float32" else 2)
    return per * rows * (dims.num_heads / tp) * seq * seq


def micro_batch_shape(seq: int, micro_batch: int, max_tokens: int = 0) -> tuple[int, int]:
    """(row length, rows) of the largest micro-batch: ``micro_batch`` rows of ``seq`` or, with a token
    budget, max(budget, seq) tokens in rows of at most ``seq``."""
    if max_tokens > 0:
        return seq, math.ceil(max(max_tokens, seq) / seq)
    return seq, micro_batch


def logits_bytes_per_logit(params_dtype: str, *, copy: bool) -> float:
    """Bytes per [token, vocab/t] logit of the loss (megarl/trainer/logprobs.py): output, fp32 copy
    (when ``copy``), fp32 gradient, 16-bit gradient through the output layer."""
    d = DTYPE_BYTES[params_dtype]
    return d + (4 if copy else 0) + 4 + (d if d != 4 else 0)


ENTROPY_BYTES_PER_LOGIT = 12  # z, exp(z), exp(z) * z in fp32 (vocab_parallel_entropy)


def trainer_plan(dims: ModelDims, *, tp: int, pp: int, dp: int, params_dtype: str, distributed_optimizer: bool,
                 seq: int, micro_batch: int, grad_bytes: int = 4, ep: int = 1, reference: bool = False,
                 fp8_wire: bool = False, recompute: str = "none", fused_attention: bool = False,
                 max_tokens: int = 0, entropy: bool = False, temperature: float = 1.0,
                 vocab_divisible_by: int = 128, lora_rank: int = 0,
                 lora_targets: tuple = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) -> dict[str, float]:
    """Bytes per GPU of the largest trainer rank, by term (see the module doc); terms that are 0 for
    this config are still present (the printout skips zeros). ``lora_rank`` > 0 (trainer.lora_rank):
    frozen base weights (no gradient, no optimizer state), the adapters' weights, gradients and optimizer
    state, and ``lora_merged``: the DDMA sender's copy of the adapted weights' merged shards."""
    from megarl.models.layouts import padded_vocab_size

    dense, expert = trainer_rank_param_split(dims, tp, pp, ep)
    n = dense + expert
    w, g, _ = state_bytes_per_param(params_dtype, dp=dp, distributed=distributed_optimizer, grad_bytes=grad_bytes)
    _, _, o_dense = state_bytes_per_param(params_dtype, dp=dp, distributed=distributed_optimizer)
    _, _, o_exp = state_bytes_per_param(params_dtype, dp=max(1, dp // ep), distributed=distributed_optimizer)
    row_len, rows = micro_batch_shape(seq, micro_batch, max_tokens)
    act_scale = DTYPE_BYTES[params_dtype] / 2  # Korthikanti's figures are 16-bit
    layer = activation_bytes_per_layer(dims, row_len, rows, tp) * act_scale
    scores = 0.0 if fused_attention else attention_score_bytes_per_layer(dims, row_len, rows, tp, params_dtype)
    if recompute == "full":  # each layer's input kept, one layer rebuilt at a time in the backward
        acts = dims.num_layers * row_len * rows * dims.hidden_size * DTYPE_BYTES[params_dtype] + layer
        score_term = scores
    else:
        acts = dims.num_layers * layer
        score_term = 0.0 if recompute == "selective" else dims.num_layers * scores
    v_local = padded_vocab_size(dims.vocab_size, tp, vocab_divisible_by) / tp
    padded = padded_vocab_size(dims.vocab_size, tp, vocab_divisible_by) != dims.vocab_size
    copy = params_dtype != "float32" or padded or temperature != 1.0
    logits = row_len * rows * v_local
    rows_fp8 = n / max(1, dims.hidden_size)  # one scale per row of ~hidden elements
    if lora_rank > 0:
        adapters, adapted = lora_rank_params(dims, tp, pp, lora_rank, lora_targets)
        return {"weights": (n + adapters) * w, "gradients": adapters * g, "optimizer": adapters * o_dense,
                "lora_merged": adapted * w, "reference": n * w if reference else 0.0,
                "fp8_wire": n * 1.0 + 4 * rows_fp8 if fp8_wire else 0.0,
                "activations": acts, "attention_scores": score_term,
                "logits": logits * logits_bytes_per_logit(params_dtype, copy=copy),
                "entropy": logits * ENTROPY_BYTES_PER_LOGIT if entropy else 0.0,
                "overhead": OVERHEAD_GB * GB}
    return {"weights": n * w, "gradients": n * g, "optimizer": dense * o_dense + expert * o_exp,
            "reference": n * w if reference else 0.0,
            "fp8_wire": n * 1.0 + 4 * rows_fp8 if fp8_wire else 0.0,
            "activations": acts, "attention_scores": score_term,
            "logits": logits * logits_bytes_per_logit(params_dtype, copy=copy),
            "entropy": logits * ENTROPY_BYTES_PER_LOGIT if entropy else 0.0,
            "overhead": OVERHEAD_GB * GB}


def lora_rank_params(dims: ModelDims, tp: int, pp: int, rank: int, targets) -> tuple[int, int]:
    """(adapter elements, adapted weight elements) on one trainer rank of a dense model (megarl/trainer/lora.py):
    column-parallel qkv/fc1 hold A [r, in] whole and B [out/tp, r]; row-parallel proj/fc2 A [r, in/tp] and
    B [out, r]. MoE experts' linears are not counted."""
    h, q, kv, f = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.ffn_hidden_size
    shapes = {"linear_qkv": (h, q + 2 * kv, True), "linear_proj": (q, h, False), "linear_fc1": (h, 2 * f, True),
              "linear_fc2": (f, h, False)}  # (in, out, column-parallel)
    adapters = adapted = 0
    for t in targets:
        i, o, column = shapes[t]
        adapters += rank * (i + o // tp) if column else rank * (i // tp + o)
        adapted += i * o // tp
    layers = dims.num_layers // pp
    return layers * adapters, layers * adapted


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


TERM_NOTES = {
    "reference": "KL reference model, algorithm.kl_coef > 0",
    "fp8_wire": "sync.wire=fp8 buffers, 1 B/param",
    "attention_scores": "[b, heads/t, s, s] kept: no fused attention, trainer.recompute=none",
    "entropy": "algorithm.entropy_coef > 0",
    "lora_merged": "trainer.lora_rank > 0: the merged adapted weights the sync sends",
}


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
    shared: bool = False       # cluster.share_devices: one GPU holds both
    notes: list[str] = dataclasses.field(default_factory=list)  # how a term was decided (TE, tokens)

    @property
    def trainer_total(self) -> float:
        return sum(self.trainer.values())

    @property
    def generator_total(self) -> float:
        return sum(self.generator.values())

    @property
    def shared_total(self) -> float:
        return self.trainer_total + self.generator_total

    def lines(self) -> list[str]:
        def terms(d: dict[str, float]) -> list[str]:
            return [f"    {k:<17} {v / GB:7.2f} GB" + (f"  ({TERM_NOTES[k]})" if k in TERM_NOTES else "")
                    for k, v in d.items() if v]

        of = f"{self.gpu_bytes / GB:.0f}"
        seqs = self.kv_tokens / self.max_model_len if self.max_model_len else 0
        out = [f"trainer, per GPU:   {self.trainer_total / GB:6.1f} GB of {of}", *terms(self.trainer),
               f"generator, per GPU: {self.generator_total / GB:6.1f} GB of {of}; KV holds {self.kv_tokens:,.0f} "
               f"tokens = {seqs:.1f} sequences of max_model_len {self.max_model_len} (max_num_seqs "
               f"{self.max_num_seqs})", *terms(self.generator)]
        if self.shared:
            out.append(f"shared GPU (cluster.share_devices): trainer + generator {self.shared_total / GB:.1f} GB of {of}")
        out += [f"note: {n}" for n in self.notes]
        out.append(f"weight sync: {self.model_bytes / GB:.1f} GB model (bf16); busiest link {self.sync_bytes / GB:.1f} "
                   f"GB -> >= {self.sync_s:.2f} s at {SYNC_LINK_GBPS:.0f} Gb/s per GPU (megarl plan-sync for the "
                   f"exact plan)")
        return out


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


def fused_attention_expected() -> tuple[bool, str]:
    """(whether the trainer's attention is fused, why): on a machine with a GPU, whether
    transformer-engine imports here (the run uses this environment); without one, the GPU stack's
    (requirements/gpu.txt installs transformer-engine, so megarl/trainer/model.py picks the TE spec)."""
    import importlib.util
    import shutil

    if shutil.which("nvidia-smi"):
        from megarl.trainer.model import have_transformer_engine

        if have_transformer_engine():
            return True, "transformer-engine imports here: fused attention keeps no scores"
        return False, "transformer-engine does not import here: the local spec keeps the attention scores"
    te = importlib.util.find_spec("transformer_engine") is not None
    return True, ("transformer-engine " + ("imports here" if te else "is in the GPU stack (requirements/gpu.txt)")
                  + ": fused attention keeps no scores")


def plan_memory(cfg, dims: ModelDims, *, fused_attention: Optional[bool] = None) -> MemoryPlan:
    """The memory plan of ``cfg`` (a MegaRLConfig) for the model ``dims``; ``problems``: one line per
    executor (or shared GPU) that does not fit, naming the layout to run instead. ``fused_attention``:
    None = :func:`fused_attention_expected`."""
    t, g = cfg.trainer, cfg.generator
    gpu_gb, gpu_source = gpu_memory(cfg)
    gpu = gpu_gb * GB
    seq = cfg.data.max_prompt_tokens + g.max_new_tokens
    notes = []
    if fused_attention is None:
        fused_attention, why = fused_attention_expected()
        notes.append(why)
    algo = cfg.algorithm
    wire = getattr(getattr(cfg, "sync", None), "wire", "engine")
    common = dict(dp=t.dp, params_dtype=t.params_dtype, distributed_optimizer=t.use_distributed_optimizer, seq=seq,
                  ep=t.ep, reference=algo.kl_coef > 0, fp8_wire=wire == "fp8", fused_attention=fused_attention,
                  max_tokens=t.max_tokens_per_micro_batch, entropy=algo.entropy_coef > 0,
                  temperature=t.logprob_temperature, lora_rank=t.lora_rank, lora_targets=tuple(t.lora_targets))

    def trainer_at(tp: int, pp: int, mb: int, recompute: str = t.recompute, fused: bool = fused_attention):
        return trainer_plan(dims, tp=tp, pp=pp, micro_batch=mb, recompute=recompute,
                            **{**common, "fused_attention": fused})

    tr = trainer_at(t.tp, t.pp, t.micro_batch_size)
    if fused_attention and t.recompute == "none":
        unfused = trainer_at(t.tp, t.pp, t.micro_batch_size, fused=False)["attention_scores"]
        notes.append(f"without transformer-engine the scores add {unfused / GB:.1f} GB to the trainer "
                     f"(or set trainer.recompute=selective)")
    row_len, rows = micro_batch_shape(seq, t.micro_batch_size, t.max_tokens_per_micro_batch)
    notes.append(f"trainer micro-batch: {rows} row(s) of {row_len} tokens"
                 + (f" (trainer.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch})"
                    if t.max_tokens_per_micro_batch else f" (trainer.micro_batch_size={t.micro_batch_size})")
                 + f", trainer.recompute={t.recompute}")
    gw = generator_weight_bytes(dims, g.tp, g.dtype, g.quantization)
    if g.gpu_memory_utilization > 0:
        kv = max(0.0, g.gpu_memory_utilization * gpu - gw - OVERHEAD_GB * GB)
    else:
        kv = float(g.kv_cache_gib * 2**30)
    ge = {"weights": gw, "kv_cache": kv, "overhead": OVERHEAD_GB * GB}
    per_token = kv_bytes_per_token(dims, g.tp, g.dtype)
    kv_tokens = kv / per_token
    shared = bool(cfg.cluster.share_devices)
    # the room the trainer has: the whole GPU, or what the generator leaves on a shared one
    gen_total = sum(ge.values())
    trainer_room = gpu - gen_total if shared else gpu

    problems = []
    total = sum(tr.values())
    if total > trainer_room:
        fix = _trainer_fix(dims, cfg, trainer_room, trainer_at)
        where = (f"{gpu_gb:g} GB ({gpu_source}) less the generator's {gen_total / GB:.1f} GB on the shared GPU "
                 f"(cluster.share_devices)" if shared else f"{gpu_gb:g} GB ({gpu_source})")
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in tr.items() if v)
        problems.append(f"trainer.tp={t.tp} trainer.pp={t.pp}: {total / GB:.1f} GB per GPU ({parts}) does not fit "
                        f"{where}; {fix}")
    need_kv = g.max_model_len * per_token
    budget = g.gpu_memory_utilization * gpu if g.gpu_memory_utilization > 0 else gpu
    if gw + OVERHEAD_GB * GB > budget or (g.gpu_memory_utilization > 0 and kv < need_kv):
        within = (f"generator.gpu_memory_utilization={g.gpu_memory_utilization:g} of {gpu_gb:g} GB "
                  f"({budget / GB:.1f} GB)" if g.gpu_memory_utilization > 0 else f"{gpu_gb:g} GB")
        problems.append(f"generator.tp={g.tp}: weights {gw / GB:.1f} GB per GPU leave no room for the KV cache of "
                        f"one {g.max_model_len}-token sequence ({need_kv / GB:.2f} GB) in {within} ({gpu_source}); "
                        f"{_generator_tp_fix(dims, cfg, gpu, need_kv)}")
    elif gen_total > gpu:
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
                      busiest * 8 / (SYNC_LINK_GBPS * 1e9), model_bytes, problems, gpu_source, shared, notes)


def _gpus_per_node(cfg) -> int:
    return cfg.cluster.ranks_per_node or 8


def _trainer_fix(dims: ModelDims, cfg, room: float, trainer_at) -> str:
    """The layout a user would run: TP within a node first (divisors of the heads up to the GPUs per
    node), then PP at the largest such TP, then selective recompute, then a smaller micro-batch."""
    t = cfg.trainer
    per_node = _gpus_per_node(cfg)

    def fits(tp, pp, mb=t.micro_batch_size, **kw):
        return not parallel_problems(dims, tp, pp) and sum(trainer_at(tp, pp, mb, **kw).values()) <= room

    if t.recompute == "none" and trainer_at(t.tp, t.pp, t.micro_batch_size)["attention_scores"] > 0 \
            and fits(t.tp, t.pp, recompute="selective"):
        return "set trainer.recompute=selective (the attention scores are recomputed, not kept)"
    tps = [d for d in divisors(dims.num_heads) if t.tp <= d <= per_node and not parallel_problems(dims, d, 1)]
    for tp in tps:
        if tp > t.tp and fits(tp, t.pp):
            return f"set trainer.tp={tp} (tensor parallel within a node of {per_node} GPUs)"
    tp = tps[-1] if tps else t.tp
    for pp in (d for d in divisors(dims.num_layers) if d > t.pp):
        if fits(tp, pp):
            return (f"set trainer.tp={tp} trainer.pp={pp} (tensor parallel over a node of {per_node} GPUs, "
                    f"then pipeline stages)")
    for mb in range(t.micro_batch_size - 1, 0, -1):
        if fits(t.tp, t.pp, mb):
            return f"set trainer.micro_batch_size={mb}"
    return "use more GPUs per model replica (trainer.tp x trainer.pp) or a bigger GPU"


def _generator_tp_fix(dims: ModelDims, cfg, gpu: float, need_kv_at_tp1: float) -> str:
    """The smallest generator.tp within a node whose weights, overhead and one max_model_len sequence
    of KV fit what vLLM may take (``gpu_memory_utilization`` of the GPU, else 95%)."""
    g = cfg.generator
    budget = gpu * (g.gpu_memory_utilization if g.gpu_memory_utilization > 0 else 0.95)
    for tp in (d for d in divisors(dims.num_heads) if d > g.tp and d <= _gpus_per_node(cfg)):
        w = generator_weight_bytes(dims, tp, g.dtype, g.quantization)
        kv_need = g.max_model_len * kv_bytes_per_token(dims, tp, g.dtype)
        if not vllm_tp_problems(dims, tp) and w + OVERHEAD_GB * GB + kv_need <= budget:
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
