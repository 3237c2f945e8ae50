"""GPU check: megarl's own trainer on CUDA, then DDMA from its live parameters.

On a tiny Llama written here (config.json + model.safetensors; vocab 512, hidden 64, 2 layers),
each device runs megarl's ``LocalTrainer`` in its own process (``build_gpt_model``, DDP / Float16Module,
the Megatron optimizer, the schedules, ``compute_logprobs``; bf16 parameters with fp32 master
weights): the logprobs of a fixed batch, one optimizer step, the logprobs again. The CPU run has CUDA
hidden (megarl's CPU compat layer on). Compared, GPU against CPU:

- logprobs before and after the step within a bound derived from bf16: unit roundoff u = 2^-8; each
  of about 12 dependent operations per layer stack (norms, attention, MLP, lm_head) rounds its output
  to bf16 once (fp32 accumulation inside), so a logit errs by at most 12 * u relatively, and the
  log-softmax adds as much times |logprob|: |lp_gpu - lp_cpu| <= 2 * 12 * u * (1 + |lp|) ~ 0.094 *
  (1 + |lp|). The step (Adam, lr 1e-5) moves each weight by ~1e-5, far below that.
- the loss, within the same bound.
- the optimizer step itself, which the logprobs cannot see (a bf16 weight's ulp is ~1e-3 at the weights'
  scale, the step 1e-5: the bf16 weights do not change, and a no-op CUDA step passed the logprob bounds).
  So the fp32 master weights are read before and after the step (use_distributed_optimizer off:
  Float16OptimizerWithFloat16Params keeps them whole in fp32_from_float16_groups). Adam's first update
  is -lr * g / (|g| + eps) (m = g, v = g^2 after bias correction), so every weight whose gradient is
  not below eps (1e-8) moves by between lr/2 and lr. Required on the GPU: of the weights the CPU step
  moved by >= lr/2, at least 99% moved by >= lr/2 there too (a bf16 gradient can cancel to below eps
  where the CPU's did not: rare, hence the 1%), and none by more than lr (plus fp32 rounding of the
  weight: 2^-24 * |w| <= 2^-24 * 2 here). The fraction whose direction agrees with the CPU's is
  reported beside it.

Then, in the CUDA process, ``make_sender`` over the trainer's live parameters (the DDP buffers)
syncs into a cuda_ipc receiver in another process, checksums on; the receiver's landed tensors must
equal the plan executed on CPU from the trainer's own HF weights, bit for bit.

Prints one JSON line; exit 1 on failure. ``MEGARL_GPU_CHECK_PLANT=trainer`` perturbs the GPU logprobs
by 10x the bound, ``MEGARL_GPU_CHECK_PLANT=step`` undoes the GPU's update of the master weights (a no-op
step): the check must fail either way. ``--cpu-dry``: CPU against CPU, the four CUDA IPC calls on host
memory (control flow only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

U = 2.0 ** -8
DEPTH = 12
REL = 2 * DEPTH * U
LR = 1e-5       # the step's learning rate: far below REL, so the logprobs cannot see the step
MOVED_MIN = 0.99  # the step check's floor (module doc)
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=128, rope_theta=10000.0,
              torch_dtype="float32", hidden_act="silu")


def write_model(out: str) -> None:
    import torch
    from safetensors.torch import save_file

    from megarl.models.layouts import ModelDims, hf_tensor_shapes

    dims = ModelDims.from_hf_config(CONFIG)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in hf_tensor_shapes(dims).items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            tensors[name] = 0.2 * torch.randn(shape, generator=g)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f)


def _batch():
    import torch

    from megarl.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    lengths = [10, 7, 12, 9]
    tokens = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 4 + [1.0] * (n - 4) for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks, behav_logprobs=[[-5.0] * n for n in lengths],
                                       advantages=[1.0, -1.0, 1.0, -1.0], versions=[[0] * n for n in lengths])


def master_weights(optimizer):
    """The fp32 master copies of the bf16 parameters, concatenated on the CPU (megatron's
    Float16OptimizerWithFloat16Params, inside a ChainedOptimizer or not)."""
    import torch

    parts = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.fp32_from_float16_groups:
            parts += [p.detach().float().reshape(-1).cpu() for p in group]
    if not parts:
        raise RuntimeError(f"{type(optimizer).__name__} holds no fp32 master weights (bf16 parameters expected)")
    return torch.cat(parts)


def step_check(cpu_delta, gpu_delta) -> dict:
    """The optimizer step's figures (see the module doc): moved_frac must reach MOVED_MIN, overshoot 0."""
    moved_cpu = cpu_delta.abs() >= LR / 2
    moved_gpu = gpu_delta.abs() >= LR / 2
    n = max(int(moved_cpu.sum()), 1)
    return {"step_moved_by_cpu": int(moved_cpu.sum()),
            "step_moved_frac": float((moved_gpu & moved_cpu).sum()) / n,
            "step_overshoot": int((gpu_delta.abs() > LR * (1 + 1e-3) + 2 * 2.0 ** -24).sum()),
            "step_same_direction_frac": float(((gpu_delta.sign() == cpu_delta.sign()) & moved_cpu).sum()) / n}


