"""The dry run's memory plan (megarl/config/memory.py) term by term against figures worked out by hand
from the model's dims, its advice (the layout a user would run), and one meeting with reality: a CPU
trainer rank's peak memory over a step against the plan's figure for the same shape."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.memory import GB, OVERHEAD_GB, plan_memory, trainer_plan, trainer_rank_params
from megarl.models.dims import ModelDims

REPO = Path(__file__).resolve().parents[2]
LLAMARL = REPO / "configs" / "recipes" / "llamarl_llama31_8b_math.yaml"


def _dims(name: str) -> ModelDims:
    return ModelDims.from_hf_config(json.loads((REPO / "configs" / "models" / name).read_text()))


def _cfg(*overrides: str, path=LLAMARL):
    return load_config(path, list(overrides), dry_run=True)


# Llama 3.1 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, FFN 14336, vocab 128256 (a
# multiple of 128: no padding), N = 8,030,261,248 parameters. The recipe's shape: s = 512 + 2048 = 2560.
N8B = 8_030_261_248
S = 2560
# per token and layer at 16-bit: 10h + 4h + 4kv + 2*3*F = 40960 + 16384 + 4096 + 86016 = 147456 bytes
LAYER_TOKEN = 147_456
V = 128_256


def _plan8b(**kw):
    args = dict(tp=1, pp=1, dp=32, params_dtype="bfloat16", distributed_optimizer=True, seq=S, micro_batch=1)
    return trainer_plan(_dims("llama-3.1-8b.json"), **{**args, **kw})


def test_every_trainer_term_against_a_hand_figure():
    p = _plan8b(reference=True, fp8_wire=True, entropy=True, fused_attention=False)
    assert p["weights"] == 2 * N8B                        # 16.06 GB
    assert p["gradients"] == 4 * N8B                      # fp32 main grads: 32.12 GB
    assert p["optimizer"] == pytest.approx(12 * N8B / 32)  # m, v, master over dp 32: 3.01 GB
    assert p["reference"] == 2 * N8B                      # the KL reference: a second bf16 copy
    # fp8 wire: 1 B/param + a 4-byte scale per row of hidden (4096) elements: N + 4 N / 4096
    assert p["fp8_wire"] == pytest.approx(N8B * (1 + 4 / 4096))
    assert p["activations"] == 32 * S * LAYER_TOKEN       # 12,079,595,520 B = 12.08 GB
    # scores: fp32 softmax output + its bf16 cast = 6 B x 32 heads x 2560^2 x 32 layers = 40.27 GB
    assert p["attention_scores"] == 6 * 32 * S * S * 32 == 40_265_318_400
    # logits [2560, 128256]: bf16 output 2 + fp32 copy 4 + fp32 grad 4 + bf16 grad 2 = 12 B: 3.94 GB
    assert p["logits"] == S * V * 12 == 3_940_024_320
    assert p["entropy"] == S * V * 12                     # z, exp(z), exp(z) z in fp32
    assert p["overhead"] == OVERHEAD_GB * GB
    # off by default: no reference, no fp8 wire, no entropy
    q = _plan8b(fused_attention=True)
    assert q["reference"] == q["fp8_wire"] == q["entropy"] == q["attention_scores"] == 0


def test_fp32_logits_need_no_copy_and_temperature_does():
    d = _dims("llama-3.1-8b.json")
    base = dict(tp=1, pp=1, dp=1, params_dtype="float32", distributed_optimizer=False, seq=S, micro_batch=1)
    # fp32 output used in place by the cross entropy: output 4 + gradient 4 = 8 B a logit
    assert trainer_plan(d, **base)["logits"] == S * V * 8
    # logits / temperature is a new fp32 tensor: + 4
    assert trainer_plan(d, **base, temperature=0.7)["logits"] == S * V * 12
    # fp32 activations are twice Korthikanti's 16-bit figures; fp32 scores keep only the softmax (4 B)
    p = trainer_plan(d, **base, fused_attention=False)
    assert p["activations"] == 2 * 32 * S * LAYER_TOKEN
    assert p["attention_scores"] == 4 * 32 * S * S * 32


def test_recompute_and_token_budget_terms():
    sel = _plan8b(recompute="selective", fused_attention=False)
    assert sel["attention_scores"] == 0 and sel["activations"] == 32 * S * LAYER_TOKEN
    full = _plan8b(recompute="full", fused_attention=False)
    # each of the 32 layers keeps its bf16 input [2560, 4096] plus one layer rebuilt whole in the backward
    assert full["activations"] == 32 * S * 4096 * 2 + S * LAYER_TOKEN
    assert full["attention_scores"] == 6 * 32 * S * S   # that layer's scores
    # token budget 8192: ceil(8192 / 2560) = 4 rows of 2560, whatever micro_batch_size says
    bud = _plan8b(max_tokens=8192, micro_batch=8, fused_attention=False)
    assert bud["activations"] == 4 * 32 * S * LAYER_TOKEN
    assert bud["attention_scores"] == 4 * 6 * 32 * S * S * 32
    assert bud["logits"] == 4 * S * V * 12
    # a budget below one sequence still holds that sequence alone: 1 row
    assert _plan8b(max_tokens=1000, micro_batch=8)["activations"] == 32 * S * LAYER_TOKEN
    # no budget: micro_batch_size rows
    assert _plan8b(micro_batch=8)["activations"] == 8 * 32 * S * LAYER_TOKEN


def test_expert_parallel_splits_the_experts():
    d = _dims("qwen3-30b-a3b.json")
    # 48 layers x 128 experts x (gate, up, down: 3 x 2048 x 768) = 28,991,029,248 expert parameters
    experts = 48 * 128 * 3 * 2048 * 768
    assert experts == 28_991_029_248
    n1, n4 = trainer_rank_params(d, 1, 1, 1), trainer_rank_params(d, 1, 1, 4)
    assert n1 - n4 == experts * 3 // 4
    kw = dict(tp=1, pp=1, dp=8, params_dtype="bfloat16", distributed_optimizer=True, seq=S, micro_batch=1)
    p = trainer_plan(d, ep=4, **kw)
    assert p["weights"] == 2 * n4
    # dense parameters' Adam state over dp 8, the experts' over their expert-data-parallel group (8/4 = 2)
    dense = n1 - experts
    assert p["optimizer"] == pytest.approx(12 * dense / 8 + 12 * (experts / 4) / 2)


def test_plan_from_config_counts_reference_shared_devices_and_fp8():
    d = _dims("llama-3.1-8b.json")
    base = plan_memory(_cfg(), d, fused_attention=True)
    assert base.problems == [] and "reference" not in [k for k, v in base.trainer.items() if v]
    ref = plan_memory(_cfg("algorithm.kl_coef=0.01"), d, fused_attention=True)
    assert ref.trainer["reference"] == 2 * N8B
    assert ref.trainer_total - base.trainer_total == pytest.approx(2 * N8B)
    fp8 = plan_memory(_cfg("sync.wire=fp8"), d, fused_attention=True)
    assert fp8.trainer["fp8_wire"] == pytest.approx(N8B * (1 + 4 / 4096))
    # without TE and without recompute the scores are kept: 69.2 GB + 40.3 GB does not fit 80
    unfused = plan_memory(_cfg(), d, fused_attention=False)
    assert unfused.trainer["attention_scores"] == 6 * 32 * S * S * 32
    assert any("trainer.recompute=selective" in p for p in unfused.problems), unfused.problems
    # share_devices: trainer 69.2 GB + generator 68 GB (0.85 x 80) on one 80 GB GPU does not fit,
    # although each fits a GPU of its own
    shared = plan_memory(_cfg("cluster.share_devices=true"), d, fused_attention=True)
    assert shared.shared and shared.shared_total == pytest.approx(base.trainer_total + base.generator_total)
    assert base.trainer_total < 80 * GB and base.generator_total < 80 * GB
    assert any("cluster.share_devices" in p for p in shared.problems), shared.problems
    assert any("shared GPU" in ln for ln in shared.lines())


def test_the_printout_names_each_term_on_its_own_line():
    lines = plan_memory(_cfg("algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001", "sync.wire=fp8"),
                        _dims("llama-3.1-8b.json"), fused_attention=False).lines()
    for term in ("weights", "gradients", "optimizer", "reference", "fp8_wire", "activations", "attention_scores",
                 "logits", "entropy", "overhead", "kv_cache"):
        assert sum(ln.split()[0] == term for ln in lines) >= 1, (term, lines)
    assert all(ln.rstrip().endswith("GB") or "(" in ln for ln in lines if ln.startswith("    ")), lines


def test_advice_names_the_layout_a_user_would_run():
    d70 = _dims("llama-3.1-70b.json")
    cfg = _cfg("model.path=meta-llama/Llama-3.1-70B-Instruct")
    plan = plan_memory(cfg, d70, fused_attention=True)
    trainer_fix = next(p for p in plan.problems if p.startswith("trainer.tp=1"))
    # TP within the node's 8 GPUs first: TP8 alone does not fit (70.6e9 / 8 = 8.8e9 params x 6 B = 53 GB
    # + Adam + activations), so PP at TP 8
    assert trainer_fix.endswith("set trainer.tp=8 trainer.pp=2 (tensor parallel over a node of 8 GPUs, "
                                "then pipeline stages)"), trainer_fix
    fixed = plan_memory(_cfg("model.path=meta-llama/Llama-3.1-70B-Instruct", "trainer.tp=8", "trainer.pp=2",
                             "trainer.dp=2"), d70, fused_attention=True)
    assert fixed.trainer_total <= 80 * GB
    assert not any(p.startswith("trainer.") for p in fixed.problems), fixed.problems
    # generator under gpu_memory_utilization 0.85 of 80 = 68 GB: tp 2 holds 70.6 GB of weights (no), tp 4
    # 35.3 GB + 2 GB overhead + one 4096-token sequence of KV (4096 x 2 x 80 layers x 2 heads x 128 x 2 B
    # = 0.34 GB) fits
    gen_fix = next(p for p in plan.problems if p.startswith("generator.tp=1"))
    assert gen_fix.endswith("set generator.tp=4"), gen_fix
    assert "gpu_memory_utilization=0.85 of 80 GB (68.0 GB)" in gen_fix


# --- the plan meets a CPU trainer rank -----------------------------------------------------------

SEQ, MB = 256, 4


def _peak_worker(rank, world, hf_dir):
    import torch

    from megarl.batch import RolloutBatch
    from megarl.models.layouts import ModelDims as MD
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 1000, (SEQ,), generator=g).tolist() for _ in range(MB)]
    batch = RolloutBatch.from_sequences(tokens, [[0.0] * 8 + [1.0] * (SEQ - 8)] * MB,
                                        behav_logprobs=[[-5.0] * SEQ] * MB, advantages=[1.0, -1.0, 0.5, 1.0],
                                        versions=[[0] * SEQ] * MB)
    cfg = TrainerConfig(lr=1e-3, use_distributed_optimizer=False)
    init_model_parallel(1, 1, seed=1)
    baseline = rss("VmRSS")  # Python, torch, megatron imported; no model yet
    model = build_gpt_model(MD.from_hf_config(read_hf_config(hf_dir)))
    load_hf_into_model(model, hf_dir)
    objs = build_training(cfg, model, total_steps=1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to now: loading's transients are not the step's
    train_step(objs, batch, loss_name="aipo", loss_params={"rho": 4.0}, micro_batch_size=MB, current_version=0)
    return rss("VmHWM") - baseline


def test_cpu_peak_over_a_step_meets_the_plan(tiny_llama_dir, monkeypatch):
    from megarl.trainer.model import read_hf_config
    from megarl.utils.dist import run_multiprocess

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors go back to the kernel at once
    peak = run_multiprocess(_peak_worker, 1, str(tiny_llama_dir), timeout_s=300)[0]
    dims = ModelDims.from_hf_config(read_hf_config(tiny_llama_dir))
    plan = trainer_plan(dims, tp=1, pp=1, dp=1, params_dtype="float32", distributed_optimizer=False, seq=SEQ,
                        micro_batch=MB, fused_attention=False)  # the local spec, as on this machine
    planned = sum(plan.values()) - plan["overhead"]  # no CUDA context on CPU
    ratio = peak / planned
    print(f"CPU peak over a step {peak / 2**20:.1f} MiB above the pre-model baseline; plan "
          f"{planned / 2**20:.1f} MiB; ratio {ratio:.2f}; terms (MiB):",
          {k: round(v / 2**20, 1) for k, v in plan.items() if v})
    # Band, from what the plan leaves out. Below: the plan adds every term, but on a first step Adam's state
    # is created in optimizer.step(), after the loss's logits and activations are freed, so the two are
    # never live together: the peak may fall to the plan less the optimizer term. Above: torch's transients
    # the plan does not count: one more fp32 [tokens, vocab] tensor in the cross entropy's backward (half
    # the fp32 logits term, which counts output + gradient) and Adam's foreach temporaries (up to 2 x 4 B a
    # parameter, i.e. 2 x weights at fp32).
    lower = (planned - plan["optimizer"]) / planned
    upper = (planned + plan["logits"] / 2 + 2 * plan["weights"]) / planned
    print(f"band [{lower:.2f}, {upper:.2f}]")
    assert lower <= ratio <= upper, (ratio, lower, upper, peak, planned)
