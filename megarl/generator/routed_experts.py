"""The experts a vLLM engine routed each token to, per MoE layer: what the trainer replays (R3,
megarl/trainer/router_replay.py).

vLLM 0.32's own return of routed experts (``enable_return_routed_experts``) needs its Model Runner V2,
which needs Triton: on CPU the engine refuses to start with it (``AuxOutput Connector requires Model
Runner V2``; with ``VLLM_USE_V2_MODEL_RUNNER=1``: ``Model Runner V2 requires Triton``). This module uses
the library hook that feature is built on instead: every ``MoERunner``'s router takes a capture
function (``BaseRouter.set_capture_fn``) called with the logical top-k ids of each forward, before
any expert-placement mapping. The worker functions below run on every TP worker through
``collective_rpc`` (each worker routes all tokens; worker 0's answer is used).

Which rows belong to which request is the caller's: these functions keep each forward's rows in
order. With one sequence at a time and a whole prompt in one prefill step (the engine's
deterministic mode, ``controller.deterministic``) a request's rows are the concatenation of the
forwards that ran while it was the only one: its prompt tokens, then each fed-back sampled token.
Mapping rows of a mixed batch to requests (the scheduler's per-step token counts) is not built.
"""

from __future__ import annotations

import numpy as np


def install_capture(worker) -> int:
    """Worker side: hook every MoE layer's router; returns the number of MoE layers hooked."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    store: dict[int, list[np.ndarray]] = worker.__dict__.setdefault("_megarl_routed", {})
    runners = [m for m in worker.model_runner.model.modules() if isinstance(m, MoERunner)]
    for order, runner in enumerate(sorted(runners, key=lambda r: r.layer_id)):
        if not isinstance(runner.router, BaseRouter):
            raise ValueError(f"routed-experts capture: router {type(runner.router).__name__} takes no capture function")

        def capture(topk_ids, _order=order):
            store.setdefault(_order, []).append(topk_ids.detach().to("cpu").numpy().astype(np.int16))

        runner.router.set_capture_fn(capture)
    return len(runners)


def take_captured(worker) -> np.ndarray | None:
    """Worker side: the rows captured since the last call, ``[tokens, moe_layers, topk]`` int16
    (layers in model order), and forget them; None if nothing was captured."""
    store: dict[int, list[np.ndarray]] = worker.__dict__.get("_megarl_routed", {})
    if not store:
        return None
    out = np.stack([np.concatenate(store[i], 0) for i in sorted(store)], 1)
    store.clear()  # the capture functions hold this dict: empty it, keep it
    return out


__all__ = ["install_capture", "take_captured"]
