"""Build a megatron-core GPTModel from the ModelDims of a supported HF config (any family in
``megarl.models.families``: the flags it sets, qkv bias, qk-norm, rope scaling, are read here).

The model is built for the current rank of an already initialized model-parallel group
(``megarl.utils.dist.init_model_parallel``): TP/PP sizes and ranks come from ``parallel_state``.
Layer spec: Transformer-Engine when it imports (GPU), else the local megatron-core spec (CPU).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from megarl.models.layouts import ModelDims, padded_vocab_size, validate_parallel

log = logging.getLogger(__name__)

DEFAULT_VOCAB_DIVISIBLE_BY = 128


def read_hf_config(hf_dir: str | Path) -> dict:
    """The ``config.json`` of an HF model folder, as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --hf must be an HF model folder with config.json")
    return json.loads(path.read_text())


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _te  # noqa: F401
        return True
    except Exception:  # ImportError, or a CUDA library missing at import time
        return False


_said_spec = False


def _say_spec(kind: str) -> None:
    """Say once per process which layer spec ``auto`` picked, and on a GPU without Transformer Engine what
    that costs (it was picked silently; docs/memory.md counts the scores)."""
    global _said_spec
    if _said_spec:
        return
    _said_spec = True
    if kind == "local" and torch.cuda.is_available():
        log.warning("trainer: transformer-engine is not importable, so the model uses megatron-core's local layer "
                    "spec: unfused attention that stores its [batch, heads, seq, seq] scores for the backward pass "
                    "(the dry run's memory plan counts them; trainer.recompute=selective recomputes them instead). "
                    "The GPU stack (bash tools/setup_env.sh --gpu) has TE's fused attention.")
    else:
        log.info("trainer: layer spec %s (%s)", kind, "transformer-engine" if kind == "te" else "megatron-core local, CPU")


def layer_spec(dims: ModelDims, kind: str = "auto", config=None):
    """(ModuleSpec, norm_style): "te" spec fuses the norms into linear_qkv/linear_fc1. An MoE model
    gets megatron's block spec from ``config`` (its ``moe_layer_freq`` mixes sparse and dense layers),
    experts as a SequentialMLP of per-expert linears (``moe_grouped_gemm=False``)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if kind == "auto":
        kind = "te" if have_transformer_engine() else "local"
        _say_spec(kind)
    if dims.is_moe and kind in ("te", "local"):
        if config is None:
            raise ValueError("an MoE model's layer spec needs its TransformerConfig")
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=kind == "te",
                                                normalization="RMSNorm"), kind
    if kind == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=dims.qk_norm), "te"
    if kind == "local":
        return specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=dims.qk_norm), "local"
    raise ValueError(f"layer spec kind={kind!r}; expected 'auto', 'te' or 'local'")


def transformer_config(dims: ModelDims, tp: int, pp: int, params_dtype: torch.dtype = torch.float32,
                       **overrides: Any):
    """The TransformerConfig equivalent of the HF architecture (SwiGLU, RMSNorm, GQA, RoPE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    validate_parallel(dims, tp, pp)
    on_cpu = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,  # Qwen3: RMSNorm over head_dim on q and k, before rope
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        sequence_parallel=False,
        # variable sequence lengths between micro-batches under PP (see DESIGN.md)
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        # fused kernels are CUDA-only; keep the reference math everywhere for reproducibility
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
    )
    aux_loss_coeff = float(overrides.pop("moe_aux_loss_coeff", 0.0))
    if dims.is_moe:
        kwargs.update(moe_kwargs(dims, aux_loss_coeff))
    kwargs.update(recompute_kwargs(overrides.pop("recompute", "none")))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


RECOMPUTE_CHOICES = ("none", "selective", "full")


def recompute_kwargs(recompute: str) -> dict[str, Any]:
    """megatron-core's activation recompute for ``trainer.recompute``.

    - ``none``: every activation the backward needs is kept (``recompute_granularity=None``).
    - ``selective``: ``recompute_granularity="selective"``, ``recompute_modules=["core_attn"]``:
      megatron 0.16.1's Attention checkpoints its ``core_attention`` call (attention.py,
      ``checkpoint_core_attention``) whatever the layer spec, so the local (CPU) spec's
      DotProductAttention does not keep its [b, heads, s, s] scores / softmax; TE's fused attention
      keeps none to begin with (there it only recomputes a kernel). The other selective modules
      ("layernorm", "mlp", "moe", "moe_act" ...) are left off: "moe_act" needs grouped GEMM, which
      megarl does not use, and the layer input norms are small next to the scores.
    - ``full``: ``recompute_granularity="full"``, ``recompute_method="uniform"``,
      ``recompute_num_layers=1``: every transformer layer of the stage is checkpointed on its own,
      keeping only its input [s, b, h]; the backward reruns one layer's forward at a time.
    """
    if recompute == "none":
        return {}
    _cpu_checkpoint_rng()
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"recompute={recompute!r}; expected one of {', '.join(RECOMPUTE_CHOICES)}")


