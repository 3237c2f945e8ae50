"""The model families megarl trains and DDMA verifies, one spec each, and the check that refuses the rest.

A family is supported only when every path is proven on it: HF <-> Megatron conversion against
HF logits, a training step, and DDMA landing bit for bit against vLLM's own loader
(tests/e2e/test_ddma_landing.py). Adding one is a new ``<family>.py`` with a ``SPEC`` listed below, plus
its tests. Anything else is refused before a process starts, in one line naming the family and what
is supported. Pure Python (no torch import): config validation calls it.
"""

from __future__ import annotations

from collections.abc import Mapping

from megarl.models.families import llama, mistral, qwen2, qwen3, qwen3_moe
from megarl.models.families.spec import FamilySpec, LayerParam, RopeSpec, read_rope

FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in (llama.SPEC, qwen2.SPEC, qwen3.SPEC, mistral.SPEC,
                                                                 qwen3_moe.SPEC)}
# model_type -> the HF architecture class vLLM builds for it
VERIFIED_FAMILIES: dict[str, str] = {t: s.architecture for t, s in FAMILIES.items()}


def describe_supported() -> str:
    return ", ".join(f"{t} ({a})" for t, a in VERIFIED_FAMILIES.items())


def family_spec(model_type: str) -> FamilySpec:
    """The spec of a supported family; ValueError naming what is supported otherwise."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {describe_supported()}")
    return FAMILIES[model_type]


def architecture_problem(cfg: Mapping) -> str | None:
    """Why an HF ``config.json`` dict is outside what megarl verifies, in one line; None if inside.
    Never raises, whatever keys the config lacks."""
    family = cfg.get("model_type") if isinstance(cfg, Mapping) else None
    supported = f"supported: {describe_supported()}"
    if family not in FAMILIES:
        return f"model_type={family!r} is not supported; {supported}"
    problem = FAMILIES[family].config_problem(cfg)
    return f"{family} {problem}; {supported}" if problem else None


__all__ = ["FAMILIES", "VERIFIED_FAMILIES", "FamilySpec", "LayerParam", "RopeSpec", "architecture_problem",
           "describe_supported", "family_spec", "read_rope"]
