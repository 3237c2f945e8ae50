"""What a model family is, as data: the HF config it reads, what it refuses, and its layer table.

One :class:`FamilySpec` per family (``megarl/models/families/<family>.py``). Everything downstream
reads it: config validation (``architecture_problem``), :class:`megarl.models.dims.ModelDims`
(``read_dims``), the Megatron model (the flags in ``ModelDims``), both layout sides
(``megarl.models.layouts``: Megatron and vLLM names from the same :class:`LayerParam` rows, the TP
arithmetic in ``megarl.models.kinds``), ``megarl.models.tiny`` and the simulator. Nothing else
names a family. Pure Python: validation imports it before torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

from megarl.models.kinds import Kind


@dataclasses.dataclass(frozen=True)
class LayerParam:
    """One parameter of a decoder layer, named on all three sides.

    ``mcore`` is the Megatron local-spec name under ``decoder.layers.<i>.``; ``mcore_te`` the name
    under the Transformer-Engine spec where norms fuse into the next linear ('' = the same);
    ``hf`` the HF tensors it is made of under ``model.layers.<i>.`` (QKV: q, k, v; GATE_UP: gate,
    up; else one); ``vllm`` vLLM's parameter name under ``model.layers.<i>.``; ``shape`` each HF
    tensor's shape in ModelDims terms (``hidden``, ``q`` = heads x head_dim, ``kv`` = KV heads x
    head_dim, ``ffn``, ``head_dim``; QKV gives q's shape, k and v take ``kv`` on dim 0)."""

    kind: Kind
    mcore: str
    hf: tuple[str, ...]
    vllm: str
    shape: tuple[str, ...]
    mcore_te: str = ""
    # MoE: one row per routed expert. ``{e}`` in ``mcore`` is the expert's index on its expert-parallel
    # rank (Megatron's ``local_experts.<j>``), in ``hf`` its global index (``experts.<e>``), in ``vllm``
    # also global: ``experts.routed_experts.w13_weight.<e>`` (vllm 0.32's parameter name: a MoERunner
    # ``experts`` around its RoutedExperts) is expert e's block ``w13_weight[e]`` of vLLM's stacked
    # FusedMoE parameter ([E, 2 * moe_ffn / tp, hidden]: [gate_r; up_r] per expert, as GATE_UP; w2:
    # [E, hidden, moe_ffn / tp], as ROW), one contiguous block since the expert dim is outermost.
    per_expert: bool = False


# The rows every dense SwiGLU decoder layer has (Llama's layer), in Megatron's state-dict order.
ATTN_NORM = LayerParam(Kind.REPLICATED, "input_layernorm.weight", ("input_layernorm.weight",),
                       "input_layernorm.weight", ("hidden",), mcore_te="self_attention.linear_qkv.layer_norm_weight")
QKV = LayerParam(Kind.QKV, "self_attention.linear_qkv.weight",
                 ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                 "self_attn.qkv_proj.weight", ("q", "hidden"))
QKV_BIAS = LayerParam(Kind.QKV, "self_attention.linear_qkv.bias",
                      ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                      "self_attn.qkv_proj.bias", ("q",))
# qk-norm (Qwen3): RMSNorm over head_dim on every head, the same weight on every TP rank
Q_NORM = LayerParam(Kind.REPLICATED, "self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",),
                    "self_attn.q_norm.weight", ("head_dim",))
K_NORM = LayerParam(Kind.REPLICATED, "self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",),
                    "self_attn.k_norm.weight", ("head_dim",))
O_PROJ = LayerParam(Kind.ROW, "self_attention.linear_proj.weight", ("self_attn.o_proj.weight",),
                    "self_attn.o_proj.weight", ("hidden", "q"))
MLP_NORM = LayerParam(Kind.REPLICATED, "pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",),
                      "post_attention_layernorm.weight", ("hidden",), mcore_te="mlp.linear_fc1.layer_norm_weight")