def _cpu_checkpoint_rng() -> None:
    """megatron's checkpoint (tensor_parallel.random.CheckpointFunction) saves and restores the CPU
    RNG state, the model-parallel tracker's states and the CUDA RNG state; the last raises on a torch
    without CUDA. Without CUDA there is no CUDA RNG to keep: its get/set become no-ops (idempotent;
    nothing changes where CUDA is available)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom, "_megarl_cpu_rng", False):
        return
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._megarl_cpu_rng = True


def moe_kwargs(dims: ModelDims, aux_loss_coeff: float = 0.0) -> dict[str, Any]:
    """The TransformerConfig of HF's routed experts. HF routes by softmax over all experts, top-k,
    then (``norm_topk_prob``) divides by the k probabilities' sum: the same as megatron's top-k of the
    logits then softmax over the k (``moe_router_pre_softmax=False``); without renormalization it is
    softmax then top-k (``pre_softmax=True``). The router runs in fp32 as HF's softmax does. No
    capacity factor (no token dropped, as HF), no aux loss unless asked (``trainer.moe_aux_loss_coeff``).
    Token dispatch: alltoall (set above for every family), the one that takes a different sequence
    length on every data-parallel / expert-parallel rank (allgather needs equal token counts across
    the EP group); on CPU megarl.compat gives it a host "stream" and gloo its all_to_all_single."""
    return dict(
        num_moe_experts=dims.num_experts,
        moe_router_topk=dims.moe_topk,
        moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_layer_freq=[1 if i in dims.moe_layers else 0 for i in range(dims.num_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not dims.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
    )


def build_gpt_model(dims: ModelDims, *, params_dtype: torch.dtype = torch.float32, spec: str = "auto",
                    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY, init_weights: bool = True,
                    **config_overrides: Any):
    """A GPTModel for this rank (pre/post-process from the PP stage). The returned module carries
    ``megarl_dims``, ``megarl_norm_style`` and ``megarl_vocab_divisible_by`` for the layout code.

    ``recompute`` (a ``config_overrides`` key): "none" | "selective" | "full", see
    :func:`recompute_kwargs` (``trainer.recompute``).

    ``init_weights=False`` skips megatron's random init (uninitialized memory) when every element
    is overwritten next, e.g. by ``load_hf_into_model`` (which also zeroes the vocab padding);
    random init of a large model on CPU takes minutes."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("model parallel is not initialized: call megarl.utils.dist.init_model_parallel first")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    config_overrides.setdefault("perform_initialization", init_weights)
    config = transformer_config(dims, tp, pp, params_dtype, **config_overrides)
    spec_module, norm_style = layer_spec(dims, spec, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec_module,
        vocab_size=padded_vocab_size(dims.vocab_size, tp, vocab_divisible_by),
        max_sequence_length=dims.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=dims.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=dims.rope_theta,
        parallel_output=True,
    )
    if dims.rope_scaling:
        apply_llama3_rope_scaling(model, dims)
    model.megarl_dims = dims
    model.megarl_norm_style = norm_style
    model.megarl_vocab_divisible_by = vocab_divisible_by
    return model


def apply_llama3_rope_scaling(model, dims: ModelDims) -> None:
    """Llama 3.x rope scaling with the config's own four values.

    megatron-core 0.16.1's ``RotaryEmbedding(rope_scaling=True, rope_scaling_factor=F)`` fixes
    ``low_freq_factor=1``, ``high_freq_factor=4`` and ``original_max_position_embeddings=8192``; its
    ``_apply_scaling`` takes all four (the formula of transformers' ``_compute_llama3_parameters``), so
    it is applied here once, on the unscaled frequencies, before any forward (``forward`` caches)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise RuntimeError("the model has no rotary_pos_emb to scale (position_embedding_type must be 'rope')")
    rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **dict(dims.rope_scaling))


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "megarl_dims"):
        model = model.module
    return model
