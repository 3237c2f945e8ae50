"""HF folder <-> Megatron dist-checkpoint conversion, and loading HF/Megatron weights into a model.

On-disk format of a converted checkpoint (``hf_to_mcore``), loadable at any TP/PP:
- the megatron ``dist_checkpointing`` files of ``{"model": model.sharded_state_dict()}`` (the same
  key the training checkpoint uses for the model part, so a converted checkpoint is the model part
  of a training checkpoint and resharding on load comes from megatron);
- ``megarl_model.json``: the source HF ``config.json`` (``hf_config``), the TP/PP it was saved
  at, the params dtype, and the HF dtype to write back;
- ``hf_extra/``: tokenizer / generation-config / chat-template files copied from the HF folder,
  so ``mcore_to_hf`` can produce a complete HF folder again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from megarl.trainer.layouts import ModelDims, ParamLayout, hf_to_local, local_param_layouts, local_to_hf
from megarl.trainer.model import read_hf_config

log = logging.getLogger(__name__)

META_FILE = "megarl_model.json"
EXTRA_DIR = "hf_extra"
MODEL_KEY = "model"
_HF_EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_NOT_EXTRA = {"config.json", "model.safetensors.index.json"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# ModelDims field -> HF config key, to name the key in mismatch errors
_HF_KEY = {"family": "model_type", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size",
           "tie_word_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias"}


# ---------------------------------------------------------------- helpers on a built model

def model_layouts(model) -> dict[str, ParamLayout]:
    """The layouts of this rank's parameters of a model from ``build_gpt_model``."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    m = unwrap(model)
    return local_param_layouts(
        m.megarl_dims, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
        norm_style=m.megarl_norm_style, vocab_divisible_by=m.megarl_vocab_divisible_by)


def model_local_params(model) -> dict[str, torch.Tensor]:
    """name -> parameter tensor (the live storage) for every parameter in this rank's layouts.
    Raises if the model's parameters and the layouts disagree (a layout bug must fail loudly)."""
    from megarl.trainer.model import unwrap

    m = unwrap(model)
    layouts = model_layouts(m)
    params = {k: v for k, v in m.state_dict(keep_vars=True).items()
              if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}
    # PP=1 tied: output_layer.weight is absent or the embedding itself
    if "output_layer.weight" in params and "output_layer.weight" not in layouts:
        params.pop("output_layer.weight")
    if set(params) != set(layouts):
        raise RuntimeError(f"model parameters and layouts differ: only in model {sorted(set(params) - set(layouts))}, "
                           f"only in layouts {sorted(set(layouts) - set(params))}")
    for name, t in params.items():
        if tuple(t.shape) != layouts[name].local_shape:
            raise RuntimeError(f"{name}: model shape {tuple(t.shape)} != layout {layouts[name].local_shape}")
    return params


class HFReader:
    """Lazy reader of an HF folder's safetensors (one tensor at a time, full shape)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def names(self) -> list[str]:
        return sorted(self._where)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        return self._where[name].get_tensor(name)


@torch.no_grad()
def load_hf_into_model(model, hf_dir: str | Path) -> None:
    """Copy this rank's slices of an HF checkpoint into a built model (no Megatron checkpoint)."""
    from megarl.trainer.model import unwrap

    check_config_matches(unwrap(model).megarl_dims, read_hf_config(hf_dir), str(hf_dir))
    params = model_local_params(model)
    local = hf_to_local(HFReader(hf_dir), model_layouts(model))
    for name, t in local.items():
        params[name].data.copy_(t)


def check_config_matches(model_dims: ModelDims, hf_config: dict, source: str) -> None:
    """Raise ValueError listing every architecture field where the source and the model differ."""
    src = ModelDims.from_hf_config(hf_config)
    diffs = [f"{_HF_KEY.get(f.name, f.name)}: {source} has {getattr(src, f.name)!r}, "
             f"the model has {getattr(model_dims, f.name)!r}"
             for f in dataclasses.fields(ModelDims) if getattr(src, f.name) != getattr(model_dims, f.name)]
    if diffs:
        raise ValueError(f"checkpoint {source} does not match the model's config:\n  " + "\n  ".join(diffs))


# ---------------------------------------------------------------- Megatron checkpoints

def read_meta(mcore_dir: str | Path) -> dict:
    path = Path(mcore_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {mcore_dir} is not a checkpoint written by megarl "
                                f"(megarl convert hf-to-mcore)")
    return json.loads(path.read_text())


