"""Megatron-core on CPU (gloo): TP, PP (1F1B), DDP + DistributedOptimizer, via the compat layer.

One 2-process job runs every phase (fresh parallel state per phase) so the megatron import cost
is paid once; the tests then assert on the values it returned.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megarl.utils.dist import MultiprocessError, run_multiprocess

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the CPU/gloo compat path; on CUDA megatron runs natively")

SEED = 1234
VOCAB = 512
SEQ = 16
MICRO_BATCH = 2
NUM_MICROBATCHES = 4


def tiny_llama(tp: int, pp: int, pre_process: bool = True, post_process: bool = True):
    """A 2-layer Llama-style GPTModel: RMSNorm, SwiGLU, GQA (4 heads, 2 groups), RoPE."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
        sequence_parallel=False)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        pre_process=pre_process, post_process=post_process)


def make_batch(seed: int, batch: int = MICRO_BATCH) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).expand(batch, SEQ).contiguous(),
        # bool, True = masked (causal)
        "attention_mask": torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).expand(
            batch, 1, SEQ, SEQ).contiguous(),
    }


def _loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, _loss_func


def _run_schedule(model, batches: list, pp: int) -> float:
    """Forward+backward over the microbatches with megatron's schedule; mean loss (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        forward_only=False)
    return float(sum(d["loss"] for d in losses) / len(losses)) if losses else float("nan")


def _final_norm_grad(model) -> torch.Tensor | None:
    dec = model.decoder
    norm = getattr(dec, "final_layernorm", None)
    if norm is None or norm.weight.grad is None:
        return None
    return norm.weight.grad.detach().clone()


def _stage_slice(full_state: dict, stage_model, first_layer: int) -> dict:
    """The PP=1 state dict restricted to a pipeline stage (local layer i = global first_layer+i)."""
    out = {}
    for key in stage_model.state_dict():
        if key.startswith("decoder.layers."):
            _, _, idx, rest = key.split(".", 3)
            key_full = f"decoder.layers.{int(idx) + first_layer}.{rest}"
        else:
            key_full = key
        out[key] = full_state[key_full]
    return out


def _compat_probe(apply_cpu_compat) -> dict:
    """Apply the layer twice (in the child: the pytest process itself stays unpatched) and record
    what a second application would have changed."""
    import megatron.core.pipeline_parallel.schedules as sched
    from megatron.core.optimizer import clip_grads, distrib_optimizer

    def patched():
        return (torch.cuda.current_device, torch.Tensor.cuda, torch.Tensor.type, sched.torch,
                distrib_optimizer.DistributedOptimizer.__init__,
                clip_grads.clip_grad_by_total_norm_fp32)

    first = apply_cpu_compat()
    before = patched()
    second = apply_cpu_compat()
    return {"applied": (first, second),
            "unchanged_by_second": all(a is b for a, b in zip(before, patched())),
            "literal_cuda_alloc": sched.torch.zeros(2, device="cuda").device.type,
            "current_device": str(torch.cuda.current_device()),
            "plain_type_name": torch.zeros(1).type()}


def _phases(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.compat import apply_cpu_compat
    from megarl.utils.dist import init_model_parallel

    out: dict = _compat_probe(apply_cpu_compat)
    batches = [make_batch(SEED + i) for i in range(NUM_MICROBATCHES)]

    # (a)+(b) reference: TP=1, PP=1 (each rank computes the same thing)
    init_model_parallel(tp=1, pp=1, seed=SEED)
    model = tiny_llama(1, 1)
    out["loss_tp1"] = _run_schedule(model, batches, pp=1)
    out["grad_tp1"] = _final_norm_grad(model)
    full_state = {k: v.clone() if torch.is_tensor(v) else v
                  for k, v in model.state_dict().items()}

    # (a) TP=2
    init_model_parallel(tp=2, pp=1, seed=SEED)
    model = tiny_llama(2, 1)
    out["loss_tp2"] = _run_schedule(model, batches, pp=1)

    # (b) PP=2, 1F1B with several microbatches
    init_model_parallel(tp=1, pp=2, seed=SEED)
    model = tiny_llama(1, 2, pre_process=ps.is_pipeline_first_stage(),
                       post_process=ps.is_pipeline_last_stage())
    # PP draws the init in another order: give each stage its slice of the PP=1 weights
    model.load_state_dict(_stage_slice(full_state, model, 
                                       first_layer=ps.get_pipeline_model_parallel_rank()), strict=True)
    out["loss_pp2"] = _run_schedule(model, batches, pp=2)
    out["pp_last_stage"] = ps.is_pipeline_last_stage()
    out["grad_pp2"] = _final_norm_grad(model)

    # (c) DP=2: megatron DDP + DistributedOptimizer; each rank sees a different batch
    out.update(_dp_step(rank))
    return out


def _dp_step(rank: int) -> dict:
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp=1, pp=1, seed=SEED)
    model = tiny_llama(1, 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # without this hook the schedule never reduces grads across DP (each rank would step its
    # shard with local grads, and the ranks would still agree: the reference below catches it)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.0, adam_eps=1e-3, clip_grad=1.0, bf16=False,
        params_dtype=torch.float32, use_distributed_optimizer=True), [ddp])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = _run_schedule(ddp, [make_batch(100 + rank)], pp=1)
    ok, grad_norm, _ = opt.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"dp_reference": _reference_dp_step(),"dp_step_ok": ok, "dp_grad_norm": grad_norm, "dp_loss": loss,
            "dp_before": before, "dp_after": after,
            "dp_opt_types": sorted({type(o).__name__
                                     for o in getattr(opt, "chained_optimizers", [opt])})}


def _reference_dp_step() -> dict:
    """Independent reference for the DP=2 step: one process, both ranks' batches, torch AdamW, clip by
    global norm 1.0 (weight decay off: megatron applies its per-group wd_mult in the scheduler)."""
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp=1, pp=1, seed=SEED)
    model = tiny_llama(1, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for r in range(2):
        b = make_batch(100 + r)
        losses.append(model(b["tokens"], b["position_ids"], b["attention_mask"],
                            labels=b["labels"]).mean())
    (sum(losses) / 2).backward()
    torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    # eps well above float noise: Adam's first step is sign(g)*lr for |g| >> eps
    torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, eps=1e-3).step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=1)
def _results() -> tuple:
    return tuple(run_multiprocess(_phases, 2, timeout_s=600))


def test_cpu_compat_idempotent():
    r = _results()[0]
    assert r["applied"] == (True, True)
    assert r["unchanged_by_second"]  # nothing wrapped twice
    assert r["literal_cuda_alloc"] == "cpu" and r["current_device"] == "cpu"
    assert r["plain_type_name"] == "torch.FloatTensor"  # Tensor.type renames only inside optimizers


def test_tp2_loss_matches_tp1():
    r = _results()
    # both ranks run the identical TP=1 computation on the same data: bitwise equal
    assert r[0]["loss_tp1"] == pytest.approx(r[1]["loss_tp1"], abs=0)
    # fp32 loss ~ ln 512 ~ 6.2 (ulp 4.8e-7): TP's reordered sums of <= 128 terms move it by ~sqrt(128) * 2^-24
    # relative, ~4e-6 (tests/e2e/test_checkpoint.py); 1e-5 leaves 2.5x
    assert abs(r[0]["loss_tp2"] - r[0]["loss_tp1"]) < 1e-5, (r[0]["loss_tp2"], r[0]["loss_tp1"])
    assert abs(r[1]["loss_tp2"] - r[0]["loss_tp1"]) < 1e-5  # as above


def test_pp2_1f1b_matches_pp1():
    r = _results()
    last = [x for x in r if x["pp_last_stage"]]
    assert len(last) == 1
    # PP=2 moves activations between ranks, but runs its micro-batches as GEMMs of other shapes (other
    # blockings, other summation orders): as for TP, sums of <= 128 terms reordered, ~sqrt(128) * 2^-24 ~ 7e-7
    # relative of a loss ~6.2, ~4e-6 (tests/e2e/test_checkpoint.py); 1e-5 leaves 2.5x
    assert abs(last[0]["loss_pp2"] - r[0]["loss_tp1"]) < 1e-5, (last[0]["loss_pp2"],
                                                               r[0]["loss_tp1"])
    # the backward through the pipeline reaches the final norm with the same gradient
    # same arithmetic, grads accumulated over 4 microbatches: a few fp32 ulps; generous rtol, atol for ~0 entries
    torch.testing.assert_close(last[0]["grad_pp2"], r[0]["grad_tp1"], rtol=1e-4, atol=1e-6)


def test_ddp_distributed_optimizer_step_identical_on_ranks():
    r = _results()
    assert r[0]["dp_opt_types"] == ["DistributedOptimizer"]
    assert r[0]["dp_step_ok"] and r[1]["dp_step_ok"]
    assert r[0]["dp_loss"] != r[1]["dp_loss"]  # different data per rank
    # the same all-reduced squared norm on both ranks: fp32 rounding only (2^-23 ~ 1.2e-7); 1e-6 leaves room
    assert r[0]["dp_grad_norm"] == pytest.approx(r[1]["dp_grad_norm"], rel=1e-6)
    for name, before in r[0]["dp_before"].items():
        # same seed, same init on both ranks: bitwise
        torch.testing.assert_close(before, r[1]["dp_before"][name], rtol=0, atol=0)
        a0, a1 = r[0]["dp_after"][name], r[1]["dp_after"][name]
        # the DistributedOptimizer all-gathers the updated shards: bitwise identical
        torch.testing.assert_close(a0, a1, rtol=0, atol=0, msg=f"{name} differs across ranks")
        assert not torch.equal(a0, before), f"{name} did not change"
        # eps 1e-3: step 1 ~ sign(g) * lr, insensitive to ~1e-6 grad reorder noise: weights agree to a few ulps
        torch.testing.assert_close(a0, r[0]["dp_reference"][name], rtol=1e-5, atol=1e-6,
                                   msg=f"{name}: DP=2 step differs from the 1-process reference")


def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def test_run_multiprocess_reports_child_traceback():
    with pytest.raises(MultiprocessError, match=r"(?s)rank 1 of 2 .*ValueError: boom from rank 1"):
        run_multiprocess(_raise_on_rank1, 2, timeout_s=60)


def _crash_or_hang(rank: int, world_size: int, mode: str) -> int:
    import os
    import time
    if rank == 1 and mode == "crash":
        os._exit(3)  # dies without a Python exception
    if rank == 1 and mode == "hang":
        time.sleep(600)
    return rank


def test_run_multiprocess_reports_crash_and_timeout():
    with pytest.raises(MultiprocessError, match="rank 1 of 2 .* exit code 3"):
        run_multiprocess(_crash_or_hang, 2, "crash", timeout_s=60)
    # rank 0 may not even have started on a loaded machine: [1] or [0, 1] are both right
    with pytest.raises(MultiprocessError, match=r"ranks \[(0, )?1\] of 2 .* within 10s"):
        run_multiprocess(_crash_or_hang, 2, "hang", timeout_s=10)


def _rank_id(rank: int, world_size: int) -> int:
    return rank


def test_run_multiprocess_retries_when_the_port_is_taken(monkeypatch):
    import socket

    import megarl.utils.dist as dist_mod

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = dist_mod.free_tcp_port
        chosen = []

        def next_port():
            chosen.append(next(ports, None) or real_free_port())
            return chosen[-1]
        monkeypatch.setattr(dist_mod, "free_tcp_port", next_port)
        assert run_multiprocess(_rank_id, 1, timeout_s=120) == [0]
    assert chosen[0] == taken and len(chosen) == 2


def _group_timeouts(rank: int, world_size: int, timeout_s: float | None) -> list:
    from megatron.core import parallel_state as ps

    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=0, timeout_s=timeout_s)
    groups = [ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_data_parallel_group(), ps.get_data_parallel_group_gloo()]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def test_megatron_groups_wait_as_long_as_the_trainer_says():
    """The trainer's collective timeout (worker.py: longer than its executor's own) reaches Megatron's
    TP/PP/DP groups, in whole minutes rounded up; without it they would wait Megatron's 30 minutes."""
    assert run_multiprocess(_group_timeouts, 1, 150.0, timeout_s=300) == [[180.0] * 4]
    assert run_multiprocess(_group_timeouts, 1, None, timeout_s=300) == [[1800.0] * 4]

