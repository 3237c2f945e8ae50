"""Parameter kinds: each owns the TP arithmetic of one way a tensor is split, on both sides.

A :class:`Piece` says "rows/columns ``[local_start, local_start+length)`` of the local tensor along
``dim`` are rows/columns ``[hf_start, hf_start+length)`` of the HF tensor ``hf_name`` along the same
``dim`` (every other dim whole)"; a :class:`ParamLayout` is one local tensor's shape and pieces.
Megatron (``mcore_layout``) and vLLM (``vllm_layout``) lay out the same kinds differently:
- QKV: Megatron interleaves per query group ``[g0: q(heads of g0) k v | g1: ...]`` and a TP rank holds
  whole groups; vLLM holds ``[q_r; k_r; v_r]`` and, when TP > KV heads, replicates KV heads (rank
  ``t`` holds head ``t * kv_heads // TP``, vLLM's ``tp_rank // num_kv_head_replicas``).
- GATE_UP: ``[gate_r; up_r]`` on both sides (so concatenating TP shards is NOT the TP=1 tensor).
- ROW: split on dim 1 (``linear_proj`` / ``o_proj``, ``linear_fc2`` / ``down_proj``); COL: on dim 0.
- REPLICATED: whole on every rank (norms).
- VOCAB: vocab-parallel on dim 0 after padding the vocab (Megatron: a multiple of
  ``vocab_divisible_by * tp``; vLLM: of 64, then split evenly); padding rows map to no HF piece.
Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Protocol


class ModelDims(Protocol):
    """What the TP arithmetic reads of :class:`megarl.models.dims.ModelDims` (named here, not imported:
    dims reads the family specs, which read the kinds)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    moe_ffn_hidden_size: int
    num_experts: int

    @property
    def heads_per_group(self) -> int: ...

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


class Kind(enum.Enum):
    QKV = "qkv"
    GATE_UP = "gate_up"
    ROW = "row"
    COL = "col"
    REPLICATED = "replicated"
    VOCAB = "vocab"


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
    """A local parameter: its shape on this rank and the HF pieces it is made of."""

    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def hf_shape(symbols: tuple[str, ...], dims: "ModelDims") -> tuple[int, ...]:
    """A symbolic shape (``hidden``, ``q``, ``kv``, ``ffn``, ``head_dim``, ``vocab``; MoE: ``moe_ffn``
    = one expert's intermediate size, ``experts`` = the number of routed experts) in numbers."""
    size = {"hidden": dims.hidden_size, "q": dims.num_heads * dims.head_dim, "kv": dims.num_kv_heads * dims.head_dim,
            "ffn": dims.ffn_hidden_size, "head_dim": dims.head_dim, "vocab": dims.vocab_size,
            "moe_ffn": dims.moe_ffn_hidden_size, "experts": dims.num_experts}
    return tuple(size[s] for s in symbols)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def vllm_vocab_rows(vocab_size: int, tp: int, tp_rank: int, padding: int = VLLM_VOCAB_PADDING) -> tuple[int, int, int]:
    """(rows per rank, first HF row of this rank, number of real HF rows on this rank)."""
    padded = math.ceil(vocab_size / padding) * padding
    if padded % tp:
        raise ValueError(f"vLLM padded vocab {padded} (vocab {vocab_size}) is not divisible by generator tp={tp}")
    per_rank = padded // tp
    start = tp_rank * per_rank
    return per_rank, start, max(0, min(vocab_size, start + per_rank) - start)


def _vocab(name: str, dims: "ModelDims", per_rank: int, start: int) -> ParamLayout:
    length = max(0, min(dims.vocab_size, start + per_rank) - start)
    shape = (dims.vocab_size, dims.hidden_size)
    return ParamLayout((per_rank, dims.hidden_size), (Piece(name, shape, 0, start, 0, length),) if length else ())


def _split(name: str, shape: tuple[int, ...], dim: int, tp: int, tp_rank: int) -> ParamLayout:
    size = shape[dim] // tp
    return ParamLayout(tuple(size if d == dim else s for d, s in enumerate(shape)),
                       (Piece(name, shape, dim, tp_rank * size, 0, size),))


