"""The experts a vLLM engine routed each token to, per MoE layer: what the trainer replays (R3,
megarl/trainer/router_replay.py).

vLLM 0.32's own return of routed experts (``enable_return_routed_experts``) needs its Model Runner V2,
which needs Triton: on CPU the engine refuses to start with it (``AuxOutput Connector requires Model
Runner V2``; with ``VLLM_USE_V2_MODEL_RUNNER=1``: ``Model Runner V2 requires Triton``). This module uses
the library hook that feature is built on instead: every ``MoERunner``'s router takes a capture
function (``BaseRouter.set_capture_fn``) called with the logical top-k ids of each forward, before
any expert-placement mapping. The worker functions below run on every TP worker through
``collective_rpc`` (each worker routes all tokens; worker 0's answer is used).

Two captures:

* :func:`install_capture` / :func:`take_captured` keep each forward's rows in order (one request at
  a time: the test's engine, tests/e2e/test_router_replay.py).
* :func:`install_request_capture` / :func:`take_request_experts` (what a megarl replica runs, through
  ``MegarlWorkerExtension``) file every row under its request and token position as the model
  runner laid out the step: request i of ``input_batch.req_ids`` owns rows
  ``query_start_loc[i]:query_start_loc[i+1]``, at positions ``num_computed_tokens[i] + 0, 1, ...``
  (the same arithmetic the runner's ``_prepare_inputs`` uses for ``positions``). So a mixed batch
  (several requests, chunked prefills, decodes) maps exactly, and a request preempted and recomputed
  (a weight update resets running requests) has its positions overwritten by the recompute. A
  prompt prefix served from the prefix cache runs no forward: its positions are copied from the
  routing recorded for the KV blocks that serve it (block id -> the rows whose KV it holds, kept per
  block as each forward fills it; the prefix cache is reset at every weight update, so a hit is
  always this version's routing).
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


def install_request_capture(worker) -> int:
    """Worker side: file every routed row under its request and position (module docstring); returns
    the number of MoE layers hooked (0: a dense model, nothing hooked). Idempotent (a weight update
    re-installs it)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    store: dict[str, np.ndarray] = worker.__dict__.setdefault("_megarl_routed_requests", {})
    runner_model = worker.model_runner
    runners = sorted((m for m in runner_model.model.modules() if isinstance(m, MoERunner)), key=lambda r: r.layer_id)
    layers = len(runners)

    # KV block id -> [block_size, layers, k]: the routing of the tokens whose KV the block holds, so a
    # request whose prompt prefix is a prefix-cache hit (no forward for it) gets that prefix's routing
    blocks: dict[int, np.ndarray] = worker.__dict__.setdefault("_megarl_routed_blocks", {})

    def capture(topk_ids, order):
        batch = runner_model.input_batch
        n = batch.num_reqs
        if not n:
            return  # a dummy run
        bounds = runner_model.query_start_loc.np[:n + 1]
        starts = batch.num_computed_tokens_cpu[:n]
        table = batch.block_table[0]
        bs, block_ids = table.block_size, table.block_table.np
        ids = topk_ids.detach().to("cpu").numpy().astype(np.int16)
        k = ids.shape[1]
        for i, rid in enumerate(batch.req_ids[:n]):
            a, b = int(bounds[i]), int(bounds[i + 1])
            if b <= a:
                continue
            p0 = int(starts[i])
            arr = store.get(rid)
            if arr is None and p0 > 0 and order == 0:  # its first forward, after a prefix-cache hit
                arr = store[rid] = np.full((p0 + b - a, layers, k), -1, dtype=np.int16)
                for j in range(0, p0, bs):
                    cached = blocks.get(int(block_ids[i, j // bs]))
                    if cached is not None:
                        arr[j:min(j + bs, p0)] = cached[:min(bs, p0 - j)]
            if arr is None or arr.shape[0] < p0 + b - a:
                grown = np.full((max(p0 + b - a, 2 * (0 if arr is None else arr.shape[0])), layers, k), -1,
                                dtype=np.int16)
                if arr is not None:
                    grown[:arr.shape[0]] = arr
                store[rid] = arr = grown
            arr[p0:p0 + b - a, order] = ids[a:b]
            for j in range(p0 - p0 % bs, p0 + b - a, bs):  # the KV blocks these positions fill
                lo, hi = max(j, p0), min(j + bs, p0 + b - a)
                blk = blocks.get(int(block_ids[i, j // bs]))
                if blk is None:
                    blk = blocks[int(block_ids[i, j // bs])] = np.full((bs, layers, k), -1, dtype=np.int16)
                blk[lo - j:hi - j, order] = ids[a + lo - p0:a + hi - p0]

    for order, runner in enumerate(runners):
        if not isinstance(runner.router, BaseRouter):
            raise ValueError(f"routed-experts capture: router {type(runner.router).__name__} takes no capture function")
        runner.router.set_capture_fn(lambda topk_ids, _order=order: capture(topk_ids, _order))
    return layers


def take_request_experts(worker, request_ids: list[str]) -> dict[str, np.ndarray]:
    """Worker side: the rows filed under ``request_ids`` (the caller's ids; vLLM's internal ones add
    ``-<8 hex>``), ``[positions, moe_layers, topk]`` int16 with -1 where nothing ran, and forget them."""
    store: dict[str, np.ndarray] = worker.__dict__.get("_megarl_routed_requests", {})
    wanted = set(request_ids)
    out = {}
    for rid in list(store):
        outer = rid if rid in wanted else rid.rsplit("-", 1)[0]
        if outer in wanted:
            out[outer] = store.pop(rid)
    return out


__all__ = ["install_capture", "take_captured", "install_request_capture", "take_request_experts"]
