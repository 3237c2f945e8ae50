"""Llama (``LlamaForCausalLM``): SmolLM2, Llama 3.x with its ``llama3`` rope scaling."""

from megarl.models.families.spec import DENSE_ATTN, DENSE_MLP, FamilySpec


def _problem(cfg) -> str | None:
    if cfg.get("attention_bias", False):
        return "attention_bias=true is not supported (its o_proj bias is in no verified layout)"
    return None


SPEC = FamilySpec(
    model_type="llama",
    architecture="LlamaForCausalLM",
    hf_config_class="LlamaConfig",
    layer=(*DENSE_ATTN, *DENSE_MLP),
    rope_types=("default", "llama3"),
    problem=_problem,
    tiny={"attention_bias": False, "mlp_bias": False},
)
