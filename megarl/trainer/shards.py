"""The trainer's side of DDMA: what each local parameter holds, in HF terms, without copying.

For every parameter of this rank, :func:`local_shard_specs` lists :class:`ShardSpec` pieces:

    spec.local_view  ==  hf_tensor[spec.hf_name].narrow(spec.dim, spec.start, spec.length)

``local_view`` is a view of the parameter's own storage (no copy), so after an optimizer step it
shows the new weights. Fused Megatron tensors become several pieces: ``linear_qkv`` gives one
q/k/v row-block per query group, ``linear_fc1`` a gate and an up row-block; column-split tensors
(``linear_proj``, ``linear_fc2``) give one dim-1 piece; vocab-parallel tensors give their real-vocab
rows (padding rows map to nothing). Every ``local_view`` is contiguous in memory (row blocks of a
row-major tensor, or a whole local tensor for dim-1 pieces).

Replicas: norms appear on every TP rank and every tensor on every DP replica; with tied embeddings
and PP > 1 the last stage's output layer is a copy of ``model.embed_tokens.weight``
(``is_tied_copy=True``). The DDMA planner chooses which replica sends.
The layout logic itself lives in :mod:`megarl.models.layouts` (shared with conversion).

Build the specs after ``build_training`` (megatron DDP moves every parameter into its contiguous
buffer when it wraps the model, so views taken before would point at the old storage); after that
the views stay valid across optimizer steps (the optimizer writes the model params in place, also
when it keeps fp32 main copies of bf16 params).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from megarl.trainer.convert import model_layouts, model_local_params


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One contiguous piece of an HF tensor held by this rank (see module docstring)."""

    hf_name: str
    global_shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    local_view: torch.Tensor = dataclasses.field(compare=False, repr=False)
    mcore_name: str = ""
    is_tied_copy: bool = False

    def describe(self) -> dict:
        """Picklable layout (no tensor): for all_gather_object when building a DDMA plan."""
        return {"hf_name": self.hf_name, "global_shape": self.global_shape, "dim": self.dim,
                "start": self.start, "length": self.length, "mcore_name": self.mcore_name,
                "is_tied_copy": self.is_tied_copy, "dtype": str(self.local_view.dtype).removeprefix("torch.")}


def local_shard_specs(model) -> list[ShardSpec]:
    """Every HF piece this rank's model holds, with a zero-copy view of its local memory."""
    params = model_local_params(model)
    specs = []
    for mcore_name, layout in model_layouts(model).items():
        data = params[mcore_name].data
        for p in layout.pieces:
            specs.append(ShardSpec(
                hf_name=p.hf_name, global_shape=p.hf_shape, dim=p.dim, start=p.hf_start, length=p.length,
                local_view=data.narrow(p.dim, p.local_start, p.length), mcore_name=mcore_name,
                is_tied_copy=mcore_name == "output_layer.weight" and p.hf_name == "model.embed_tokens.weight"))
    return specs


def reassemble(specs: Iterable[ShardSpec]) -> dict[str, torch.Tensor]:
    """Full HF tensors from the specs of ranks covering the model (copies; for checks and tests).
    Raises when an element is missing."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.hf_name not in out:
            out[s.hf_name] = torch.zeros(s.global_shape, dtype=s.local_view.dtype)
            covered[s.hf_name] = torch.zeros(s.global_shape, dtype=torch.bool)
        out[s.hf_name].narrow(s.dim, s.start, s.length).copy_(s.local_view)
        covered[s.hf_name].narrow(s.dim, s.start, s.length).fill_(True)
    missing = [n for n, c in covered.items() if not bool(c.all())]
    if missing:
        raise ValueError(f"HF tensors not fully covered by the given shard specs: {missing}")
    return out
