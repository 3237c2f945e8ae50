"""LoRA adapters on megatron-core's tensor-parallel linears (``trainer.lora_rank`` > 0).

A targeted linear ``y = x W^T`` becomes ``y = x W^T + scale * (x A^T) B^T`` with ``scale = lora_alpha /
lora_rank``, ``A [r, in]`` (peft's kaiming-uniform init) and ``B [out, r]`` zero at the start, so the first
forward equals the base model bit for bit. ``W`` and every other base weight are frozen
(``requires_grad=False``): megatron's DDP gives frozen parameters no grad buffer and
``get_megatron_optimizer`` no optimizer state, so the optimizer holds the adapters only.

Sharding follows the weight, so a step needs no gather of W, A or B:

- ``ColumnParallelLinear`` (linear_qkv, linear_fc1: W [out/tp, in]): A [r, in] replicated on the TP
  ranks, B [out/tp, r] sharded like W (same rows, fc1's [gate_r; up_r] included). The replicated
  ``h = x A^T`` passes ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of the
  [tokens, r] gradient backward): every rank's ``dh = sum_t dY_t B_t`` and so its dA are whole.
- ``RowParallelLinear`` (linear_proj, linear_fc2: W [out, in/tp], input sharded): A [r, in/tp] sharded
  like W, B [out, r] replicated. The partial ``x_t A_t^T`` of each rank sum to ``x A^T``; the sum is
  taken on h (``reduce_from_tensor_model_parallel_region``: an all-reduce of [tokens, r]), not left to
  the layer's own all-reduce of the output: summed there, each rank's dB = dY^T (x_t A_t^T) would be a
  partial sum and the replicated B would drift apart across TP ranks.

Initial values come from a generator seeded by (trainer.seed, parameter name) over the whole tensor and
are then sliced to the rank's shard, so TP=1 and TP=2 start from the same adapters. The merged weight
``W + scale * B A`` of each rank's shard is that shard of the merged full weight (column: rows of B;
row: columns of A), which is what the DDMA sync sends (:func:`merge_into`).
"""

from __future__ import annotations

import math
import types
import zlib

import torch

# the projection names of the local (CPU) and TE specs: attention qkv / out, MLP fc1 (gate+up) / fc2
from megarl.trainer.config import LORA_TARGETS



def scale_of(rank: int, alpha: float) -> float:
    """peft's LoRA scaling (``lora_alpha / r``; rslora off)."""
    return float(alpha) / int(rank)


def _is_column(module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return True
    if isinstance(module, RowParallelLinear):
        return False
    raise TypeError(f"LoRA wraps megatron's ColumnParallelLinear / RowParallelLinear, not {type(module).__name__}")


def _shard(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int) -> torch.Tensor:
    """This TP rank's piece of ``full`` along ``dim``, as megatron splits a weight with ``partition_stride``
    (fc1 of a GLU: the gate and up halves are split separately, the rank holds [gate_r; up_r])."""
    blocks = full.chunk(stride, dim)
    return torch.cat([b.chunk(tp, dim)[rank] for b in blocks], dim).contiguous()


def _seeded(name: str, seed: int, shape: tuple[int, int], fan_in: int) -> torch.Tensor:
    """peft's A init, kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from a generator
    seeded by (seed, name): the same full tensor on every rank and at every TP size."""
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound)


def _lora_forward_column(self, input_, weight=None, runtime_gather_output=None):
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    out, bias = self._megarl_base_forward(input_, weight, runtime_gather_output)
    h = torch.nn.functional.linear(input_, self.lora_A)
    h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
    return out + torch.nn.functional.linear(h, self.lora_B) * self.megarl_lora_scale, bias


def _lora_forward_row(self, input_):
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    out, bias = self._megarl_base_forward(input_)
    h = reduce_from_tensor_model_parallel_region(torch.nn.functional.linear(input_, self.lora_A), group=self.tp_group)
    return out + torch.nn.functional.linear(h, self.lora_B) * self.megarl_lora_scale, bias


def _lora_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """The layer's checkpoint entries with the adapters sharded like the weight (B on dim 0 of a
    column-parallel layer, A on dim 1 of a row-parallel one; the other replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if self.megarl_lora_column else {"weight": 1, "lora_A": 1}
    out = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                              sharded_offsets, tp_group=self.tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    if self.megarl_lora_stride == 2:  # fc1 of a GLU: B's rows are [gate_r; up_r], split as MLP splits the weight
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora_B"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                (metadata or {}).get("singleton_local_shards", False))
    return out


def lora_modules(model) -> dict[str, torch.nn.Module]:
    """name -> linear carrying adapters."""
    from megarl.trainer.model import unwrap

    return {n: m for n, m in unwrap(model).named_modules() if hasattr(m, "lora_A")}


def targets_of(model, targets) -> dict[str, torch.nn.Module]:
    """name -> the model's linears whose last name part is one of ``targets``."""
    from megarl.trainer.model import unwrap

    out = {n: m for n, m in unwrap(model).named_modules() if n.rsplit(".", 1)[-1] in tuple(targets)}
    if not out:
        raise ValueError(f"trainer.lora_targets={list(targets)}: no such linear in the model (use some of "
                         f"{', '.join(LORA_TARGETS)})")
    return out