def _receiver(spec, out_path, dry, q):
    try:
        import torch

        from megarl.ddma.layouts import DstRank
        from megarl.ddma.sync import DdmaReceiver

        if dry:
            from tools.gpu_ddma_ipc import _setup

            _setup(True)
        recv = DdmaReceiver(spec, DstRank(0, 0), device="cpu" if dry else "cuda")
        landed = {n: t.cpu().clone() for n, t in recv.receive(1)}
        torch.save(landed, out_path)
        q.put(("ok", recv.last_stats))
    except BaseException:  # noqa: BLE001
        q.put(("error", traceback.format_exc()))


def child(device: str, model_dir: str, out_path: str, dry: bool) -> None:
    import multiprocessing as mp

    import torch

    from megarl.algorithms.config import AlgorithmConfig
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.local import LocalTrainer

    assert (device == "cuda") == torch.cuda.is_available(), f"{device} run, CUDA available: {torch.cuda.is_available()}"
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainerConfig(params_dtype="bfloat16", micro_batch_size=4, lr=LR, logprob_temperature=1.0,
                        use_distributed_optimizer=False, grad_clip=0.0)  # the master weights whole, the update pure Adam
    trainer = LocalTrainer(cfg, AlgorithmConfig(), model_dir, total_steps=2, run_dir=os.path.dirname(out_path))
    out: dict = {}
    try:
        batch = _batch()
        out["before"] = trainer.logprobs(batch, 1.0).float().cpu()
        master_before = master_weights(trainer.objs.optimizer)
        metrics = trainer.step(batch)
        out["master_delta"] = master_weights(trainer.objs.optimizer) - master_before
        out["loss"] = float(metrics.get("loss", float("nan")))
        out["after"] = trainer.logprobs(batch, 1.0).float().cpu()
        out["param_device"] = str(next(trainer.model.parameters()).device)
        if device == "cuda" or dry:  # DDMA from the live parameters into a cuda_ipc receiver
            from megarl.ddma.layouts import GeneratorTopology
            from megarl.ddma.plan import execute_plan_ref, plan_sync
            from megarl.ddma.sync import SyncSpec, host_store
            from megarl.models.layouts import ModelDims, hf_to_local
            from megarl.trainer.ddma import make_sender

            if dry:
                from tools.gpu_ddma_ipc import _setup

                _setup(True)
            store = host_store()
            spec = SyncSpec(ModelDims.from_hf_config(CONFIG), trainer.topology(), GeneratorTopology(1, 1),
                            "127.0.0.1", store.port, transport="cuda_ipc", engine_dtype="bfloat16",
                            verify_every=1, timeout_s=120)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            landed_path = out_path + ".landed"
            p = ctx.Process(target=_receiver, args=(spec, landed_path, dry, q))
            p.start()
            out["sent"] = trainer_sync = make_sender(trainer.model, spec).sync(1)
            kind, detail = q.get(timeout=180)
            p.join(timeout=30)
            if kind != "ok":
                raise RuntimeError(f"receiver failed:\n{detail}")
            hf = {n: t.float().cpu() for n, t in trainer.hf_weights()}
            from megarl.ddma.layouts import source_rank_layouts

            plan = plan_sync(spec.dims, spec.src, spec.dst)
            src = {r: {n: t.to(torch.bfloat16).contiguous() for n, t in
                       hf_to_local(hf.__getitem__, source_rank_layouts(spec.dims, spec.src, r.tp, r.pp)).items()}
                   for r in spec.src.ranks()}
            want = {r: {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in plan.dst_shapes[r].items()}
                    for r in plan.dst_shapes}
            execute_plan_ref(plan, src, want)
            landed = torch.load(landed_path)
            (dst,) = want
            out["ddma_mismatch"] = [n for n, w in want[dst].items()
                                    if not torch.equal(landed[n].view(torch.int16), w.view(torch.int16))]
            out["ddma_params"] = len(want[dst])
            out["sender_transfer_s"] = trainer_sync["transfer_s"]
    finally:
        trainer.close()
    torch.save(out, out_path)


