"""The architecture facts of a supported HF config, and the parallel-size rules, in one place.

Pure Python (no torch): config validation, the simulator and ``megarl plan-sync`` read the same
:class:`ModelDims` and the same rules (:func:`parallel_problems`, :func:`vllm_tp_problems`) as the
trainer and the generator, so a layout refused at start is exactly one that could not run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from megarl.models.families import architecture_problem, family_spec, read_rope
from megarl.models.families.spec import read_moe

# ModelDims field -> the HF config key it comes from, to name the key in messages
HF_KEYS = {"family": "model_type", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn_hidden_size": "intermediate_size",
           "vocab_size": "vocab_size", "tie_word_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias",
           "qk_norm": "model_type", "rope_theta": "rope_theta", "rope_scaling": "rope_parameters",
           "num_experts": "num_experts", "moe_topk": "num_experts_per_tok",
           "moe_ffn_hidden_size": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob",
           "moe_layers": "mlp_only_layers"}


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """What the Megatron model, both layout sides and the planners need of an HF config.

    ``qkv_bias`` / ``qk_norm`` come from the family's layer table (Qwen2: biases; Qwen3: q/k norms);
    ``rope_scaling`` is Llama 3's ``(key, value)`` pairs (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``), empty for plain rope.
    MoE (0 / empty for dense): ``num_experts`` routed experts, ``moe_topk`` per token, each of
    intermediate size ``moe_ffn_hidden_size``, ``norm_topk_prob`` (renormalize the k weights),
    ``moe_layers`` the sparse layers' global indices (the rest use the dense ``ffn_hidden_size``)."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, float], ...] = ()
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> "ModelDims":
        """Read an HF ``config.json`` dict; raise ValueError (one line) for anything unsupported."""
        problem = architecture_problem(cfg)
        if problem:
            raise ValueError(f"HF config: {problem}")
        spec = family_spec(cfg["model_type"])
        rope = read_rope(cfg, spec.rope_types)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        moe = read_moe(cfg) if spec.moe_layer else None  # a str was refused by architecture_problem
        moe_fields = {} if moe is None else dict(
            num_experts=moe.num_experts, moe_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden_size,
            norm_topk_prob=moe.norm_topk_prob, moe_layers=moe.layers)
        return cls(
            family=spec.model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias,
            qk_norm=spec.qk_norm,
            rope_scaling=rope.scaling,
            **moe_fields,
        )

    def as_json(self) -> dict:
        """The fields as JSON holds them (``rope_scaling``'s pairs become lists), so a signature saved in
        a checkpoint's meta.json compares equal to one computed now. A dense model leaves out the MoE
        fields, so its signature is the one checkpoints saved before MoE existed."""
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        if not self.is_moe:
            for key in MOE_FIELDS:
                out.pop(key)
        return out

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


MOE_FIELDS = ("num_experts", "moe_topk", "moe_ffn_hidden_size", "norm_topk_prob", "moe_layers")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_problems(dims: ModelDims, tp: int, pp: int, *, tp_key: str = "tp", pp_key: str = "pp") -> list[str]:
    """Why Megatron cannot split the model over ``tp`` x ``pp``, one line each naming the knob
    (``tp_key`` / ``pp_key``, e.g. ``trainer.tp``), the HF config key and the values that would work."""
    if tp < 1 or pp < 1:
        return [f"{tp_key}={tp} {pp_key}={pp}: tensor/pipeline parallel sizes must be >= 1"]
    out = []
    heads, kvh, ffn = dims.num_heads, dims.num_kv_heads, dims.ffn_hidden_size
    if heads % kvh:
        out.append(f"the HF config num_attention_heads={heads} is not a multiple of num_key_value_heads={kvh}")
    elif heads % tp:
        out.append(f"{tp_key}={tp} does not divide the HF config num_attention_heads={heads}; "
                   f"use one of {divisors(heads)}")
    elif kvh % tp:
        out.append(f"{tp_key}={tp} does not divide the HF config num_key_value_heads={kvh} (Megatron splits "
                   f"query groups evenly over TP); use one of {divisors(kvh)}")
    elif ffn % tp:
        out.append(f"{tp_key}={tp} does not divide the HF config intermediate_size={ffn}; use one of "
                   f"{[d for d in divisors(kvh) if ffn % d == 0]}")
    if dims.is_moe and dims.moe_ffn_hidden_size % tp:
        out.append(f"{tp_key}={tp} does not divide the HF config moe_intermediate_size={dims.moe_ffn_hidden_size} "
                   f"(each expert splits over TP); use one of {divisors(dims.moe_ffn_hidden_size)}")
    if dims.num_layers % pp:
        out.append(f"{pp_key}={pp} does not divide the HF config num_hidden_layers={dims.num_layers}; "
                   f"use one of {divisors(dims.num_layers)}")
    return out


