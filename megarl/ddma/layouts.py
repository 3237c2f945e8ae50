"""DDMA layouts: which HF slices every trainer rank and every vLLM worker holds (dims only).

One vocabulary for both sides, :class:`megarl.models.layouts.Piece` / ``ParamLayout``:
a piece says ``local[param].narrow(dim, local_start, length) == hf[hf_name].narrow(dim, hf_start,
length)`` with every other dim whole. Nothing here touches weights or imports vLLM/Megatron, so
405B-sized layouts are computed instantly.

Source (trainer, Megatron): :func:`source_layouts` gives, for every rank ``SrcRank(tp, pp, dp)`` of a
TP x PP x DP trainer, the pieces of :func:`megarl.models.layouts.local_param_layouts` (DP replicas
hold identical pieces). With tied embeddings the last PP stage's ``output_layer.weight`` (a synced
copy of ``model.embed_tokens.weight``) is skipped: it would duplicate the embedding.

Destination (generator, vLLM): :func:`vllm_param_layouts` gives one worker's parameters, named as
vLLM names them, in vLLM's layout:
- ``self_attn.qkv_proj`` = ``[q_r; k_r; v_r]`` (weight, and bias for Qwen2). KV heads are split over
  TP when ``TP <= num_kv_heads`` and REPLICATED when ``TP > num_kv_heads``: rank ``t`` holds KV head
  ``t * num_kv_heads // TP`` (vLLM's ``tp_rank // num_kv_head_replicas``).
- ``mlp.gate_up_proj`` = ``[gate_r; up_r]``; ``o_proj`` / ``down_proj`` split on dim 1.
- ``model.embed_tokens`` / ``lm_head`` vocab-parallel on dim 0: the vocab padded to a multiple of
  64 (vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``), then split evenly; padding rows hold no HF data.
  Tied embeddings: no ``lm_head.weight`` parameter.
- norms replicated, named as in HF.
"""

from __future__ import annotations

import dataclasses

from megarl.models.layouts import ModelDims, ParamLayout, Piece, local_param_layouts

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
TIED_COPY_PARAM = "output_layer.weight"


@dataclasses.dataclass(frozen=True, order=True)
class SrcRank:
    """A trainer (Megatron) rank."""

    tp: int
    pp: int
    dp: int


@dataclasses.dataclass(frozen=True, order=True)
class DstRank:
    """A generator (vLLM) worker: replica ``replica``, tensor-parallel rank ``tp``."""

    replica: int
    tp: int


@dataclasses.dataclass(frozen=True)
class TrainerTopology:
    tp: int
    pp: int
    dp: int = 1
    norm_style: str = "local"
    vocab_divisible_by: int = 128

    def ranks(self) -> list[SrcRank]:
        return [SrcRank(t, p, d) for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]


@dataclasses.dataclass(frozen=True)
class GeneratorTopology:
    tp: int
    replicas: int = 1
    vocab_padding: int = VLLM_VOCAB_PADDING

    def ranks(self) -> list[DstRank]:
        return [DstRank(r, t) for r in range(self.replicas) for t in range(self.tp)]


def source_rank_layouts(dims: ModelDims, topo: TrainerTopology, tp_rank: int, pp_rank: int) -> dict[str, ParamLayout]:
    """One trainer rank's params (any DP replica), minus the tied output-layer copy."""
    out = local_param_layouts(dims, topo.tp, tp_rank, topo.pp, pp_rank, norm_style=topo.norm_style,
                              vocab_divisible_by=topo.vocab_divisible_by)
    if dims.tie_word_embeddings:
        out.pop(TIED_COPY_PARAM, None)
    return out


def source_layouts(dims: ModelDims, topo: TrainerTopology) -> dict[SrcRank, dict[str, ParamLayout]]:
    """Every trainer rank's layouts (DP replicas share the same dict object)."""
    per_stage = {(t, p): source_rank_layouts(dims, topo, t, p) for p in range(topo.pp) for t in range(topo.tp)}
    return {r: per_stage[(r.tp, r.pp)] for r in topo.ranks()}


def validate_vllm_tp(dims: ModelDims, tp: int) -> None:
    """Raise ValueError when vLLM cannot split the model over ``tp`` workers."""
    if tp < 1:
        raise ValueError(f"generator tensor parallel size must be >= 1, got {tp}")
    if dims.num_heads % tp:
        raise ValueError(f"generator tp={tp} does not divide num_attention_heads={dims.num_heads}")
    kvh = dims.num_kv_heads
    if (tp <= kvh and kvh % tp) or (tp > kvh and tp % kvh):
        raise ValueError(f"generator tp={tp} and num_key_value_heads={kvh}: one must divide the other")
    if dims.ffn_hidden_size % tp:
        raise ValueError(f"generator tp={tp} does not divide intermediate_size={dims.ffn_hidden_size}")


