"""The model families megarl trains and DDMA verifies, and the check that refuses the rest.

A family is supported only when every path is proven on it: HF <-> Megatron conversion against
HF logits, and DDMA landing bit for bit against vLLM's own loader (tests/test_ddma_landing.py:
tied and untied, KV heads below / equal to / above the generator's TP). Anything else is refused
before a process starts, with one line naming the family and what is supported. Pure Python (no
torch import): config validation calls it.
"""

from __future__ import annotations

from collections.abc import Mapping

# model_type -> the HF architecture class vLLM builds for it
VERIFIED_FAMILIES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def describe_supported() -> str:
    return ", ".join(f"{t} ({a})" for t, a in VERIFIED_FAMILIES.items())


def architecture_problem(cfg: Mapping) -> str | None:
    """Why an HF ``config.json`` dict is outside what megarl verifies, in one line; None if inside."""
    family = cfg.get("model_type")
    supported = f"supported: {describe_supported()}"
    if family not in VERIFIED_FAMILIES:
        return f"model_type={family!r} is not supported; {supported}"
    archs = cfg.get("architectures") or [VERIFIED_FAMILIES[family]]
    if list(archs) != [VERIFIED_FAMILIES[family]]:
        return f"{family} architectures={list(archs)} is not supported (only {VERIFIED_FAMILIES[family]}); {supported}"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"{family} hidden_act={cfg.get('hidden_act')!r} is not supported: only 'silu' (SwiGLU); {supported}"
    if cfg.get("mlp_bias", False):
        return f"{family} mlp_bias=true is not supported (the Megatron model has no MLP bias); {supported}"
    if family == "llama" and cfg.get("attention_bias", False):
        return (f"llama attention_bias=true is not supported (its o_proj bias is in no verified layout); "
                f"{supported}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        return f"{family} rope_type={rope_type!r} (rope scaling) is not supported, only 'default'; {supported}"
    if family == "qwen2" and cfg.get("use_sliding_window", False):
        return f"qwen2 use_sliding_window=true is not supported; {supported}"
    return None


__all__ = ["VERIFIED_FAMILIES", "architecture_problem", "describe_supported"]
