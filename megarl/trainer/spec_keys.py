"""One set of dist-checkpoint keys for both layer specs, so a checkpoint moves between them.

megatron-core's local spec writes its norm weights under the Transformer-Engine spec's fused names
(``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` ->
``mlp.linear_fc1.layer_norm_``), so the CPU trainer and a GPU trainer read each other's checkpoints. For
an MoE layer the second is wrong: TE keeps that layer's ``pre_mlp_layernorm`` apart (the experts have no
fc1 to fuse it into), so a local-spec MoE checkpoint did not load under TE, nor the other way. Here every
parameter's key is set to its TE name from our layouts (megarl/models/families/spec.py ``mcore_te``; the
same numbering as megatron's key), and on load a key the checkpoint lacks falls back to the one megatron
gave, which checkpoints written before this carry.
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^(decoder\.layers\.(?:\d+\.)?)(.*)$")
# What megatron's local spec renames (gpt_layer_specs.get_gpt_layer_local_spec's sharded_state_dict_keys_map):
# only these parameters' keys can differ from their TE names (experts and fused fc1 keep keys of their own).
_MAPPED_BY_MEGATRON = ("input_layernorm.", "pre_mlp_layernorm.")


def te_keys(model, sharded: dict, saved_keys: set | None = None) -> int:
    """Rename, in ``sharded`` (``model.sharded_state_dict()``, before the optimizer's is built from it), the
    key of every parameter whose key differs from its TE name. ``saved_keys``: the checkpoint's keys when
    loading (a rename is skipped when the checkpoint holds the old key and not the new). Returns how many
    keys were renamed."""
    from megatron.core import parallel_state as ps

    from megarl.models.layouts import local_param_layouts
    from megarl.trainer.model import unwrap

    m = unwrap(model)
    dims = m.megarl_dims
    args = (dims, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank())
    kw = dict(vocab_divisible_by=m.megarl_vocab_divisible_by)
    if dims.is_moe:
        kw.update(ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank())
    own = list(local_param_layouts(*args, norm_style=m.megarl_norm_style, **kw))
    te = list(local_param_layouts(*args, norm_style="te", **kw))
    renamed = 0
    for name, te_name in zip(own, te):
        entry = sharded.get(name)
        key = getattr(entry, "key", None)
        if key is None or not _LAYER.match(name) or not _LAYER.match(name).group(2).startswith(_MAPPED_BY_MEGATRON):
            continue
        want = _LAYER.match(key).group(1) + _LAYER.match(te_name).group(2)  # megatron's numbering, TE's name
        if key == want or (saved_keys is not None and want not in saved_keys and key in saved_keys):
            continue
        entry.key = want
        renamed += 1
    return renamed


__all__ = ["te_keys"]
