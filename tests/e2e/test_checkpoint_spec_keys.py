"""A checkpoint moves between the Transformer-Engine and the local layer spec: both read and write every
parameter under its TE-spec key (megarl/trainer/spec_keys.py). megatron-core's local spec already renames
its norms to TE's fused names, but also an MoE layer's pre-MLP norm, which TE keeps apart: a local-spec MoE
checkpoint did not load under TE. Checked against megatron's real ``sharded_state_dict`` of the local spec
(TE cannot be imported on this machine) and our TE layouts (megarl/models/families/spec.py ``mcore_te``),
dense and MoE; and checkpoints written before (megatron's keys) still load."""

from __future__ import annotations

import re

import pytest

from megarl.utils.dist import run_multiprocess


def _unnumbered(name: str) -> str:
    return re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", name)


def _worker(rank: int, world: int, hf_dir: str, out: str) -> dict:
    import shutil

    import torch
    from megatron.core import dist_checkpointing

    from megarl.models.layouts import ModelDims, local_param_layouts
    from megarl.trainer.convert import META_FILE, MODEL_KEY, load_model_checkpoint, save_model_checkpoint
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.spec_keys import te_keys
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=0)
    hf = read_hf_config(hf_dir)
    dims = ModelDims.from_hf_config(hf)
    model = build_gpt_model(dims, spec="local")
    megatron_keys = {k: v.key for k, v in model.sharded_state_dict().items() if hasattr(v, "key")}
    sharded = model.sharded_state_dict()
    renamed = te_keys(model, sharded)
    keys = {k: v.key for k, v in sharded.items() if hasattr(v, "key")}
    local = list(local_param_layouts(dims, 1, 0, 1, 0, norm_style="local"))
    te = list(local_param_layouts(dims, 1, 0, 1, 0, norm_style="te"))
    # a round trip through our writer, and a checkpoint as megatron keyed it before (no te_keys)
    save_model_checkpoint(model, f"{out}/new", hf)
    save_model_checkpoint(model, f"{out}/old", hf)  # only for its metadata file
    __import__("os").makedirs(f"{out}/old_raw")
    dist_checkpointing.save({MODEL_KEY: model.sharded_state_dict()}, f"{out}/old_raw")
    loads = {}
    for name in ("new", "old_raw"):
        fresh = build_gpt_model(dims, spec="local", init_weights=False)
        if name == "old_raw":  # our metadata beside megatron's own files
            shutil.copy(f"{out}/old/{META_FILE}", f"{out}/old_raw/{META_FILE}")
        load_model_checkpoint(fresh, f"{out}/{name}")
        loads[name] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
                          if isinstance(a, torch.Tensor))
    return {"keys": keys, "megatron": megatron_keys, "renamed": renamed, "local": local, "te": te, "loads": loads}


@pytest.mark.parametrize("family, renames", [("tiny_llama_dir", 0), ("tiny_qwen3_moe_dir", "per MoE layer")])
def test_every_parameter_is_written_under_its_te_name_and_loads_back(family, renames, request, tmp_path):
    got = run_multiprocess(_worker, 1, str(request.getfixturevalue(family)), str(tmp_path))[0]
    assert len(got["local"]) == len(got["te"])
    for local_name, te_name in zip(got["local"], got["te"]):  # the same parameter, in the same order
        if local_name in got["keys"] and ".experts." not in local_name:  # experts: keys with an expert axis
            assert got["keys"][local_name] in (te_name, _unnumbered(te_name)), (local_name, got["keys"][local_name])
    moe_norms = [k for k, v in got["megatron"].items() if k.endswith("pre_mlp_layernorm.weight")
                 and v.endswith("mlp.linear_fc1.layer_norm_weight") and got["keys"][k] != v]
    if renames == 0:
        assert got["renamed"] == 0 and not moe_norms  # a dense model: megatron's keys were TE's already
    else:
        assert got["renamed"] == len(moe_norms) > 0, got["renamed"]  # exactly the MoE layers' pre-MLP norms
    assert got["loads"] == {"new": True, "old_raw": True}, got["loads"]
