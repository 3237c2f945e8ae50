"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms, free head_dim, no bias) with
routed experts in the sparse layers (``decoder_sparse_step``, minus ``mlp_only_layers``, which keep
Qwen3's dense MLP) and no shared expert. Routing: softmax over all experts, top-k, renormalized over
the k when ``norm_topk_prob`` (``megarl.trainer.model`` maps that onto Megatron's router)."""

from megarl.models.families.spec import ATTN_NORM, DENSE_MLP, K_NORM, MOE_MLP, O_PROJ, Q_NORM, QKV, FamilySpec

ATTN = (ATTN_NORM, QKV, Q_NORM, K_NORM, O_PROJ)


def _problem(cfg) -> str | None:
    if cfg.get("attention_bias", False):
        return "attention_bias=true is not supported (Qwen3's attention has no bias in any verified layout)"
    if cfg.get("shared_expert_intermediate_size"):
        return (f"shared_expert_intermediate_size={cfg['shared_expert_intermediate_size']}: shared experts "
                f"(Qwen2-MoE) are not supported; only routed experts (Qwen3-MoE)")
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        return "num_experts is 0 or missing: a dense Qwen3 is model_type 'qwen3'"
    return None


SPEC = FamilySpec(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    hf_config_class="Qwen3MoeConfig",
    layer=(*ATTN, *DENSE_MLP),
    moe_layer=(*ATTN, *MOE_MLP),
    problem=_problem,
    # 4 experts, top-2, renormalized (as Qwen3-30B-A3B); every layer sparse unless a test adds mlp_only_layers
    tiny={"attention_bias": False, "use_sliding_window": False, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
)