def _gate_up(names: tuple[str, ...], shape: tuple[int, ...], tp: int, tp_rank: int) -> ParamLayout:
    size = shape[0] // tp
    gate, up = names
    return ParamLayout((2 * size, *shape[1:]), (Piece(gate, shape, 0, tp_rank * size, 0, size),
                                                Piece(up, shape, 0, tp_rank * size, size, size)))


def _qkv_shapes(symbols: tuple[str, ...], dims: "ModelDims") -> tuple[tuple[int, ...], tuple[int, ...]]:
    q_shape = hf_shape(symbols, dims)
    return q_shape, hf_shape(("kv", *symbols[1:]), dims)


def mcore_layout(kind: Kind, names: tuple[str, ...], symbols: tuple[str, ...], dims: "ModelDims", tp: int,
                 tp_rank: int, vocab_divisible_by: int = 128) -> ParamLayout:
    """One Megatron rank's tensor of ``kind`` made of the HF tensors ``names``."""
    if kind is Kind.QKV:
        (q_shape, kv_shape), (q, k, v) = _qkv_shapes(symbols, dims), names
        hd, hpg = dims.head_dim, dims.heads_per_group
        groups = dims.num_kv_heads // tp
        block = (hpg + 2) * hd  # rows of one query group
        pieces = []
        for local_g in range(groups):
            g, row = tp_rank * groups + local_g, local_g * block
            pieces += [Piece(q, q_shape, 0, g * hpg * hd, row, hpg * hd),
                       Piece(k, kv_shape, 0, g * hd, row + hpg * hd, hd),
                       Piece(v, kv_shape, 0, g * hd, row + (hpg + 1) * hd, hd)]
        return ParamLayout((groups * block, *q_shape[1:]), tuple(pieces))
    if kind is Kind.VOCAB:
        per_rank = padded_vocab_size(dims.vocab_size, tp, vocab_divisible_by) // tp
        return _vocab(names[0], dims, per_rank, tp_rank * per_rank)
    return _common_layout(kind, names, hf_shape(symbols, dims), tp, tp_rank)


def vllm_layout(kind: Kind, names: tuple[str, ...], symbols: tuple[str, ...], dims: "ModelDims", tp: int,
                tp_rank: int, vocab_padding: int = VLLM_VOCAB_PADDING) -> ParamLayout:
    """One vLLM worker's tensor of ``kind`` made of the HF tensors ``names``."""
    if kind is Kind.QKV:
        (q_shape, kv_shape), (q, k, v) = _qkv_shapes(symbols, dims), names
        hd, kvh = dims.head_dim, dims.num_kv_heads
        q_rows = q_shape[0] // tp
        if tp <= kvh:
            kv_local, kv_first = kvh // tp, tp_rank * (kvh // tp)
        else:  # replicated: each worker holds one KV head
            kv_local, kv_first = 1, tp_rank * kvh // tp
        kv_rows = kv_local * hd
        return ParamLayout((q_rows + 2 * kv_rows, *q_shape[1:]), (
            Piece(q, q_shape, 0, tp_rank * q_rows, 0, q_rows),
            Piece(k, kv_shape, 0, kv_first * hd, q_rows, kv_rows),
            Piece(v, kv_shape, 0, kv_first * hd, q_rows + kv_rows, kv_rows)))
    if kind is Kind.VOCAB:
        per_rank, start, _ = vllm_vocab_rows(dims.vocab_size, tp, tp_rank, vocab_padding)
        return _vocab(names[0], dims, per_rank, start)
    return _common_layout(kind, names, hf_shape(symbols, dims), tp, tp_rank)


def _common_layout(kind: Kind, names: tuple[str, ...], shape: tuple[int, ...], tp: int, tp_rank: int) -> ParamLayout:
    """The kinds both sides lay out alike."""
    if kind is Kind.GATE_UP:
        return _gate_up(names, shape, tp, tp_rank)
    if kind is Kind.ROW:
        return _split(names[0], shape, 1, tp, tp_rank)
    if kind is Kind.COL:
        return _split(names[0], shape, 0, tp, tp_rank)
    if kind is Kind.REPLICATED:
        return ParamLayout(shape, (Piece(names[0], shape, 0, 0, 0, shape[0]),))
    raise ValueError(f"no layout for parameter kind {kind}")


__all__ = ["Kind", "Piece", "ParamLayout", "hf_shape", "mcore_layout", "vllm_layout", "padded_vocab_size",
           "vllm_vocab_rows", "VLLM_VOCAB_PADDING"]
