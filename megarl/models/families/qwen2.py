"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's layer plus q/k/v biases."""

from megarl.models.families.spec import ATTN_NORM, DENSE_MLP, O_PROJ, QKV, QKV_BIAS, FamilySpec

SPEC = FamilySpec(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    hf_config_class="Qwen2Config",
    layer=(ATTN_NORM, QKV, QKV_BIAS, O_PROJ, *DENSE_MLP),
    tiny={"use_sliding_window": False},
)