def apply_lora(model, rank: int, alpha: float, targets=LORA_TARGETS, seed: int = 0) -> int:
    """Add adapters to every targeted linear of this rank's model and freeze every other parameter;
    call it before ``build_training`` (DDP buckets only the trainable adapters). Returns the number of
    adapted linears. ``seed``: the A init (trainer.seed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from megarl.trainer.model import unwrap

    m = unwrap(model)
    if rank < 1:
        raise ValueError(f"trainer.lora_rank={rank}: apply_lora needs rank >= 1")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    glu = bool(m.config.gated_linear_unit)
    for p in m.parameters():
        p.requires_grad_(False)
    found = targets_of(m, targets)
    for name, mod in found.items():
        column = _is_column(mod)
        w = mod.weight
        if column:
            stride = 2 if glu and name.endswith("linear_fc1") else 1
            out_full, in_full = w.shape[0] * tp, w.shape[1]
            a = _seeded(f"{name}.lora_A", seed, (rank, in_full), in_full)
            b_local = torch.zeros(w.shape[0], rank, dtype=torch.float64)
            a_sharded = False
        else:
            stride = 1
            out_full, in_full = w.shape[0], w.shape[1] * tp
            a = _shard(_seeded(f"{name}.lora_A", seed, (rank, in_full), in_full), 1, tp, tp_rank, 1)
            b_local = torch.zeros(out_full, rank, dtype=torch.float64)
            a_sharded = True
        mod.lora_A = torch.nn.Parameter(a.to(w.dtype).to(w.device))
        mod.lora_B = torch.nn.Parameter(b_local.to(w.dtype).to(w.device))
        # megatron's grad norm counts a TP-sharded param on every rank, a replicated one on tp rank 0 only
        if a_sharded:
            set_tensor_model_parallel_attributes(mod.lora_A, True, 1, 1)
        else:
            set_tensor_model_parallel_attributes(mod.lora_B, True, 0, stride)
        mod.megarl_lora_column = column
        mod.megarl_lora_stride = stride
        mod.megarl_lora_scale = scale_of(rank, alpha)
        mod._megarl_base_forward = mod.forward
        mod.forward = types.MethodType(_lora_forward_column if column else _lora_forward_row, mod)
        mod.sharded_state_dict = types.MethodType(_lora_sharded_state_dict, mod)
    m.megarl_lora = {"rank": int(rank), "alpha": float(alpha), "targets": sorted(set(targets))}
    return len(found)


def set_full_adapter(mod, key: str, full: torch.Tensor) -> None:
    """Load the full (TP=1) adapter tensor ``key`` ("lora_A" | "lora_B") into this rank's shard of it."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    sharded_dim = {("lora_B", True): 0, ("lora_A", False): 1}.get((key, mod.megarl_lora_column))
    piece = full if sharded_dim is None else _shard(full, sharded_dim, tp, tp_rank,
                                                    mod.megarl_lora_stride if sharded_dim == 0 else 1)
    with torch.no_grad():
        getattr(mod, key).copy_(piece)


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's."""
    return name.endswith(".lora_A") or name.endswith(".lora_B")


@torch.no_grad()
def merged_delta(mod) -> torch.Tensor:
    """``scale * B @ A`` of this rank's shard: the shard of the full merged delta (no gather)."""
    return (mod.lora_B.float() @ mod.lora_A.float()).mul_(mod.megarl_lora_scale)


@torch.no_grad()
def merge_into(model, out: dict[str, torch.Tensor]) -> list[str]:
    """Write ``W + scale * B @ A`` of every adapted linear into ``out[<linear>.weight]`` (this rank's
    shard, in the weight's dtype); returns the names written."""
    done = []
    for name, mod in lora_modules(model).items():
        key = f"{name}.weight"
        out[key].copy_((mod.weight.float() + merged_delta(mod)).to(out[key].dtype))
        done.append(key)
    return done


def param_counts(model) -> dict[str, int]:
    """``model/params`` (every element of the full model, TP shards summed, replicated counted once)
    and ``train/trainable_params`` (the same for parameters with requires_grad), over this rank's
    pipeline stage summed across the TP group (a collective on the TP group, then the PP group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    m = unwrap(model)
    tp_rank = ps.get_tensor_model_parallel_rank()
    total = trainable = 0
    for p in m.parameters():
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    t = torch.tensor([total, trainable], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            # a tied output layer on the last stage is a copy of the embedding: counted once
            if not ps.is_pipeline_first_stage() and getattr(m, "share_embeddings_and_output_weights", False) \
                    and getattr(m, "output_layer", None) is not None and m.output_layer.weight is not None:
                t[0] -= m.output_layer.weight.numel() * ps.get_tensor_model_parallel_world_size()
            dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    return {"model/params": int(t[0]), "train/trainable_params": int(t[1])}


__all__ = ["LORA_TARGETS", "apply_lora", "lora_modules", "merge_into", "merged_delta", "param_counts",
           "scale_of", "set_full_adapter", "is_adapter"]