def expert_parallel_problems(dims: ModelDims, ep: int, dp: int, *, ep_key: str = "ep",
                             dp_key: str = "dp") -> list[str]:
    """Why Megatron cannot split the experts over ``ep`` ranks with data parallel ``dp``, one line each.
    Megatron's expert-parallel group lives inside the data-parallel ranks (its ``expert_model_parallel_size``
    must divide dp at expert TP = TP), and every EP rank holds the same number of experts."""
    if ep < 1:
        return [f"{ep_key}={ep}: the expert parallel size must be >= 1"]
    if ep == 1:
        return []
    if not dims.is_moe:
        return [f"{ep_key}={ep} but the model has no experts (model_type={dims.family!r}); set {ep_key}=1"]
    out = []
    if dims.num_experts % ep:
        out.append(f"{ep_key}={ep} does not divide the HF config num_experts={dims.num_experts}; use one of "
                   f"{divisors(dims.num_experts)}")
    if dp % ep:
        out.append(f"{ep_key}={ep} does not divide {dp_key}={dp} (Megatron's expert parallel ranks are data "
                   f"parallel ranks); use an {ep_key} among {[d for d in divisors(dp) if dims.num_experts % d == 0]} "
                   f"or more trainer ranks")
    return out


def vllm_tp_problems(dims: ModelDims, tp: int, *, tp_key: str = "generator tp") -> list[str]:
    """Why vLLM cannot split the model over ``tp`` workers, one line each; [] when it can."""
    if tp < 1:
        return [f"{tp_key}={tp}: must be >= 1"]
    kvh, heads = dims.num_kv_heads, dims.num_heads
    if heads % tp:
        return [f"{tp_key}={tp} does not divide the HF config num_attention_heads={heads}; use one of "
                f"{divisors(heads)}"]
    if (tp <= kvh and kvh % tp) or (tp > kvh and tp % kvh):
        return [f"{tp_key}={tp}: vLLM needs the HF config num_key_value_heads={kvh} and TP to divide one "
                f"another; use one of {[d for d in divisors(heads) if kvh % d == 0 or d % kvh == 0]}"]
    if dims.ffn_hidden_size % tp:
        return [f"{tp_key}={tp} does not divide the HF config intermediate_size={dims.ffn_hidden_size}"]
    if dims.is_moe and dims.moe_ffn_hidden_size % tp:  # vLLM's FusedMoE splits each expert over TP
        return [f"{tp_key}={tp} does not divide the HF config moe_intermediate_size={dims.moe_ffn_hidden_size}"]
    return []


def validate_parallel(dims: ModelDims, tp: int, pp: int) -> None:
    """Raise ValueError (the first of :func:`parallel_problems`) when Megatron cannot split the model."""
    problems = parallel_problems(dims, tp, pp)
    if problems:
        raise ValueError(problems[0])


def validate_vllm_tp(dims: ModelDims, tp: int) -> None:
    """Raise ValueError when vLLM cannot split the model over ``tp`` workers."""
    problems = vllm_tp_problems(dims, tp)
    if problems:
        raise ValueError(problems[0])


def pp_layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layer indices held by a pipeline stage (Megatron's even split)."""
    per_stage = num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


__all__ = ["ModelDims", "HF_KEYS", "parallel_problems", "expert_parallel_problems", "vllm_tp_problems", "validate_parallel", "validate_vllm_tp",
           "pp_layer_range", "divisors"]
