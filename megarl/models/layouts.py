"""HF <-> Megatron tensor layouts, per TP/PP rank (pure torch; no Megatron import).

One concept lives here: for every parameter a Megatron rank holds, which pieces of which HF
tensors it contains. A :class:`Piece` says "rows/columns ``[local_start, local_start+length)``
of the local tensor along ``dim`` are rows/columns ``[hf_start, hf_start+length)`` of the HF
tensor ``hf_name`` along the same ``dim`` (every other dim whole)". Conversion (both ways), the
DDMA source layout (``shards.py``) and the tests all walk the same pieces, so a layout bug cannot
hide in one direction only.

Megatron specifics encoded below:
- ``linear_qkv`` rows are interleaved per query group: ``[g0: q(heads of g0) k v | g1: ...]``,
  each block ``head_dim`` rows; a TP rank holds a contiguous run of whole groups.
- ``linear_fc1`` is ``[gate_r; up_r]`` per TP rank (concatenating TP shards is NOT the TP=1 tensor).
- ``linear_proj`` / ``linear_fc2`` are split on dim 1.
- word embeddings and the output layer are vocab-parallel on dim 0, the vocab padded to a
  multiple of ``vocab_divisible_by * tp``; padding rows map to no HF piece (they stay zero).
- norms are replicated over TP; PP assigns whole layers (``num_layers / pp`` consecutive layers).
- tied embeddings: the output layer on the last stage of a PP>1 model is a copy of
  ``model.embed_tokens.weight`` (Megatron keeps the copies in sync); at PP=1 it does not exist.
- norm names: local spec (``input_layernorm``, ``pre_mlp_layernorm``) or Transformer-Engine spec
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``: norms fused into linears).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from megarl.models.families import VERIFIED_FAMILIES, architecture_problem

SUPPORTED_FAMILIES = tuple(VERIFIED_FAMILIES)
NORM_STYLES = ("local", "te")


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The architecture facts of an HF Llama/Qwen2 config that the Megatron model and layouts need."""

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

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> "ModelDims":
        """Read an HF ``config.json`` dict; raise ValueError naming the key for anything unsupported."""
        problem = architecture_problem(cfg)
        if problem:
            raise ValueError(f"HF config: {problem}")
        family = cfg["model_type"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            family=family,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def validate_parallel(dims: ModelDims, tp: int, pp: int) -> None:
    """Raise ValueError naming the HF config key and the TP/PP value when the split is impossible."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor/pipeline parallel sizes must be >= 1, got tp={tp} pp={pp}")
    if dims.num_heads % dims.num_kv_heads:
        raise ValueError(f"num_attention_heads={dims.num_heads} is not a multiple of "
                         f"num_key_value_heads={dims.num_kv_heads}")
    if dims.num_heads % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide the HF config num_attention_heads="
                         f"{dims.num_heads}; choose a tp that divides it")
    if dims.num_kv_heads % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide the HF config num_key_value_heads="
                         f"{dims.num_kv_heads} (Megatron splits query groups evenly); choose a tp that divides it")
    if dims.ffn_hidden_size % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide the HF config intermediate_size="
                         f"{dims.ffn_hidden_size}")
    if dims.num_layers % pp:
        raise ValueError(f"pipeline parallel size pp={pp} does not divide the HF config num_hidden_layers="
                         f"{dims.num_layers}; choose a pp that divides it")


def pp_layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layer indices held by a pipeline stage (Megatron's even split)."""
    per_stage = num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


@dataclasses.dataclass(frozen=True)
class Piece:
    """``local.narrow(dim, local_start, length)`` == ``hf[hf_name].narrow(dim, hf_start, length)``."""

    hf_name: str
    hf_shape: tuple[int, ...]
    dim: int
    hf_start: int
    local_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """A Megatron local parameter: its shape on this rank and the HF pieces it is made of."""

    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _tp_split(name: str, shape: tuple[int, ...], dim: int, tp: int, tp_rank: int) -> ParamLayout:
    """An HF tensor split evenly along ``dim`` over TP (column- or row-parallel linear)."""
    size = shape[dim] // tp
    local_shape = tuple(size if d == dim else s for d, s in enumerate(shape))
    return ParamLayout(local_shape, (Piece(name, shape, dim, tp_rank * size, 0, size),))


def _replicated(name: str, shape: tuple[int, ...]) -> ParamLayout:
    return ParamLayout(shape, (Piece(name, shape, 0, 0, 0, shape[0]),))


def _vocab_parallel(name: str, dims: ModelDims, tp: int, tp_rank: int, divisible_by: int) -> ParamLayout:
    per_rank = padded_vocab_size(dims.vocab_size, tp, divisible_by) // tp
    start = tp_rank * per_rank
    length = max(0, min(dims.vocab_size, start + per_rank) - start)
    hf_shape = (dims.vocab_size, dims.hidden_size)
    pieces = (Piece(name, hf_shape, 0, start, 0, length),) if length else ()
    return ParamLayout((per_rank, dims.hidden_size), pieces)


def _qkv(prefix: str, suffix: str, dims: ModelDims, tp: int, tp_rank: int) -> ParamLayout:
    """``linear_qkv`` (weight or bias): whole query groups per rank, each ``[q heads; k; v]``."""
    hd, hpg = dims.head_dim, dims.heads_per_group
    groups_per_rank = dims.num_kv_heads // tp
    block = (hpg + 2) * hd  # rows of one query group
    tail = (dims.hidden_size,) if suffix == "weight" else ()
    q_shape = (dims.num_heads * hd, *tail)
    kv_shape = (dims.num_kv_heads * hd, *tail)
    pieces = []
    for local_g in range(groups_per_rank):
        g = tp_rank * groups_per_rank + local_g
        row = local_g * block
        pieces.append(Piece(f"{prefix}.q_proj.{suffix}", q_shape, 0, g * hpg * hd, row, hpg * hd))
        pieces.append(Piece(f"{prefix}.k_proj.{suffix}", kv_shape, 0, g * hd, row + hpg * hd, hd))
        pieces.append(Piece(f"{prefix}.v_proj.{suffix}", kv_shape, 0, g * hd, row + (hpg + 1) * hd, hd))
    return ParamLayout((groups_per_rank * block, *tail), tuple(pieces))


def _fc1(prefix: str, dims: ModelDims, tp: int, tp_rank: int) -> ParamLayout:
    """``linear_fc1``: ``[gate_r; up_r]`` where ``_r`` is this rank's slice of intermediate rows."""
    size = dims.ffn_hidden_size // tp
    shape = (dims.ffn_hidden_size, dims.hidden_size)
    return ParamLayout((2 * size, dims.hidden_size), (
        Piece(f"{prefix}.gate_proj.weight", shape, 0, tp_rank * size, 0, size),
        Piece(f"{prefix}.up_proj.weight", shape, 0, tp_rank * size, size, size),
    ))


def local_param_layouts(dims: ModelDims, tp: int, tp_rank: int, pp: int, pp_rank: int,
                        norm_style: str = "local", vocab_divisible_by: int = 128) -> dict[str, ParamLayout]:
    """Every parameter of one (tp_rank, pp_rank) Megatron GPTModel, keyed by its local state-dict name
    (layers numbered locally from 0 on every stage, as in ``GPTModel.state_dict()``)."""
    validate_parallel(dims, tp, pp)
    if norm_style not in NORM_STYLES:
        raise ValueError(f"norm_style={norm_style!r}; expected one of {NORM_STYLES}")
    h = dims.hidden_size
    out: dict[str, ParamLayout] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_parallel(
            "model.embed_tokens.weight", dims, tp, tp_rank, vocab_divisible_by)
    for local_i, i in enumerate(pp_layer_range(dims.num_layers, pp, pp_rank)):
        hf, mc = f"model.layers.{i}", f"decoder.layers.{local_i}"
        attn_norm = (f"{mc}.input_layernorm.weight" if norm_style == "local"
                     else f"{mc}.self_attention.linear_qkv.layer_norm_weight")
        mlp_norm = (f"{mc}.pre_mlp_layernorm.weight" if norm_style == "local"
                    else f"{mc}.mlp.linear_fc1.layer_norm_weight")
        out[attn_norm] = _replicated(f"{hf}.input_layernorm.weight", (h,))
        out[f"{mc}.self_attention.linear_qkv.weight"] = _qkv(f"{hf}.self_attn", "weight", dims, tp, tp_rank)
        if dims.qkv_bias:
            out[f"{mc}.self_attention.linear_qkv.bias"] = _qkv(f"{hf}.self_attn", "bias", dims, tp, tp_rank)
        out[f"{mc}.self_attention.linear_proj.weight"] = _tp_split(
            f"{hf}.self_attn.o_proj.weight", (h, dims.num_heads * dims.head_dim), 1, tp, tp_rank)
        out[mlp_norm] = _replicated(f"{hf}.post_attention_layernorm.weight", (h,))
        out[f"{mc}.mlp.linear_fc1.weight"] = _fc1(f"{hf}.mlp", dims, tp, tp_rank)
        out[f"{mc}.mlp.linear_fc2.weight"] = _tp_split(
            f"{hf}.mlp.down_proj.weight", (h, dims.ffn_hidden_size), 1, tp, tp_rank)
    if last:
        out["decoder.final_layernorm.weight"] = _replicated("model.norm.weight", (h,))
        if not dims.tie_word_embeddings:
            out["output_layer.weight"] = _vocab_parallel("lm_head.weight", dims, tp, tp_rank, vocab_divisible_by)
        elif not first:  # PP>1 tied: the last stage keeps a synced copy of the embedding
            out["output_layer.weight"] = _vocab_parallel(
                "model.embed_tokens.weight", dims, tp, tp_rank, vocab_divisible_by)
    return out


def hf_tensor_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model (the names ``save_pretrained`` writes) with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layout in local_param_layouts(dims, 1, 0, 1, 0).values():
        for p in layout.pieces:
            shapes[p.hf_name] = p.hf_shape
    return shapes


def hf_to_local(get_hf: Callable[[str], torch.Tensor], layouts: Mapping[str, ParamLayout],
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Build one rank's local tensors from HF tensors (``get_hf(name)`` returns the full HF tensor).
    Vocab padding rows are zero."""
    out = {}
    for name, layout in layouts.items():
        local = None
        for p in layout.pieces:
            src = get_hf(p.hf_name)
            if tuple(src.shape) != p.hf_shape:
                raise ValueError(f"HF tensor {p.hf_name} has shape {tuple(src.shape)}, the config implies {p.hf_shape}")
            if local is None:
                local = torch.zeros(layout.local_shape, dtype=dtype or src.dtype)
            local.narrow(p.dim, p.local_start, p.length).copy_(src.narrow(p.dim, p.hf_start, p.length))
        out[name] = local if local is not None else torch.zeros(layout.local_shape, dtype=dtype or torch.float32)
    return out


def local_to_hf(rank_tensors: list[tuple[Mapping[str, ParamLayout], Mapping[str, torch.Tensor]]],
                dims: ModelDims) -> dict[str, torch.Tensor]:
    """Reassemble full HF tensors from any set of ranks' (layouts, local tensors) covering the model.
    Raises if an HF element is not covered or replicas disagree."""
    shapes = hf_tensor_shapes(dims)
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for layouts, tensors in rank_tensors:
        for name, layout in layouts.items():
            local = tensors[name]
            if tuple(local.shape) != layout.local_shape:
                raise ValueError(f"{name}: local shape {tuple(local.shape)} != expected {layout.local_shape}")
            for p in layout.pieces:
                if p.hf_name not in out:
                    out[p.hf_name] = torch.empty(p.hf_shape, dtype=local.dtype)
                    covered[p.hf_name] = torch.zeros(p.hf_shape, dtype=torch.bool)
                dst = out[p.hf_name].narrow(p.dim, p.hf_start, p.length)
                src = local.narrow(p.dim, p.local_start, p.length)
                seen = covered[p.hf_name].narrow(p.dim, p.hf_start, p.length)
                if seen.any() and not torch.equal(dst[seen], src[seen]):
                    raise ValueError(f"replicas of {p.hf_name} disagree (from {name})")
                dst.copy_(src)
                seen.fill_(True)
    for name, shape in shapes.items():
        if name not in covered or not bool(covered[name].all()):
            raise ValueError(f"HF tensor {name} is not fully covered by the given ranks")
    return out
