"""The trainer's side of a DDMA sync: this rank's place in the plan and its live parameters.

:func:`trainer_topology` describes a built Megatron model's TP x PP x DP layout the way the planner
does (norm style and vocab padding from the model), :func:`this_rank` names this process's
``SrcRank``, and :func:`make_sender` wraps the model's parameters (live storage: after an optimizer
step the sender sends the new weights, no copy in between) in a :class:`megarl.ddma.sync.DdmaSender`.
"""

from __future__ import annotations

import dataclasses

from megarl.ddma.layouts import SrcRank, TrainerTopology
from megarl.ddma.sync import DdmaSender, SyncSpec


def trainer_topology(model) -> TrainerTopology:
    """The planner's description of this (built) model's parallel layout."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    m = unwrap(model)
    return TrainerTopology(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                           ps.get_data_parallel_world_size(), norm_style=m.megarl_norm_style,
                           vocab_divisible_by=m.megarl_vocab_divisible_by,
                           ep=ps.get_expert_model_parallel_world_size() if m.megarl_dims.is_moe else 1)


def this_rank() -> SrcRank:
    from megatron.core import parallel_state as ps

    return SrcRank(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                   ps.get_data_parallel_rank())


def make_sender(model, spec: SyncSpec) -> DdmaSender:
    """This rank's sender; ``spec.src`` must describe ``model`` (raises ValueError naming both)."""
    from megarl.trainer.convert import model_local_params

    topo = trainer_topology(model)
    if dataclasses.astuple(topo) != dataclasses.astuple(spec.src):
        raise ValueError(f"ddma: the sync spec's trainer topology {spec.src} does not describe this model ({topo})")
    params = {n: p.data for n, p in model_local_params(model).items()}
    from megarl.trainer.lora import lora_modules

    if not lora_modules(model):
        return DdmaSender(spec, this_rank(), params)
    return LoraMergedSender(model, spec, params)


def frozen_skip(plan, targets) -> frozenset:
    """The HF tensors a LoRA sync leaves out after its first: every tensor of every Megatron module that is
    not a LoRA target (embeddings, norms, untargeted projections, with their biases), from the whole plan
    (all trainer ranks), so every rank and every generator worker agree on it. A target's own frozen
    tensors (Qwen2's qkv bias, TE's fused layer_norm_weight) stay in: vLLM reloads a layer whole."""
    module = lambda src_param: src_param.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # noqa: E731
    frozen, adapted = set(), set()
    for copies in plan.pairs.values():
        for c in copies:
            (adapted if module(c.src_param) in targets else frozen).add(c.hf_name)
    return frozenset(frozen - adapted)


class LoraMergedSender(DdmaSender):
    """The sender of a LoRA model (trainer.lora_rank > 0): each adapted linear's tensor sent is a buffer of
    this rank's shard of ``W + lora_alpha/r * B A``, merged again before every sync (no gather: a shard's
    merge needs only its own W, A and B shards, megarl/trainer/lora.py); the other tensors are the
    frozen parameters' live storage. Memory: one copy of the adapted weights' shards.

    Only what changed: the first sync sends every tensor (the engine may hold other weights); every later
    one is a partial sync (``SyncSpec.skip`` = :func:`frozen_skip`) of the merged targets alone. The frozen
    tensors cannot have changed (requires_grad False, checked here; no optimizer holds them), and the
    engine keeps what it holds for a layer no tensor of which arrives (vLLM's layerwise reload puts its
    kernel tensors back). The senders' tables name the skip, so the workers' receivers follow
    (megarl/ddma/receiver.py ``DdmaReceiver._for``). ``bytes_sent`` is what this sync moved."""

    def __init__(self, model, spec: SyncSpec, params: dict):
        from megarl.trainer.lora import lora_modules
        from megarl.trainer.model import unwrap

        self._model = model
        self._merged = {f"{n}.weight": params[f"{n}.weight"].clone() for n in lora_modules(model)}
        super().__init__(spec, this_rank(), {**params, **self._merged})
        self._all = {**params, **self._merged}
        self._skip = frozen_skip(self.plan, tuple(unwrap(model).megarl_lora["targets"]))
        self._delta: DdmaSender | None = None
        self.syncs = 0
        live = dict(unwrap(model).named_parameters())
        moving = sorted({c.src_param for _, _, cs in self.outgoing for c in cs if c.hf_name in self._skip
                         and c.src_param in live and live[c.src_param].requires_grad})
        if moving:
            raise ValueError(f"LoRA sync: {moving[:3]} train (requires_grad) but are frozen tensors the sync "
                             f"sends once; a parameter that trains must be a LoRA target's")

    def sync(self, version: int) -> dict:
        from megarl.trainer.lora import merge_into

        merge_into(self._model, self._merged)
        self.syncs += 1
        if self.syncs == 1 or not self._skip:
            return {**super().sync(version), "skipped_tensors": 0}
        if self._delta is None:
            self._delta = DdmaSender(dataclasses.replace(self.spec, skip=self._skip), self.rank, self._all)
        return {**self._delta.sync(version), "skipped_tensors": len(self._skip)}


__all__ = ["trainer_topology", "this_rank", "make_sender", "frozen_skip", "LoraMergedSender"]
