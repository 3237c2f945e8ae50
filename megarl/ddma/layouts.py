"""DDMA layouts: which HF slices every trainer rank and every vLLM worker holds (dims only).

One vocabulary for both sides, :class:`megarl.models.layouts.Piece` / ``ParamLayout``:
a piece says ``local[param].narrow(dim, local_start, length) == hf[hf_name].narrow(dim, hf_start,
length)`` with every other dim whole. Nothing here touches weights or imports vLLM/Megatron, so
405B-sized layouts are computed instantly.

Source (trainer, Megatron): :func:`source_layouts` gives, for every rank ``SrcRank(tp, pp, dp)`` of a
TP x PP x DP trainer, the pieces of :func:`megarl.models.layouts.local_param_layouts` (DP replicas
hold identical pieces, but for an MoE model's experts at EP > 1: replica d holds EP rank d % ep's). With tied embeddings the last PP stage's ``output_layer.weight`` (a synced
copy of ``model.embed_tokens.weight``) is skipped: it would duplicate the embedding.

Destination (generator, vLLM): :func:`vllm_param_layouts` gives one worker's parameters, named as
vLLM names them, in vLLM's layout, from the family's layer table (``megarl.models.layouts.vllm_param_layouts``; the kinds' vLLM
arithmetic, KV-head replication and the 64-row vocab padding, is in ``megarl.models.kinds``).
"""

from __future__ import annotations

import dataclasses

from megarl.models.dims import ModelDims, validate_vllm_tp
from megarl.models.kinds import VLLM_VOCAB_PADDING, vllm_vocab_rows
from megarl.models.layouts import TIED_COPY_PARAM, ParamLayout, local_param_layouts, vllm_param_layouts


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
    ep: int = 1  # MoE: experts split over ep of the dp replicas; replica d holds EP rank d % ep (megatron)

    def ranks(self) -> list[SrcRank]:
        return [SrcRank(t, p, d) for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]


@dataclasses.dataclass(frozen=True)
class GeneratorTopology:
    tp: int
    replicas: int = 1
    vocab_padding: int = VLLM_VOCAB_PADDING

    def ranks(self) -> list[DstRank]:
        return [DstRank(r, t) for r in range(self.replicas) for t in range(self.tp)]


def source_rank_layouts(dims: ModelDims, topo: TrainerTopology, tp_rank: int, pp_rank: int,
                        ep_rank: int = 0) -> dict[str, ParamLayout]:
    """One trainer rank's params (any DP replica of EP rank ``ep_rank``), minus the tied output-layer copy."""
    out = local_param_layouts(dims, topo.tp, tp_rank, topo.pp, pp_rank, norm_style=topo.norm_style,
                              vocab_divisible_by=topo.vocab_divisible_by, ep=topo.ep, ep_rank=ep_rank)
    if dims.tie_word_embeddings:
        out.pop(TIED_COPY_PARAM, None)
    return out


def source_layouts(dims: ModelDims, topo: TrainerTopology) -> dict[SrcRank, dict[str, ParamLayout]]:
    """Every trainer rank's layouts (DP replicas of one EP rank share the same dict object). Under EP the
    replicas of different EP ranks hold different experts: the planner sends each expert from a rank
    that holds it, and balances the rest (attention, norms, embeddings) over all replicas as before."""
    per_stage = {(t, p, e): source_rank_layouts(dims, topo, t, p, e)
                 for p in range(topo.pp) for t in range(topo.tp) for e in range(topo.ep)}
    return {r: per_stage[(r.tp, r.pp, r.dp % topo.ep)] for r in topo.ranks()}


def destination_layouts(dims: ModelDims, topo: GeneratorTopology) -> dict[DstRank, dict[str, ParamLayout]]:
    """Every generator worker's layouts (replicas share the same dict object)."""
    per_tp = {t: vllm_param_layouts(dims, topo.tp, t, topo.vocab_padding) for t in range(topo.tp)}
    return {r: per_tp[r.tp] for r in topo.ranks()}


__all__ = ["SrcRank", "DstRank", "TrainerTopology", "GeneratorTopology", "source_rank_layouts", "source_layouts",
           "vllm_param_layouts", "destination_layouts", "validate_vllm_tp", "vllm_vocab_rows",
           "VLLM_VOCAB_PADDING", "TIED_COPY_PARAM"]
