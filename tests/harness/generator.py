"""Generator test machinery: transformers references, the bf16 bounds and a base GeneratorConfig."""

from __future__ import annotations

import os

import torch

from megarl.generator.config import GeneratorConfig


# Where the bf16 bounds come from. bf16 keeps 8 significant bits, so a bf16 forward pass differs
# from the fp32 one by rounding noise whose size depends on the model, the weights and the tokens,
# and its kernels are chosen by the CPU (vLLM's CPU attention runs an AMX kernel whenever the CPU
# has AMX, else AVX-512/AVX2 vector kernels; oneDNN picks the GEMM ISA). So no constant holds
# everywhere: each test measures the reference's own noise on the very tokens it checks --
# transformers in bf16 against transformers in fp32 -- and allows the engine, another bf16
# implementation with its roundings in other places, BF16_NOISE_FACTOR times that deviation from the
# fp32 reference. Measured on an AVX-512 (no AMX) CPU: engine-vs-fp32 was 0.5-1.0x the reference's
# own noise (0.02-0.1 nats); an AMX CPU's engine was 0.062 off transformers-bf16, i.e. <= 2x. A
# wrong layout, temperature or stale weight is off by more than 0.5 nats (asserted where it matters).
BF16_NOISE_FACTOR = 3


# Floor for the bound: one bf16 ulp at logprob scale 1 (2^-7), so a token run whose noise happens
# to be tiny does not demand more than bf16 can represent.
BF16_FLOOR = 2.0**-7


# ------------------------------------------------------------------ transformers references
def hf_model(model_dir, state_dict=None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if state_dict is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=False)
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, prompt, completion, temperature=1.0) -> torch.Tensor:
    """Teacher-forced log_softmax(logits / T) of each completion token (float32)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def bf16_noise(model_dir, state_dict, seqs, temperature=1.0) -> float:
    """The reference's own bf16 noise: max |transformers bf16 - transformers fp32| logprob over the
    completion tokens of ``seqs`` ((prompt, completion) pairs)."""
    ref, ref16 = hf_model(model_dir, state_dict), hf_model(model_dir, state_dict, dtype=torch.bfloat16)
    return max(float((hf_logprobs(ref16, p, c, temperature) - hf_logprobs(ref, p, c, temperature)).abs().max())
               for p, c in seqs)


def perturbed(model_dir, seed, scale=0.5):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.float().std() * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def base_cfg(**kw) -> GeneratorConfig:
    c = dict(temperature=0.0, n_samples=1, max_new_tokens=16, max_model_len=256, kv_cache_gib=1,
             start_timeout_s=300, request_timeout_s=120, update_timeout_s=120, shutdown_timeout_s=20)
    c.update(kw)
    return GeneratorConfig(**c)


def lp_err(model, sample, start=0, stop=None, temperature=1.0) -> float:
    """Largest |behav_logprob - transformers logprob| over the completion tokens [start, stop)."""
    prefix = sample.prompt_ids + sample.completion_ids[:start]
    ref = hf_logprobs(model, prefix, sample.completion_ids[start:stop], temperature)
    return float((torch.tensor(sample.behav_logprobs[start:stop]) - ref).abs().max())
