"""HF <-> Megatron <-> vLLM tensor layouts, per rank, read from the family's layer table.

One concept lives here: for every parameter a Megatron rank or a vLLM worker holds, which pieces of
which HF tensors it contains (:class:`~megarl.models.kinds.Piece`). Both sides walk the same
:class:`~megarl.models.families.spec.LayerParam` rows of the family's spec, each row's kind owning
the TP arithmetic (``megarl.models.kinds``). Conversion (both ways), the DDMA source and destination
layouts and the tests all use these, so a layout bug cannot hide in one direction only.

Model-level facts encoded below:
- PP assigns whole layers (``num_layers / pp`` consecutive layers); layers are numbered locally
  from 0 on every stage, as in ``GPTModel.state_dict()``.
- tied embeddings: the output layer on the last stage of a PP>1 model is a copy of
  ``model.embed_tokens.weight`` (Megatron keeps the copies in sync); at PP=1 it does not exist; vLLM
  has no ``lm_head.weight`` parameter.
- norm names: local spec (``input_layernorm``, ``pre_mlp_layernorm``) or Transformer-Engine spec
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``: norms fused into linears).
Import is torch-free; only :func:`hf_to_local` / :func:`local_to_hf` use torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from megarl.models.dims import ModelDims, parallel_problems, pp_layer_range, validate_parallel
from megarl.models.families import VERIFIED_FAMILIES, family_spec
from megarl.models.families.spec import LayerParam
from megarl.models.kinds import (VLLM_VOCAB_PADDING, Kind, ParamLayout, Piece, mcore_layout, padded_vocab_size,
                                 vllm_layout)

if TYPE_CHECKING:
    import torch

SUPPORTED_FAMILIES = tuple(VERIFIED_FAMILIES)
NORM_STYLES = ("local", "te")
TIED_COPY_PARAM = "output_layer.weight"


def _layer_names(names: tuple[str, ...], layer: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{layer}.{n}" for n in names)


def _expert_rows(p: LayerParam, layer: int, experts: range) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """(Megatron name, HF names, -) of a row for each expert of ``experts`` (global indices, held by one
    EP rank as local experts 0..): a dense row once."""
    if not p.per_expert:
        yield p.mcore, _layer_names(p.hf, layer), 0
        return
    for local_e, e in enumerate(experts):
        yield p.mcore.format(e=local_e), _layer_names(tuple(n.format(e=e) for n in p.hf), layer), local_e


def local_param_layouts(dims: ModelDims, tp: int, tp_rank: int, pp: int, pp_rank: int,
                        norm_style: str = "local", vocab_divisible_by: int = 128, ep: int = 1,
                        ep_rank: int = 0) -> dict[str, ParamLayout]:
    """Every parameter of one (tp_rank, pp_rank, ep_rank) Megatron GPTModel, keyed by its local state-dict
    name (layers numbered locally from 0 on every stage, as in ``GPTModel.state_dict()``). An MoE
    model's experts split evenly over ``ep`` ranks (rank ``r`` holds experts ``r * E/ep ..``, Megatron's
    ``local_expert_indices``); everything else is the same on every EP rank."""
    validate_parallel(dims, tp, pp)
    if ep < 1 or (dims.num_experts or ep) % ep or not 0 <= ep_rank < ep:
        raise ValueError(f"ep={ep} ep_rank={ep_rank}: the expert parallel size must divide num_experts="
                         f"{dims.num_experts}")
    per_ep = dims.num_experts // ep
    experts = range(ep_rank * per_ep, (ep_rank + 1) * per_ep)
    if norm_style not in NORM_STYLES:
        raise ValueError(f"norm_style={norm_style!r}; expected one of {NORM_STYLES}")
    spec = family_spec(dims.family)
    h = dims.hidden_size
    out: dict[str, ParamLayout] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1

    def vocab(hf_name: str) -> ParamLayout:
        return mcore_layout(Kind.VOCAB, (hf_name,), ("vocab", "hidden"), dims, tp, tp_rank, vocab_divisible_by)

    if first:
        out["embedding.word_embeddings.weight"] = vocab(spec.embedding)
    for local_i, i in enumerate(pp_layer_range(dims.num_layers, pp, pp_rank)):
        for p in spec.layer_rows(i, dims.moe_layers):
            for mcore, hf, _ in _expert_rows(p, i, experts):
                name = p.mcore_te if norm_style == "te" and p.mcore_te else mcore
                out[f"decoder.layers.{local_i}.{name}"] = mcore_layout(p.kind, hf, p.shape, dims, tp, tp_rank,
                                                                     vocab_divisible_by)
    if last:
        out["decoder.final_layernorm.weight"] = ParamLayout((h,), (Piece(spec.final_norm, (h,), 0, 0, 0, h),))
        if not dims.tie_word_embeddings:
            out[TIED_COPY_PARAM] = vocab(spec.lm_head)
        elif not first:  # PP>1 tied: the last stage keeps a synced copy of the embedding
            out[TIED_COPY_PARAM] = vocab(spec.embedding)
    return out


def vllm_param_layouts(dims: ModelDims, tp: int, tp_rank: int,
                       vocab_padding: int = VLLM_VOCAB_PADDING) -> dict[str, ParamLayout]:
    """Every parameter of one vLLM worker, keyed by vLLM's parameter name (tied: no ``lm_head``)."""
    from megarl.models.dims import validate_vllm_tp

    validate_vllm_tp(dims, tp)
    spec = family_spec(dims.family)
    h = dims.hidden_size

    def vocab(hf_name: str) -> ParamLayout:
        return vllm_layout(Kind.VOCAB, (hf_name,), ("vocab", "hidden"), dims, tp, tp_rank, vocab_padding)

    out = {spec.embedding: vocab(spec.embedding)}
    for i in range(dims.num_layers):
        for p in spec.layer_rows(i, dims.moe_layers):
            # vLLM keeps every expert on every worker (no vLLM expert parallelism), each split over TP
            for mcore, hf, e in _expert_rows(p, i, range(dims.num_experts)):
                out[f"model.layers.{i}.{p.vllm.format(e=e)}"] = vllm_layout(p.kind, hf, p.shape, dims, tp, tp_rank,
                                                                           vocab_padding)
    out[spec.final_norm] = ParamLayout((h,), (Piece(spec.final_norm, (h,), 0, 0, 0, h),))
    if not dims.tie_word_embeddings:
        out[spec.lm_head] = vocab(spec.lm_head)
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
    import torch

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
    import torch

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


__all__ = ["ModelDims", "ParamLayout", "Piece", "Kind", "SUPPORTED_FAMILIES", "NORM_STYLES", "TIED_COPY_PARAM",
           "local_param_layouts", "vllm_param_layouts", "hf_tensor_shapes", "hf_to_local", "local_to_hf",
           "padded_vocab_size", "parallel_problems", "pp_layer_range", "validate_parallel"]
