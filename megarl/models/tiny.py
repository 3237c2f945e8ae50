"""Tiny random HF checkpoints for tests: real architectures, real tokenizer, seconds to build.

They load offline in transformers and vLLM like any HF folder, one for every family in
``megarl.models.families`` (its spec names the transformers config class and the extra arguments).
Every parameter is random, norms included (around 1, Qwen3's q_norm / k_norm too) and Qwen2's q/k/v
biases non-zero, Qwen3-MoE's router and every expert random, so a layout bug in any conversion (a swapped norm, a mis-sliced bias, a transposed
projection) changes the logits visibly. ``rope_scaling`` gives a Llama 3.x-style ``llama3`` rope.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from megarl.models.families import FAMILIES as _SPECS
from megarl.models.gguf_to_hf import torch_dtype_from_name, write_generation_config
from megarl.models.smollm2 import ensure_smollm2_tokenizer

FAMILIES = tuple(_SPECS)
# Llama 3.2's rope scaling (factor 32, low 1, high 4) with original_max_position_embeddings 64 instead
# of 8192: at a tiny test's 10-60 positions the scaled low frequencies then rotate visibly (at 8192
# they would not, and a missed scaling could not change the logits).
LLAMA32_TINY_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}

# SmolLM2's tokenizer: the vocabulary and special tokens every tiny model shares.
SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_BOS_ID = 1  # <|im_start|>
SMOLLM2_EOS_ID = 2  # <|im_end|>

# Large enough that logits spread over the vocabulary (std ~ init_std * sqrt(hidden)), small enough
# that activations stay well inside bf16 range.
DEFAULT_INIT_STD = 0.1
NORM_WEIGHT_JITTER = 0.1


def _build_config(
    family: str,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    rope_scaling: dict | None = None,
    extra_config: dict | None = None,
):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: choose one of {FAMILIES}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA groups)"
        )
    if head_dim < 32:
        # vLLM's CPU attention rejects small head dims ("Unsupported CPU attention configuration").
        raise ValueError(f"head_dim={head_dim} is too small for vLLM's CPU attention: use >= 32")
    common = dict(
        vocab_size=SMOLLM2_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": 10000.0},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=SMOLLM2_BOS_ID,
        eos_token_id=SMOLLM2_EOS_ID,
        pad_token_id=SMOLLM2_EOS_ID,
        initializer_range=DEFAULT_INIT_STD,
    )
    spec = _SPECS[family]
    return getattr(transformers, spec.hf_config_class)(**{**spec.tiny, **(extra_config or {})}, **common)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Fill every parameter from our own generator, so the result depends only on `seed`."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # tied weights appear once
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + NORM_WEIGHT_JITTER * noise)
        else:
            param.copy_(init_std * noise)


def make_tiny_hf_checkpoint(
    out_dir: str | os.PathLike,
    family: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = DEFAULT_INIT_STD,
    max_position_embeddings: int = 2048,
    rope_scaling: dict | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a random `family` checkpoint with the SmolLM2 tokenizer into `out_dir`; return it.

    ``extra_config`` overrides the family's tiny HF config arguments (e.g. ``mlp_only_layers`` for a
    Qwen3-MoE with a dense layer). Deterministic: the same arguments give bit-identical weights.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = torch_dtype_from_name(dtype)
    config = _build_config(
        family,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        extra_config=extra_config,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, init_std)
    model.to(torch_dtype)
    model.config.dtype = torch_dtype

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_generation_config(model.config, out)
    tokenizer_dir = ensure_smollm2_tokenizer()
    for item in tokenizer_dir.iterdir():
        shutil.copy2(item, out / item.name)
    return out
