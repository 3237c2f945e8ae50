"""Qwen3 dense (``Qwen3ForCausalLM``): Qwen2 without the q/k/v biases, with q_norm / k_norm
(RMSNorm over head_dim, before rope), and head_dim free of hidden / heads."""

from megarl.models.families.spec import ATTN_NORM, DENSE_MLP, K_NORM, O_PROJ, Q_NORM, QKV, FamilySpec


def _problem(cfg) -> str | None:
    if cfg.get("attention_bias", False):
        return "attention_bias=true is not supported (Qwen3's attention has no bias in any verified layout)"
    return None


SPEC = FamilySpec(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    hf_config_class="Qwen3Config",
    layer=(ATTN_NORM, QKV, Q_NORM, K_NORM, O_PROJ, *DENSE_MLP),
    problem=_problem,
    tiny={"attention_bias": False, "use_sliding_window": False},
)
