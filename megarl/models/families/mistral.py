"""Mistral (``MistralForCausalLM``): Llama's layer; trains here only without a sliding window."""

from megarl.models.families.spec import DENSE_ATTN, DENSE_MLP, FamilySpec


def _problem(cfg) -> str | None:
    if cfg.get("llama_4_scaling"):
        return "llama_4_scaling is not supported (an attention scale by position the Megatron model lacks)"
    return None


SPEC = FamilySpec(
    model_type="mistral",
    architecture="MistralForCausalLM",
    hf_config_class="MistralConfig",
    layer=(*DENSE_ATTN, *DENSE_MLP),
    problem=_problem,
    tiny={"sliding_window": None},
)