def save_model_checkpoint(model, out_dir: str | Path, hf_config: dict, hf_dtype: str | None = None,
                          extra_from: str | Path | None = None) -> None:
    """Collective: save the model part as a dist-checkpoint + metadata (all ranks call it)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = unwrap(model)
    from megarl.trainer.checkpoint import _in_process_write_queue

    _in_process_write_queue()  # same writer setup as training checkpoints (no Manager process)
    dist_checkpointing.save({MODEL_KEY: m.sharded_state_dict()}, str(out))
    if torch.distributed.get_rank() == 0:
        meta = {"format": "megarl-mcore-v1", "hf_config": hf_config,
                "saved_tp": ps.get_tensor_model_parallel_world_size(),
                "saved_pp": ps.get_pipeline_model_parallel_world_size(),
                "params_dtype": str(next(m.parameters()).dtype).removeprefix("torch."),
                "hf_dtype": hf_dtype, "norm_style": m.megarl_norm_style,
                "vocab_divisible_by": m.megarl_vocab_divisible_by}
        (out / META_FILE).write_text(json.dumps(meta, indent=1))
        if extra_from is not None:
            extra = out / EXTRA_DIR
            extra.mkdir(exist_ok=True)
            for f in Path(extra_from).iterdir():
                if f.is_file() and f.suffix in _HF_EXTRA_SUFFIXES and f.name not in _NOT_EXTRA:
                    shutil.copy2(f, extra / f.name)
    torch.distributed.barrier()


def load_model_checkpoint(model, mcore_dir: str | Path) -> dict:
    """Collective: load a megarl Megatron checkpoint (any saved TP/PP) into a built model; returns
    its metadata. Fails with the differing HF config keys when the architectures differ."""
    from megatron.core import dist_checkpointing

    from megarl.trainer.model import unwrap

    meta = read_meta(mcore_dir)
    m = unwrap(model)
    check_config_matches(m.megarl_dims, meta["hf_config"], str(mcore_dir))
    sharded = {MODEL_KEY: m.sharded_state_dict()}
    loaded = dist_checkpointing.load(sharded, str(mcore_dir))
    m.load_state_dict(loaded[MODEL_KEY], strict=True)
    model_local_params(m)  # re-check shapes after loading
    return meta


def load_pretrained(model, path: str | Path) -> str:
    """Load weights into a built model from either a megarl Megatron checkpoint (collective) or an
    HF folder (each rank reads its own slices). Returns "mcore" or "hf"."""
    p = Path(path)
    if (p / META_FILE).is_file():
        load_model_checkpoint(model, p)
        return "mcore"
    if (p / "config.json").is_file():
        load_hf_into_model(model, p)
        return "hf"
    raise FileNotFoundError(f"{p} is neither a megarl Megatron checkpoint ({META_FILE}) nor an HF folder "
                            f"(config.json)")


def _hf_dtype_name(hf_config: dict, reader: HFReader) -> str:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if name in _DTYPES:
        return name
    t = reader(reader.names()[0])
    return str(t.dtype).removeprefix("torch.")


def _hf_to_mcore_worker(rank: int, world_size: int, hf_dir: str, out_dir: str, tp: int, pp: int,
                        params_dtype: str, spec: str) -> None:
    from megarl.trainer.model import build_gpt_model
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp, pp, seed=0)
    hf_config = read_hf_config(hf_dir)
    model = build_gpt_model(ModelDims.from_hf_config(hf_config), params_dtype=_DTYPES[params_dtype], spec=spec,
                            init_weights=False)  # every element is written by load_hf_into_model
    load_hf_into_model(model, hf_dir)
    save_model_checkpoint(model, out_dir, hf_config, hf_dtype=_hf_dtype_name(hf_config, HFReader(hf_dir)),
                          extra_from=hf_dir)


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1,
                params_dtype: str = "float32", spec: str = "auto", timeout_s: float = 1800.0) -> Path:
    """Convert an HF Llama/Qwen2 folder to a Megatron dist-checkpoint written by ``tp*pp`` ranks.
    The checkpoint loads at any TP/PP (megatron reshards on load)."""
    from megarl.utils.dist import run_multiprocess

    from megarl.trainer.layouts import validate_parallel

    hf_config = read_hf_config(hf_dir)
    validate_parallel(ModelDims.from_hf_config(hf_config), tp, pp)  # fail before spawning
    if params_dtype not in _DTYPES:
        raise ValueError(f"params_dtype={params_dtype!r}; expected one of {sorted(_DTYPES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    log.info("hf_to_mcore: %s -> %s at tp=%d pp=%d", hf_dir, out, tp, pp)
    run_multiprocess(_hf_to_mcore_worker, tp * pp, str(hf_dir), str(out), tp, pp, params_dtype, spec,
                     timeout_s=timeout_s)
    return out


def _mcore_to_hf_worker(rank: int, world_size: int, mcore_dir: str, out_dir: str, dtype: str | None) -> None:
    from safetensors.torch import save_file

    from megarl.trainer.model import build_gpt_model
    from megarl.utils.dist import init_model_parallel

    meta = read_meta(mcore_dir)
    init_model_parallel(1, 1, seed=0)
    dims = ModelDims.from_hf_config(meta["hf_config"])
    model = build_gpt_model(dims, params_dtype=_DTYPES[meta["params_dtype"]],
                            vocab_divisible_by=meta.get("vocab_divisible_by", 128))
    load_model_checkpoint(model, mcore_dir)
    with torch.no_grad():
        tensors = local_to_hf([(model_layouts(model), model_local_params(model))], dims)
    out_dtype = _DTYPES[dtype or meta.get("hf_dtype") or meta["params_dtype"]]
    tensors = {k: v.detach().to(out_dtype).contiguous() for k, v in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    extra = Path(mcore_dir) / EXTRA_DIR
    if extra.is_dir():
        for f in extra.iterdir():
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(meta["hf_config"], indent=2))


def mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
                timeout_s: float = 1800.0) -> Path:
    """Convert a megarl Megatron checkpoint (any saved TP/PP) back to an HF folder: safetensors,
    config.json, and the tokenizer / generation config when the source had them. ``dtype``
    defaults to the dtype of the original HF checkpoint."""
    from megarl.utils.dist import run_multiprocess

    read_meta(mcore_dir)  # clear error before spawning
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {sorted(_DTYPES)}")
    run_multiprocess(_mcore_to_hf_worker, 1, str(mcore_dir), str(out_dir), dtype, timeout_s=timeout_s)
    return Path(out_dir)


def describe(mcore_dir: str | Path) -> dict[str, Any]:
    """The metadata of a converted checkpoint (for CLIs and logs)."""
    return read_meta(mcore_dir)
