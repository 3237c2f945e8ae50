"""GPU check 4: megatron-core (the carried 0.16.1 wheel; no Transformer Engine, local layer spec) on
the GPU against the CPU: a TP1 SGD step and the logprobs of a fixed batch, on a GPTModel this script
builds itself (fp32). It does not run megarl's trainer: not ``build_gpt_model``, DDP / Float16Module,
the Megatron optimizer, the schedules, ``token_logprobs`` or bf16 (issue 30: still to cover on a GPU).

Each device runs in its own process (the CPU one applies megarl's CPU compat layer, which must not
touch the GPU process): build the same 2-layer Llama-style GPTModel (float32, CPU initialization with
one seed, so both start from identical weights), take the target-token logprobs, one SGD step on
their negative mean, and the logprobs again. Compared:

- logprobs before and after the step, and the loss, within a float32 bound derived below;
- the updated weights within lr times that bound relative to the gradient.

Bound. Float32 unit roundoff u = 2^-24; TF32 is switched off (it would give 2^-11). A dot product of
length K has error <= K * u * sum|a_i b_i| in the worst case; our longest reductions are K = 512
(softmax over the vocab and lm_head over hidden 64; the MLP's 128). Through 2 layers (about 12
dependent reductions: attention, MLP, norms) the relative error of a logit is at most 12 * 512 * u
~ 3.7e-4, and a log-softmax adds at most that again times |logprob|. So
|lp_gpu - lp_cpu| <= 2 * 12 * 512 * u * (1 + |lp|), about 7.3e-4 * (1 + |lp|).

Prints one JSON line; exit 1 when over the bound. ``MEGARL_GPU_CHECK_PLANT=megatron`` perturbs
the GPU logprobs by 10x the bound (the check must fail). ``--cpu-dry``: CPU against CPU (control flow only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

U = 2.0 ** -24
K, DEPTH = 512, 12
REL = 2 * DEPTH * K * U
SEED, VOCAB, SEQ, BATCH, LR = 1234, 512, 16, 4, 1e-2


def _model(device: str):
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        params_dtype=torch.float32, use_cpu_initialization=True, sequence_parallel=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    return model.to(device)


def _logprobs(model, tokens, device):
    import torch

    position_ids = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, device=device), diagonal=1).bool()[None, None]  # True = masked
    logits = model(tokens, position_ids, attention_mask=causal)  # [b, s, vocab]
    lp = torch.log_softmax(logits.float()[:, :-1], dim=-1)
    return lp.gather(-1, tokens[:, 1:, None])[..., 0]


def child(device: str, out_path: str) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megarl.utils.dist import free_tcp_port, init_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_tcp_port()))
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=SEED)  # the CPU compat layer on CPU only; seeds every RNG
    model = _model(device)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED)).to(device)
    before = _logprobs(model, tokens, device)
    loss = -before.mean()
    loss.backward()
    with torch.no_grad():
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p -= LR * p.grad
    after = _logprobs(model, tokens, device).detach()
    torch.save({"before": before.detach().cpu(), "after": after.cpu(), "loss": float(loss), "grads": grads,
                "params": {n: p.detach().cpu() for n, p in model.named_parameters()}}, out_path)
    torch.distributed.destroy_process_group()


def main() -> int:
    import torch

    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "megatron"
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dev in ("cpu", "cpu" if dry else "cuda"):
            path = os.path.join(tmp, f"{dev}-{len(res)}.pt")
            # the CPU reference runs with CUDA hidden: megarl's CPU compat layer turns on only when CUDA is
            # unavailable, and with a visible GPU the child died on a device mismatch before comparing
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if dev == "cpu" else None
            p = subprocess.run([sys.executable, __file__, "--child", dev, path], capture_output=True, text=True,
                               timeout=300, env=env)
            if p.returncode != 0:
                print(json.dumps({"megatron_tp1": {"ok": False, "error": f"{dev} run failed: {p.stderr[-1500:]}"}}))
                return 1
            res[len(res)] = torch.load(path)
    cpu, gpu = res[0], res[1]
    if plant:
        gpu["before"] = gpu["before"] + 10 * REL * (1 + gpu["before"].abs())
    out, ok = {"bound_rel": REL}, True
    for k in ("before", "after"):
        err = (gpu[k] - cpu[k]).abs()
        allowed = REL * (1 + cpu[k].abs())
        out[f"logprobs_{k}_max_err"] = float(err.max())
        out[f"logprobs_{k}_worst_ratio"] = float((err / allowed).max())
        ok &= bool((err <= allowed).all())
    out["loss_cpu"], out["loss_gpu"] = cpu["loss"], gpu["loss"]
    ok &= abs(cpu["loss"] - gpu["loss"]) <= REL * (1 + abs(cpu["loss"]))
    # an SGD step moves each weight by lr * grad; its difference is bounded by lr * |grad error|, and
    # the gradient's relative error by the same reduction argument (backward doubles the depth)
    worst = 0.0
    for n, p in cpu["params"].items():
        allowed = LR * 2 * REL * (cpu["grads"][n].abs() + cpu["grads"][n].abs().max() * 1e-3) + 4 * U * p.abs()
        worst = max(worst, float(((gpu["params"][n] - p).abs() / allowed.clamp_min(1e-30)).max()))
    out["params_worst_ratio"] = worst
    ok &= worst <= 1.0
    out["ok"] = bool(ok)
    print(json.dumps({"megatron_tp1": out}))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