def vllm_vocab_rows(vocab_size: int, tp: int, tp_rank: int, padding: int = VLLM_VOCAB_PADDING) -> tuple[int, int, int]:
    """(rows per rank, first HF row of this rank, number of real HF rows on this rank)."""
    padded = ((vocab_size + padding - 1) // padding) * padding
    if padded % tp:
        raise ValueError(f"vLLM padded vocab {padded} (vocab {vocab_size}) is not divisible by generator tp={tp}")
    per_rank = padded // tp
    start = tp_rank * per_rank
    return per_rank, start, max(0, min(vocab_size, start + per_rank) - start)


def _vocab(name: str, dims: ModelDims, tp: int, tp_rank: int, padding: int) -> ParamLayout:
    per_rank, start, length = vllm_vocab_rows(dims.vocab_size, tp, tp_rank, padding)
    hf_shape = (dims.vocab_size, dims.hidden_size)
    return ParamLayout((per_rank, dims.hidden_size), (Piece(name, hf_shape, 0, start, 0, length),) if length else ())


def _qkv(prefix: str, suffix: str, dims: ModelDims, tp: int, tp_rank: int) -> ParamLayout:
    hd, kvh = dims.head_dim, dims.num_kv_heads
    tail = (dims.hidden_size,) if suffix == "weight" else ()
    q_rows = dims.num_heads * hd // tp
    if tp <= kvh:
        kv_heads_local, kv_first = kvh // tp, tp_rank * (kvh // tp)
    else:  # replicated: each worker holds one KV head
        kv_heads_local, kv_first = 1, tp_rank * kvh // tp
    kv_rows = kv_heads_local * hd
    q_shape, kv_shape = (dims.num_heads * hd, *tail), (kvh * hd, *tail)
    return ParamLayout((q_rows + 2 * kv_rows, *tail), (
        Piece(f"{prefix}.q_proj.{suffix}", q_shape, 0, tp_rank * q_rows, 0, q_rows),
        Piece(f"{prefix}.k_proj.{suffix}", kv_shape, 0, kv_first * hd, q_rows, kv_rows),
        Piece(f"{prefix}.v_proj.{suffix}", kv_shape, 0, kv_first * hd, q_rows + kv_rows, kv_rows),
    ))


def _split(name: str, shape: tuple[int, ...], dim: int, tp: int, tp_rank: int) -> ParamLayout:
    size = shape[dim] // tp
    return ParamLayout(tuple(size if d == dim else s for d, s in enumerate(shape)),
                       (Piece(name, shape, dim, tp_rank * size, 0, size),))


def _replicated(name: str, shape: tuple[int, ...]) -> ParamLayout:
    return ParamLayout(shape, (Piece(name, shape, 0, 0, 0, shape[0]),))


def vllm_param_layouts(dims: ModelDims, tp: int, tp_rank: int,
                       vocab_padding: int = VLLM_VOCAB_PADDING) -> dict[str, ParamLayout]:
    """Every parameter of one vLLM worker (Llama/Qwen2), keyed by vLLM's parameter name."""
    validate_vllm_tp(dims, tp)
    h, f = dims.hidden_size, dims.ffn_hidden_size
    out = {"model.embed_tokens.weight": _vocab("model.embed_tokens.weight", dims, tp, tp_rank, vocab_padding)}
    for i in range(dims.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = _replicated(f"{p}.input_layernorm.weight", (h,))
        out[f"{p}.self_attn.qkv_proj.weight"] = _qkv(f"{p}.self_attn", "weight", dims, tp, tp_rank)
        if dims.qkv_bias:
            out[f"{p}.self_attn.qkv_proj.bias"] = _qkv(f"{p}.self_attn", "bias", dims, tp, tp_rank)
        out[f"{p}.self_attn.o_proj.weight"] = _split(
            f"{p}.self_attn.o_proj.weight", (h, dims.num_heads * dims.head_dim), 1, tp, tp_rank)
        out[f"{p}.post_attention_layernorm.weight"] = _replicated(f"{p}.post_attention_layernorm.weight", (h,))
        shape = (f, h)
        size = f // tp
        out[f"{p}.mlp.gate_up_proj.weight"] = ParamLayout((2 * size, h), (
            Piece(f"{p}.mlp.gate_proj.weight", shape, 0, tp_rank * size, 0, size),
            Piece(f"{p}.mlp.up_proj.weight", shape, 0, tp_rank * size, size, size),
        ))
        out[f"{p}.mlp.down_proj.weight"] = _split(f"{p}.mlp.down_proj.weight", (h, f), 1, tp, tp_rank)
    out["model.norm.weight"] = _replicated("model.norm.weight", (h,))
    if not dims.tie_word_embeddings:
        out["lm_head.weight"] = _vocab("lm_head.weight", dims, tp, tp_rank, vocab_padding)
    return out


def destination_layouts(dims: ModelDims, topo: GeneratorTopology) -> dict[DstRank, dict[str, ParamLayout]]:
    """Every generator worker's layouts (replicas share the same dict object)."""
    per_tp = {t: vllm_param_layouts(dims, topo.tp, t, topo.vocab_padding) for t in range(topo.tp)}
    return {r: per_tp[r.tp] for r in topo.ranks()}


__all__ = ["SrcRank", "DstRank", "TrainerTopology", "GeneratorTopology", "source_rank_layouts", "source_layouts",
           "vllm_param_layouts", "destination_layouts", "validate_vllm_tp", "vllm_vocab_rows",
           "VLLM_VOCAB_PADDING", "TIED_COPY_PARAM"]
