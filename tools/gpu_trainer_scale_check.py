"""GPU check: megarl's trainer at a ~200M shape, a step's memory against the dry run's plan, and a save/resume.

A Llama of hidden 1024, 12 layers, GQA 16/8 heads, ffn 2816, vocab 32000, untied (207M parameters), random
weights written as an HF folder here, trained by megarl's ``LocalTrainer`` (bf16 weights, fp32 master
weights, the distributed optimizer) on one GPU:

- **memory**: ``torch.cuda.max_memory_allocated`` over the logprob pass and one step at the batch's shape
  (8 rows of SEQ tokens, micro-batch 4), against the trainer's figure of the memory plan
  (``megarl.config.memory.plan_for``) for the same shape, layout and dtypes. The plan must not be below what
  the step held (a plan that says "fits" where the GPU runs out is the failure it exists to prevent); the
  ratio is reported (the plan also counts the CUDA context and allocator slack as its overhead term, which
  max_memory_allocated does not see).
- **save/resume**: the trainer saves after the step; a second process resumes from that checkpoint and
  computes the logprobs of the same batch, which must equal the first process's after its step bit for bit
  (same GPU, same kernels, deterministic logprob pass).

Prints one JSON line; exit 1 on failure. ``MEGARL_GPU_CHECK_PLANT=scale`` perturbs the resumed logprobs (the
check must fail). ``--cpu-dry``: the same control flow on CPU at a tiny shape (no memory figure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
             num_hidden_layers=12, vocab_size=32000)
DRY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=512)
SEQ, ROWS, MICRO = 512, 8, 4
COMMON = dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, tie_word_embeddings=False,
              max_position_embeddings=2048, rope_theta=10000.0, torch_dtype="bfloat16", hidden_act="silu")


def write_model(out: str, shape: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    from megarl.models.layouts import ModelDims, hf_tensor_shapes

    config = {**COMMON, **shape}
    g = torch.Generator().manual_seed(0)
    tensors = {name: (1 + 0.02 * torch.randn(s, generator=g)) if name.endswith("norm.weight")
               else 0.02 * torch.randn(s, generator=g)
               for name, s in hf_tensor_shapes(ModelDims.from_hf_config(config)).items()}
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return config


def batch(vocab: int, seq: int):
    import torch

    from megarl.batch import RolloutBatch

    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, vocab, (seq,), generator=g).tolist() for _ in range(ROWS)]
    masks = [[0.0] * (seq // 4) + [1.0] * (seq - seq // 4) for _ in range(ROWS)]
    return RolloutBatch.from_sequences(tokens, masks, behav_logprobs=[[-5.0] * seq] * ROWS,
                                       advantages=[1.0 if i % 2 else -1.0 for i in range(ROWS)],
                                       versions=[[0] * seq] * ROWS)


def trainer_config(resume: str | None):
    from megarl.trainer.config import TrainerConfig

    return TrainerConfig(params_dtype="bfloat16", micro_batch_size=MICRO, lr=1e-5, logprob_temperature=1.0,
                         resume_from=resume)


def child(mode: str, model_dir: str, run_dir: str, out_path: str, dry: bool) -> None:
    import torch

    from megarl.algorithms.config import AlgorithmConfig
    from megarl.trainer.local import LocalTrainer

    cuda = not dry
    assert cuda == torch.cuda.is_available(), f"CUDA available: {torch.cuda.is_available()}, dry run: {dry}"
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    seq = 32 if dry else SEQ
    b = batch(config["vocab_size"], seq)
    resume = os.path.join(run_dir, "checkpoints") if mode == "resume" else None
    trainer = LocalTrainer(trainer_config(resume), AlgorithmConfig(), model_dir, total_steps=2, run_dir=run_dir)
    out: dict = {}
    try:
        if mode == "train":
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            trainer.logprobs(b, 1.0)
            trainer.step(b)
            if cuda:
                torch.cuda.synchronize()
                out["peak_bytes"] = torch.cuda.max_memory_allocated()
                out["held_before_step_bytes"] = base
            trainer.progress = trainer.progress.__class__(step=1, consumed_samples=ROWS)
            out["saved"] = str(trainer.save())
            trainer.wait_saves()
        out["logprobs"] = trainer.logprobs(b, 1.0).float().cpu()
        out["step"] = trainer.step_count
    finally:
        trainer.close()
    torch.save(out, out_path)


def plan_trainer_bytes(model_dir: str) -> tuple[float, dict]:
    """The dry run's trainer figure for this shape: gpu_smoke's layout with this model and batch."""
    from megarl.config import load_config
    from megarl.config.memory import plan_for

    cfg = load_config(os.path.join(REPO, "configs", "gpu_smoke.yaml"),
                      [f"model.path={model_dir}", f"trainer.micro_batch_size={MICRO}",
                       "data.max_prompt_tokens=128", f"generator.max_new_tokens={SEQ - 128}",
                       f"generator.max_model_len={SEQ}"], scan_data=False)
    plan = plan_for(cfg)
    return plan.trainer_total, {k: round(v / 2**30, 3) for k, v in plan.trainer.items()}


def main() -> int:
    import torch

    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "scale"
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, run_dir = os.path.join(tmp, "model"), os.path.join(tmp, "run")
        os.makedirs(model_dir)
        os.makedirs(run_dir)
        config = write_model(model_dir, DRY_SHAPE if dry else SHAPE)
        for mode in ("train", "resume"):
            path = os.path.join(tmp, f"{mode}.pt")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if dry else None
            args = [sys.executable, __file__, "--child", mode, model_dir, run_dir, path] + (["--cpu-dry"] if dry else [])
            p = subprocess.run(args, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
            if p.returncode != 0:
                print(json.dumps({"trainer_scale": {"ok": False, "error": f"{mode} run failed: {p.stderr[-2000:]}"}}))
                return 1
            res[mode] = torch.load(path)
        params = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            os.path.join(model_dir, "model.safetensors")).values())
        out = {"params": params, "shape": {k: config[k] for k in SHAPE}, "seq": 32 if dry else SEQ, "rows": ROWS}
        if plant:
            res["resume"]["logprobs"] = res["resume"]["logprobs"] + 1e-3
        same = torch.equal(res["train"]["logprobs"], res["resume"]["logprobs"])
        out["resume_step"], out["resume_bitwise_equal"] = res["resume"]["step"], same
        ok = same and res["resume"]["step"] == 1
        if not dry:
            plan, parts = plan_trainer_bytes(model_dir)
            peak = res["train"]["peak_bytes"]
            out.update(peak_gb=round(peak / 2**30, 3), plan_gb=round(plan / 2**30, 3), plan_parts_gb=parts,
                       plan_over_peak=round(plan / peak, 3))
            ok &= plan >= peak
        out["ok"] = bool(ok)
    print(json.dumps({"trainer_scale": out}))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], "--cpu-dry" in sys.argv)
        sys.exit(0)
    sys.exit(main())