def main() -> int:
    import torch

    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT", "")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        os.makedirs(model_dir)
        write_model(model_dir)
        for dev in ("cpu", "cpu" if dry else "cuda"):
            path = os.path.join(tmp, f"{dev}-{len(res)}", "out.pt")
            os.makedirs(os.path.dirname(path))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if dev == "cpu" else None  # the compat layer on
            args = [sys.executable, __file__, "--child", dev, model_dir, path] + (["--cpu-dry"] if dry and res else [])
            p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
            if p.returncode != 0:
                print(json.dumps({"megarl_trainer": {"ok": False, "error": f"{dev} run failed: {p.stderr[-2000:]}"}}))
                return 1
            res[len(res)] = torch.load(path)
    cpu, gpu = res[0], res[1]
    if plant == "trainer":
        gpu["before"] = gpu["before"] + 10 * REL * (1 + gpu["before"].abs())
    if plant == "step":
        gpu["master_delta"] = torch.zeros_like(gpu["master_delta"])
    out, ok = {"bound_rel": REL, "gpu_param_device": gpu["param_device"]}, True
    mask = _batch().loss_mask.bool()
    for k in ("before", "after"):
        err = ((gpu[k] - cpu[k]).abs())[mask]
        allowed = REL * (1 + cpu[k].abs()[mask])
        out[f"logprobs_{k}_max_err"] = float(err.max())
        out[f"logprobs_{k}_worst_ratio"] = float((err / allowed).max())
        ok &= bool((err <= allowed).all())
    step = step_check(cpu["master_delta"], gpu["master_delta"])
    out.update(step)
    ok &= step["step_moved_by_cpu"] > 0 and step["step_moved_frac"] >= MOVED_MIN and step["step_overshoot"] == 0
    out["loss_cpu"], out["loss_gpu"] = cpu["loss"], gpu["loss"]
    ok &= abs(cpu["loss"] - gpu["loss"]) <= REL * (1 + abs(cpu["loss"]))
    ok &= dry or gpu["param_device"].startswith("cuda")
    out["ddma_params"], out["ddma_mismatch"] = gpu.get("ddma_params"), gpu.get("ddma_mismatch")
    ok &= bool(gpu.get("ddma_params")) and not gpu.get("ddma_mismatch")
    out["ok"] = bool(ok)
    print(json.dumps({"megarl_trainer": out}))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], "--cpu-dry" in sys.argv)
        sys.exit(0)
    sys.exit(main())
