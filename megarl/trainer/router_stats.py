"""Per-step router statistics of an MoE model: how many tokens each expert got in the training pass.

Forward hooks on every megatron ``TopKRouter`` (its forward returns ``(probs, routing_map)``, the map
``[tokens, experts]`` bool) count the tokens routed to each expert, per layer, while :meth:`counting`
is open. The counts are summed over the data-parallel ranks (each routes its own tokens; TP ranks
route the same ones and are not added) and gathered over the pipeline stages (each holds its own
layers' routers: a stage's rows are its layers' places among the model's MoE layers, and a stage
with no MoE layer adds zeros), so every rank reports the same metrics. A backward's recompute
(``trainer.recompute=full``) routes again and is not counted. Padding tokens of a
micro-batch are routed like any token and counted (megatron routes them; the count says where compute went).

``moe/routing_mismatch``: the share of token-layer pairs whose top-k set in the training passes differs
from the generator engine's (``RolloutBatch.routed_experts``), counted by the model's
:class:`~megarl.trainer.router_replay.RouterReplayer`, which this class builds and hangs on the model
(``megarl_router_replayer``) for ``run_pipeline`` to feed; 0 with ``trainer.router_replay`` (replayed).
Logged whenever the step's batch carries routed experts (an MoE model's samples always do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class RouterStats:
    """Counts tokens per expert of each MoE layer of ``model`` (none for a dense model)."""

    def __init__(self, model: torch.nn.Module, replay: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        from megarl.trainer.config import router_replay_problems
        from megarl.trainer.model import unwrap

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        dims = getattr(unwrap(model), "megarl_dims", None)
        # the whole model's MoE layers (a pipeline stage may hold none of them); a bare megatron model
        # without megarl's dims: its routers are all of them
        moe_layers = tuple(dims.moe_layers) if dims is not None and dims.is_moe else None
        self.is_moe = moe_layers is not None or bool(self.routers)
        problems = router_replay_problems(replay, self.is_moe, getattr(dims, "family", ""))
        if problems:
            raise ValueError(problems[0])
        self.replayer = None
        if self.is_moe:
            from megarl.trainer.router_replay import RouterReplayer

            self.replayer = RouterReplayer(model, replay=replay, moe_layers=moe_layers)
            unwrap(model).megarl_router_replayer = self.replayer
            self.experts = dims.num_experts if moe_layers is not None else self.routers[0].weight.shape[0]
        self.counts: dict[int, torch.Tensor] = {}
        self._on = False
        for router, column in zip(self.routers, self.replayer.columns if self.replayer else ()):
            router.register_forward_hook(self._hook(column))

    def _hook(self, layer: int):
        def hook(module, args, output) -> None:
            if not self._on or self.replayer.recomputing:
                return
            routing_map = output[1]
            counts = routing_map.reshape(-1, routing_map.shape[-1]).sum(0).to(torch.float64)
            self.counts[layer] = self.counts.get(layer, 0) + counts.detach().cpu()
        return hook

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the routing of the forwards run inside: a step's, i.e. every update's training pass
        (trainer.minibatches x trainer.epochs of them) and a batch-statistic pass (vaco) where the loss has one."""
        self.counts, self._on = {}, True
        if self.replayer is not None:
            self.replayer.compared = self.replayer.mismatched = 0
        try:
            yield
        finally:
            self._on = False

    def metrics(self) -> dict[str, float]:
        """``moe/tokens_per_expert_max`` / ``_mean`` / ``_min`` (tokens, over experts and MoE layers,
        summed over DP), ``moe/load_imbalance`` = max / mean (1 = perfectly balanced), and
        ``moe/expert_load/<e>``: expert e's share of the routed tokens, averaged over layers, and
        ``moe/routing_mismatch`` (module docstring; pairs summed over DP and the pipeline stages) when any
        were compared. Collective over the data-parallel and the pipeline group; {} for a dense model."""
        if not self.is_moe:
            return {}
        from megatron.core import parallel_state as ps

        table = torch.zeros(self.replayer.num_moe_layers, self.experts, dtype=torch.float64)
        for layer, c in self.counts.items():
            table[layer] = c
        pairs = torch.tensor([float(self.replayer.compared), float(self.replayer.mismatched)], dtype=torch.float64)
        if ps.get_pipeline_model_parallel_world_size() > 1:  # each stage filled its own layers' rows
            torch.distributed.all_reduce(table, group=ps.get_pipeline_model_parallel_group())
            torch.distributed.all_reduce(pairs, group=ps.get_pipeline_model_parallel_group())
        if ps.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(table, group=ps.get_data_parallel_group())
            torch.distributed.all_reduce(pairs, group=ps.get_data_parallel_group())
        mean = float(table.mean())
        out = {"moe/tokens_per_expert_max": float(table.max()), "moe/tokens_per_expert_mean": mean,
               "moe/tokens_per_expert_min": float(table.min()),
               "moe/load_imbalance": float(table.max()) / mean if mean else 0.0}
        share = table / table.sum(1, keepdim=True).clamp(min=1.0)
        for e, s in enumerate(share.mean(0).tolist()):
            out[f"moe/expert_load/{e}"] = s
        if pairs[0] > 0:  # the step's batch carried the engine's routed experts
            out["moe/routing_mismatch"] = float(pairs[1] / pairs[0])
        return out


__all__ = ["RouterStats"]
