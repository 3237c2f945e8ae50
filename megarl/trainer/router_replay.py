"""Rollout routing replay (R3) for an MoE model: the trainer routes each token to the experts the
engine routed it to, and counts where its own router would have chosen otherwise.

megatron-core 0.16's ``RouterReplay`` (``transformer/moe/router_replay.py``) is the mechanism: every
``TopKRouter`` with a ``router_replay`` asks it for the top-k, and in ``REPLAY_FORWARD`` it returns the
given expert ids with the router's own scores gathered at them (so the gate weights stay
differentiable: softmax over the k replayed logits, as with ``moe_router_pre_softmax=False``). This
module gives each router of one model its own instance (taken out of megatron's process-wide list,
which would otherwise mix models built in one process), wraps its ``get_replay_topk`` to count the
routing mismatch, and sets the targets of one forward.

Expert ids come as ``[batch, seq, moe_layers, topk]`` (the padded batch layout, megarl/batch.py);
megatron's router sees tokens sequence-first (``[s, b, h]`` flattened to ``[s * b, h]``), so
:func:`model_order` transposes them. An id of -1 means "unknown" (a token the engine never ran
through its experts: the last sampled token, padding): the trainer's own choice is used there and
the token is not counted in the mismatch.

The trainer's passes (megarl/trainer/logprobs.py ``run_pipeline``) set each micro-batch's ids
(``RolloutBatch.routed_experts``, laid out like the forward's tokens: padded or packed) with
:meth:`RouterReplayer.set_targets` in its forward step; they stay until the next micro-batch's forward,
and :meth:`RouterReplayer.clear` ends the pass. ``RouterStats`` (router_stats.py) owns the replayer of
the policy model and reports the mismatch of each step's training passes.

Pipeline parallelism. A stage holds only its layers' routers: each takes the ids' column of its own
layer (its global ``layer_number`` placed among the model's MoE layers, ``ModelDims.moe_layers``), so
every stage is given the whole ``[tokens, moe_layers, k]`` tensor. Under PP > 1 several micro-batches
are in flight (1F1B: a stage runs up to ``pp - 1`` forwards before the first backward), so with
``trainer.recompute=full`` a layer's recompute in the backward would find a later micro-batch's ids:
megatron runs a checkpointed layer's forward under ``no_grad`` and its recompute with grad on, so each
router queues the ids its no-grad forwards used and a grad-on call with ids queued takes the oldest
(backwards run in forward order, per stage). That is megatron's own ``REPLAY_BACKWARD`` list, driven by
the grad mode instead of a global switch; a recompute is not counted twice in the mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

UNKNOWN = -1  # an expert id the engine did not report (see module docstring)


def router_columns(routers, moe_layers: Sequence[int] | None) -> list[int]:
    """Each router's column in the engine's ids: its layer (megatron's global, 1-based ``layer_number``)
    among ``moe_layers`` (global 0-based indices of the model's MoE layers, in order); with None the
    routers are the whole model's, in order."""
    if moe_layers is None:
        return list(range(len(routers)))
    place = {layer: i for i, layer in enumerate(moe_layers)}
    out = []
    for router in routers:
        layer = None if router.layer_number is None else router.layer_number - 1
        if layer not in place:
            raise ValueError(f"router replay: a router of layer {layer} is not among the model's MoE layers "
                             f"{list(moe_layers)}")
        out.append(place[layer])
    return out


def model_order(expert_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, layers, k]`` (batch layout) -> ``[s * b, layers, k]`` (megatron's token order)."""
    b, s, layers, k = expert_ids.shape
    return expert_ids.transpose(0, 1).reshape(s * b, layers, k)


class RouterReplayer:
    """Replays given expert ids through every ``TopKRouter`` of ``model`` and counts the
    token-layer pairs whose top-k set the trainer's forward used differs from the engine's."""

    def __init__(self, model: torch.nn.Module, replay: bool = False, moe_layers: Sequence[int] | None = None):
        """``moe_layers``: the global indices of the whole model's MoE layers, in order (the ids' columns;
        ``ModelDims.moe_layers``); None: this model's routers are all of them (one pipeline stage)."""
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.columns = router_columns(self.routers, moe_layers)
        self.num_moe_layers = len(moe_layers) if moe_layers is not None else len(self.routers)
        self.replays = []
        for router in self.routers:
            if router.router_replay is None:
                router.router_replay = RouterReplay()
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.router_replay.get_replay_topk = self._wrap(router.router_replay)
            self.replays.append(router.router_replay)
        self.compared = 0
        self.mismatched = 0
        self.replay = replay  # trainer.router_replay: what set_targets does (else only counts)
        self.recomputing = False  # whether the router call in progress is a backward's recompute
        self._replay = False

    def _wrap(self, rr):
        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            own_vals, own_idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target, recompute = rr.target_topk_idx, False
            self.recomputing = False
            if not torch.is_grad_enabled():  # a checkpointed forward (or a no-grad pass): its recompute may ask
                rr.replay_backward_list.append(target)
            elif rr.replay_backward_list:  # grad on with ids queued: the recompute of the oldest micro-batch
                target, recompute = rr.replay_backward_list.pop(0), True
                self.recomputing = True  # RouterStats' hook: this router's forward is a recompute, not counted
            if target is None:
                return own_vals, own_idx
            target = target.to(scores.device)
            if target.shape != own_idx.shape:
                raise ValueError(f"router replay: {tuple(target.shape)} expert ids for a forward routing "
                                 f"{tuple(own_idx.shape)} (tokens x topk): the ids must cover every token")
            known = (target >= 0).all(1)
            idx = torch.where(known[:, None], target, own_idx) if self._replay else own_idx
            used = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, idx, True)
            engine = torch.zeros_like(used).scatter_(1, target.clamp(min=0), True)
            if not recompute:
                self.compared += int(known.sum())
                self.mismatched += int(((used != engine).any(1) & known).sum())
            if not self._replay:
                return own_vals, own_idx
            return scores.gather(1, idx), idx
        return get_replay_topk

    def set_targets(self, expert_ids: torch.Tensor | None) -> None:
        """The engine's ids for the next forward(s), ``[tokens, layers, k]`` in megatron's order
        (:func:`model_order`): replayed when ``self.replay``, counted either way; None = the trainer's
        own routing, nothing counted. They stay until the next call or :meth:`clear`."""
        if expert_ids is None:
            self.clear()
            return
        if expert_ids.shape[1] != self.num_moe_layers:
            raise ValueError(f"router replay: expert ids for {expert_ids.shape[1]} MoE layers, the model has "
                             f"{self.num_moe_layers}")
        ids = expert_ids.long()
        for col, rr in zip(self.columns, self.replays):
            rr.target_topk_idx = ids[:, col]
        self._replay = self.replay

    def clear(self) -> None:
        for rr in self.replays:
            rr.target_topk_idx = None
            rr.replay_backward_list = []
        self._replay = False

    def metrics(self) -> dict[str, float]:
        """``moe/routing_mismatch``: share of the compared token-layer pairs routed to another top-k
        set than the engine's (0 with replay), since the last call; {} if nothing was compared."""
        if not self.compared:
            return {}
        out = {"moe/routing_mismatch": self.mismatched / self.compared}
        self.compared = self.mismatched = 0
        return out


__all__ = ["RouterReplayer", "model_order", "router_columns", "UNKNOWN"]