GATE_UP = LayerParam(Kind.GATE_UP, "mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                     "mlp.gate_up_proj.weight", ("ffn", "hidden"))
DOWN = LayerParam(Kind.ROW, "mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "mlp.down_proj.weight",
                  ("hidden", "ffn"))
DENSE_ATTN = (ATTN_NORM, QKV, O_PROJ)
DENSE_MLP = (MLP_NORM, GATE_UP, DOWN)
# A routed-experts MLP (Qwen3-MoE; megatron-core's local spec: a SequentialMLP of per-expert linears).
# The router is whole on every TP rank on both sides (Megatron's TopKRouter, vLLM's ReplicatedLinear);
# each expert's fc1 / fc2 split over TP as a dense MLP's are.
ROUTER = LayerParam(Kind.REPLICATED, "mlp.router.weight", ("mlp.gate.weight",), "mlp.gate.weight",
                    ("experts", "hidden"))
EXPERT_GATE_UP = LayerParam(Kind.GATE_UP, "mlp.experts.local_experts.{e}.linear_fc1.weight",
                            ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                            "mlp.experts.routed_experts.w13_weight.{e}", ("moe_ffn", "hidden"), per_expert=True)
EXPERT_DOWN = LayerParam(Kind.ROW, "mlp.experts.local_experts.{e}.linear_fc2.weight",
                         ("mlp.experts.{e}.down_proj.weight",), "mlp.experts.routed_experts.w2_weight.{e}", ("hidden", "moe_ffn"),
                         per_expert=True)
# Transformer Engine fuses a dense MLP's norm into linear_fc1; an MoE layer keeps pre_mlp_layernorm
MOE_MLP_NORM = dataclasses.replace(MLP_NORM, mcore_te="")
MOE_MLP = (MOE_MLP_NORM, ROUTER, EXPERT_GATE_UP, EXPERT_DOWN)


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The routed-experts facts of an HF config (Qwen3-MoE's keys): ``layers`` are the sparse layers'
    indices (``decoder_sparse_step`` and ``mlp_only_layers`` applied), the others are dense."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def read_moe(cfg: Mapping) -> MoeSpec | None | str:
    """The MoE facts of an HF config; None for a dense config; one line for a broken one.
    transformers 5 writes ``num_local_experts`` where the published configs say ``num_experts``."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return None
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if not cfg.get(k)]
    if missing:
        return f"num_experts={experts} but the config lacks {', '.join(missing)}"
    topk, step = int(cfg["num_experts_per_tok"]), int(cfg.get("decoder_sparse_step") or 1)
    if not 1 <= topk <= experts:
        return f"num_experts_per_tok={topk} must be in 1..num_experts={experts}"
    dense = set(int(i) for i in cfg.get("mlp_only_layers") or ())
    # HF Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    layers = tuple(i for i in range(int(cfg["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)
    return MoeSpec(experts, topk, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)), layers)


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """A rope read from an HF config: base, and Llama 3's scaling when ``rope_type='llama3'``."""

    theta: float
    scaling: tuple[tuple[str, float], ...] = ()  # llama3: factor, low/high_freq_factor, original_max_pos

    @property
    def scaling_dict(self) -> dict[str, float]:
        return dict(self.scaling)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_rope(cfg: Mapping, allowed: tuple[str, ...]) -> RopeSpec | str:
    """The rope of an HF config (``rope_parameters`` in transformers 5, ``rope_scaling`` +
    ``rope_theta`` before), or one line saying why it is outside ``allowed`` rope types."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type not in allowed:
        return f"rope_type={rope_type!r} is not supported (supported: {', '.join(repr(a) for a in allowed)})"
    if rope_type == "default":
        return RopeSpec(theta)
    missing = [k for k in LLAMA3_ROPE_KEYS if rope.get(k) is None]
    if missing:
        return f"rope_type='llama3' lacks {', '.join(missing)}; a Llama 3.x config.json has all of {LLAMA3_ROPE_KEYS}"
    return RopeSpec(theta, tuple((k, float(rope[k])) for k in LLAMA3_ROPE_KEYS))


def common_problem(cfg: Mapping) -> str | None:
    """What no family here supports: activations, MLP bias, sliding windows."""
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.get('hidden_act')!r} is not supported: only 'silu' (SwiGLU)"
    if cfg.get("mlp_bias", False):
        return "mlp_bias=true is not supported (the Megatron model has no MLP bias)"
    if cfg.get("use_sliding_window", False) or cfg.get("sliding_window") not in (None, 0) and \
            cfg.get("use_sliding_window", True):
        return (f"sliding_window={cfg.get('sliding_window')!r} is not supported (Megatron attends over the whole "
                f"sequence); only configs with sliding_window null (or use_sliding_window false) train here")
    return None


REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A model family: its HF identity, its own refusals, its rope types and its layer table.

    ``problem(cfg)`` adds the family's own refusals to :func:`common_problem`; ``flags`` are the
    ModelDims flags the Megatron model reads (``qkv_bias``, ``qk_norm``); ``tiny`` are the extra
    HF config arguments ``megarl.models.tiny`` passes to ``hf_config_class``; ``moe_layer`` is the
    table of a sparse (routed-experts) layer, empty for a dense family (which refuses MoE keys)."""

    model_type: str
    architecture: str
    hf_config_class: str
    layer: tuple[LayerParam, ...]
    rope_types: tuple[str, ...] = ("default",)
    problem: Callable[[Mapping], str | None] = lambda cfg: None
    tiny: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # model-level tensors (the same in every family here): HF name -> vLLM name
    embedding: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    moe_layer: tuple[LayerParam, ...] = ()

    def layer_rows(self, layer: int, moe_layers: tuple[int, ...] = ()) -> tuple[LayerParam, ...]:
        """The parameter table of decoder layer ``layer`` (global index): sparse or dense."""
        return self.moe_layer if layer in moe_layers else self.layer

    @property
    def qkv_bias(self) -> bool:
        return any(p.kind is Kind.QKV and p.mcore.endswith(".bias") for p in self.layer)

    @property
    def qk_norm(self) -> bool:
        return any(p.mcore.endswith(("q_layernorm.weight", "k_layernorm.weight")) for p in self.layer)

    def config_problem(self, cfg: Mapping) -> str | None:
        """One line (without the family prefix) for anything of ``cfg`` this family cannot train."""
        archs = cfg.get("architectures") or [self.architecture]
        if list(archs) != [self.architecture]:
            return f"architectures={list(archs)} is not supported (only {self.architecture})"
        missing = [k for k in REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            return f"config.json lacks {', '.join(missing)}"
        problem = common_problem(cfg) or self.problem(cfg)
        if problem:
            return problem
        if not self.moe_layer:
            for key in MOE_KEYS:
                if cfg.get(key):
                    return f"{key}={cfg[key]}: mixture-of-experts models are supported only as qwen3_moe"
        else:
            moe = read_moe(cfg)
            if isinstance(moe, str):
                return moe
        rope = read_rope(cfg, self.rope_types)
        return rope if isinstance(rope, str) else None


__all__ = ["FamilySpec", "LayerParam", "RopeSpec", "MoeSpec", "read_moe", "read_rope", "common_problem", "ROUTER",
           "EXPERT_GATE_UP", "EXPERT_DOWN", "MOE_MLP", "MOE_KEYS", "ATTN_NORM", "QKV", "QKV_BIAS",
           "Q_NORM", "K_NORM", "O_PROJ", "MLP_NORM", "GATE_UP", "DOWN", "DENSE_ATTN", "DENSE_MLP", "LLAMA3_ROPE_KEYS"]
