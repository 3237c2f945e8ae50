"""HF folder <-> Megatron dist-checkpoint conversion, and loading HF/Megatron weights into a model.

On-disk format of a converted checkpoint (``hf_to_mcore``), loadable at any TP/PP:
- the megatron ``dist_checkpointing`` files of ``{"model": model.sharded_state_dict()}`` (the same
  key the training checkpoint uses for the model part, so a converted checkpoint is the model part
  of a training checkpoint and resharding on load comes from megatron);
- ``megarl_model.json``: the source HF ``config.json`` (``hf_config``), the TP/PP it was saved
  at, the params dtype, and the HF dtype to write back;
- ``hf_extra/``: tokenizer / generation-config / chat-template files copied from the HF folder,
  so ``mcore_to_hf`` can produce a complete HF folder again.

``mcore_to_hf`` also exports training checkpoints (``megarl.trainer.checkpoint``: a step folder,
or a checkpoint dir and its ``latest``) written at any TP/PP/DP: their model part is the same
``{"model": ...}`` dist-checkpoint, loaded here at TP=1 PP=1 (megatron reshards), and their
``meta.json`` ``export`` entry plus ``hf_extra/`` give the HF config and tokenizer files
(``LocalTrainer.save`` stores them; for older checkpoints pass the HF folder the run trained from).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from megarl.trainer.checkpoint import (EXTRA_DIR, LATEST, CheckpointError, check_checkpoint, copy_hf_extra,
                                      load_checkpoint, resolve_checkpoint, use_in_process_write_queue)
from megarl.models.dims import HF_KEYS
from megarl.models.layouts import ModelDims, ParamLayout, hf_to_local, local_param_layouts, local_to_hf
from megarl.trainer.model import DEFAULT_VOCAB_DIVISIBLE_BY, read_hf_config
from megarl.trainer.spec_keys import te_keys

log = logging.getLogger(__name__)

META_FILE = "megarl_model.json"
MODEL_KEY = "model"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- helpers on a built model

def model_layouts(model) -> dict[str, ParamLayout]:
    """The layouts of this rank's parameters of a model from ``build_gpt_model``."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    m = unwrap(model)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep = ep_rank = None
    if m.megarl_dims.is_moe:
        ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        # the layouts split experts over TP as dense MLPs (expert TP = TP, Megatron's default)
        etp = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())
        if etp != (tp, tp_rank):
            raise RuntimeError(f"expert tensor parallel (size, rank) {etp} != tensor parallel {(tp, tp_rank)}: the "
                               f"layouts assume expert_tensor_parallel_size = tp")
    return local_param_layouts(
        m.megarl_dims, tp, tp_rank,
        ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
        norm_style=m.megarl_norm_style, vocab_divisible_by=m.megarl_vocab_divisible_by, ep=ep or 1,
        ep_rank=ep_rank or 0)


def model_local_params(model) -> dict[str, torch.Tensor]:
    """name -> parameter tensor (the live storage) for every parameter in this rank's layouts.
    Raises if the model's parameters and the layouts disagree (a layout bug must fail loudly)."""
    from megarl.trainer.model import unwrap

    m = unwrap(model)
    layouts = model_layouts(m)
    params = {k: v for k, v in m.state_dict(keep_vars=True).items()  # LoRA adapters: megarl.trainer.lora
              if not k.endswith("_extra_state") and isinstance(v, torch.Tensor) and not k.endswith((".lora_A", ".lora_B"))}
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
    diffs = [f"{HF_KEYS.get(f.name, f.name)}: {source} has {getattr(src, f.name)!r}, "
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
    use_in_process_write_queue()  # same writer setup as training checkpoints (no Manager process)
    sharded = m.sharded_state_dict()
    te_keys(m, sharded)  # the TE spec's keys under either spec (megarl/trainer/spec_keys.py)
    dist_checkpointing.save({MODEL_KEY: sharded}, str(out))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        if extra_from is not None:
            copy_hf_extra(extra_from, out / EXTRA_DIR)
        meta = {"format": "megarl-mcore-v1", "hf_config": hf_config,
                "saved_tp": ps.get_tensor_model_parallel_world_size(),
                "saved_pp": ps.get_pipeline_model_parallel_world_size(),
                "params_dtype": str(next(m.parameters()).dtype).removeprefix("torch."),
                "hf_dtype": hf_dtype, "norm_style": m.megarl_norm_style,
                "vocab_divisible_by": m.megarl_vocab_divisible_by,
                # every file and its size: a missing or truncated shard is a clear error
                "files": {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*"))
                          if f.is_file() and f.name != META_FILE}}
        (out / META_FILE).write_text(json.dumps(meta, indent=1))  # last: marks the folder complete
    torch.distributed.barrier()


def load_model_checkpoint(model, mcore_dir: str | Path) -> dict:
    """Collective: load a megarl Megatron checkpoint (any saved TP/PP) into a built model; returns
    its metadata. Fails with the differing HF config keys when the architectures differ."""
    from megatron.core import dist_checkpointing

    from megarl.trainer.model import unwrap

    meta = read_meta(mcore_dir)
    m = unwrap(model)
    check_config_matches(m.megarl_dims, meta["hf_config"], str(mcore_dir))
    model_sd = m.sharded_state_dict()
    te_keys(m, model_sd, set(dist_checkpointing.load_tensors_metadata(str(mcore_dir))))
    loaded = dist_checkpointing.load({MODEL_KEY: model_sd}, str(mcore_dir))
    m.load_state_dict(loaded[MODEL_KEY], strict=True)
    model_local_params(m)  # re-check shapes after loading
    return meta


def load_pretrained(model, path: str | Path) -> str:
    """Load weights into a built model from either a megarl Megatron checkpoint (collective) or an
    HF folder (each rank reads its own slices). Returns "mcore" or "hf"."""
    from megarl.trainer.model import unwrap

    p = Path(path)
    unwrap(model).megarl_source = str(p)  # the base a LoRA checkpoint names (megarl/trainer/lora_base.py lora_meta)
    if (p / META_FILE).is_file():
        load_model_checkpoint(model, p)
        return "mcore"
    if (p / "config.json").is_file():
        try:
            load_hf_into_model(model, p)
        except Exception as e:
            if type(e).__name__ != "SafetensorError":  # safetensors' own error names no file
                raise
            from safetensors import safe_open

            damaged = []  # which of the folder's files the reader refuses
            for f in sorted(p.glob("*.safetensors")):
                try:
                    with safe_open(str(f), framework="pt") as handle:
                        for name in handle.keys():
                            handle.get_slice(name)
                except Exception:
                    damaged.append(str(f))
            where = ", ".join(damaged) or f"a *.safetensors file in {p}"
            raise ValueError(f"cannot read the model weights {where}: {str(e).splitlines()[0]} (the file is damaged "
                             f"or cut short, e.g. an interrupted copy or download: copy or convert it again)") from None
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

    from megarl.models.layouts import validate_parallel

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


_WHAT_TO_PASS = ("pass a checkpoint written by `megarl convert hf-to-mcore`, a training step folder "
                 "(<run>/checkpoints/step_XXXXXXXX) or a run's checkpoints/ folder (its `latest` is used)")


def check_model_checkpoint(mcore_dir: str | Path) -> dict:
    """Validate a checkpoint written by ``hf_to_mcore`` without loading tensors; return its metadata.
    Raises CheckpointError naming a missing or truncated file."""
    p = Path(mcore_dir)
    try:
        meta = read_meta(p)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p / META_FILE} is corrupt ({e})") from None
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    for key in ("hf_config", "params_dtype"):
        if key not in meta:
            raise CheckpointError(f"{p / META_FILE} has no {key!r}: not a complete megarl model checkpoint")
    files = meta.get("files")
    if files is None:  # written before the manifest: at least megatron's own index must be there
        files = {"metadata.json": None}
        if not any(p.glob("*.distcp")):
            raise CheckpointError(f"checkpoint {p} is incomplete: no *.distcp shard files")
    for rel, size in files.items():
        f = p / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {p} is incomplete: missing file {rel}")
        if size is not None and f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {p} is damaged: {rel} has {f.stat().st_size} bytes, "
                                  f"expected {size}")
    return meta


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Starting weights a model can be built from (:func:`weights_source`): an HF folder, an ``hf_to_mcore``
    checkpoint or a training checkpoint, with the HF config of the model it holds and how to build it."""
    kind: str                 # "hf" | "model" | "train"
    path: Path                # the folder to load (a training checkpoint's step folder)
    hf_config: dict
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY

    def load_into(self, model) -> None:
        """Fill ``model`` (built from :attr:`hf_config` at any TP/PP) with these weights; collective on a
        Megatron checkpoint. A training checkpoint gives its model part only (no optimizer, no RNG)."""
        if self.kind == "train":
            load_checkpoint(self.path, model=[model], optimizer=None, load_rng=False)
        else:
            load_pretrained(model, self.path)


def weights_source(path: str | Path, hf_dir: str | Path | None = None) -> WeightsSource:
    """What ``path`` holds as starting weights: an HF folder (config.json), an ``hf_to_mcore`` checkpoint, or
    a training checkpoint (a step folder, a checkpoint dir's ``latest``, a run folder); ``hf_dir``: the HF
    folder a training checkpoint that does not record its config trained from. Raises CheckpointError
    saying what to pass."""
    p = Path(path)
    if (p / "config.json").is_file():
        return WeightsSource("hf", p, read_hf_config(p))
    kind, src = find_mcore_source(p)
    if kind == "model":
        meta = read_meta(src)
        return WeightsSource("model", src, meta["hf_config"],
                             meta.get("vocab_divisible_by", DEFAULT_VOCAB_DIVISIBLE_BY))
    meta = check_checkpoint(src)
    if meta.get("lora") is not None:  # its model part is adapters over a base it names: export it merged first
        raise CheckpointError(f"{src} is a LoRA training checkpoint: write it merged with `megarl convert mcore-to-hf "
                              f"{src} --out <folder>` and start from that folder")
    hf_config, _ = _train_export_sources(src, meta, hf_dir)
    export = meta.get("export") or {}
    return WeightsSource("train", src, hf_config, export.get("vocab_divisible_by") or DEFAULT_VOCAB_DIVISIBLE_BY)


def find_mcore_source(path: str | Path) -> tuple[str, Path]:
    """What ``--mcore`` names: ("model", dir) for an ``hf_to_mcore`` checkpoint, ("train", step
    folder) for a training checkpoint (a step folder, a checkpoint dir's ``latest``, or a run folder's
    ``checkpoints/``). Validates the files; raises CheckpointError saying what to pass."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: {_WHAT_TO_PASS}")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a checkpoint folder: {_WHAT_TO_PASS}")
    if (p / META_FILE).is_file():
        check_model_checkpoint(p)
        return "model", p
    if (p / "meta.json").is_file() or (p / LATEST).is_file():
        step = resolve_checkpoint(p)
        check_checkpoint(step)
        return "train", step
    if (p / "checkpoints").is_dir():  # a run folder
        if not (p / "checkpoints" / LATEST).is_file():
            raise CheckpointError(f"{p / 'checkpoints'} has no complete checkpoint yet (no `{LATEST}` file): "
                                  f"{_WHAT_TO_PASS}")
        return find_mcore_source(p / "checkpoints")
    steps = sorted(q.name for q in p.glob("step_*") if q.is_dir())
    if steps:
        raise CheckpointError(f"{p} has step folders {steps} but no `{LATEST}` file and none of them is "
                              f"complete (no meta.json): {_WHAT_TO_PASS}")
    if (p / "config.json").is_file():
        raise CheckpointError(f"{p} is an HF folder (config.json), not a Megatron checkpoint: {_WHAT_TO_PASS}")
    raise CheckpointError(f"{p} is not a megarl checkpoint (no {META_FILE}, meta.json or `{LATEST}`): "
                          f"{_WHAT_TO_PASS}")


def _run_model_dir(step_dir: Path) -> Path | None:
    """The HF folder a run trained from, read from <run>/config.yaml next to <run>/checkpoints/."""
    cfg_file = step_dir.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        return None
    try:
        import yaml

        path = ((yaml.safe_load(cfg_file.read_text()) or {}).get("model") or {}).get("path")
    except Exception:  # noqa: BLE001 - an unreadable run config just means "not found"
        return None
    if not path:
        return None
    if path == "builtin:smollm2":
        from megarl.models.smollm2 import ensure_smollm2_hf

        return Path(ensure_smollm2_hf())
    p = Path(path)
    return p if (p / "config.json").is_file() else None


def _check_dims(hf_config: dict, saved: dict, source: str, what: str) -> None:
    """The HF config must describe the saved model (meta.json `model` signature, hf.* keys)."""
    dims = ModelDims.from_hf_config(hf_config).as_json()
    diff = [f"{k}: {source} has {v!r}, the checkpoint has {saved[f'hf.{k}']!r}"
            for k, v in dims.items() if f"hf.{k}" in saved and saved[f"hf.{k}"] != v]
    if diff:
        raise CheckpointError(f"{what} {source} does not describe the checkpoint's model ({'; '.join(diff)}): "
                              f"pass the HF folder the run trained from")


def _train_export_sources(step_dir: Path, meta: dict, hf_dir: str | Path | None) -> tuple[dict, str | None]:
    """(HF config dict, folder of tokenizer files or None) for a training checkpoint."""
    export = meta.get("export") or {}
    if hf_dir is not None:
        hf_dir = Path(hf_dir)
        if not (hf_dir / "config.json").is_file():
            raise CheckpointError(f"--hf {hf_dir}: no config.json there; pass the HF model folder the run "
                                  f"trained from")
        cfg = read_hf_config(hf_dir)
        _check_dims(cfg, meta["model"], str(hf_dir), "--hf")
        return cfg, str(hf_dir)
    if export.get("hf_config"):
        extra = step_dir / EXTRA_DIR
        if not extra.is_dir():  # saved without the files: the source folder may still be there
            src = export.get("hf_source")
            extra = Path(src) if src and Path(src).is_dir() else None
        return export["hf_config"], str(extra) if extra is not None else None
    run_model = _run_model_dir(step_dir)
    if run_model is not None:
        cfg = read_hf_config(run_model)
        _check_dims(cfg, meta["model"], str(run_model), "the run's model.path")
        log.info("mcore_to_hf: %s has no HF config; using the run's model %s", step_dir, run_model)
        return cfg, str(run_model)
    raise CheckpointError(f"{step_dir} does not record its HF config (saved by an older megarl) and no "
                          f"<run>/config.yaml names the model: pass --hf <the HF model folder the run trained from>")


def _write_hf_folder(out: Path, tensors: dict[str, torch.Tensor], hf_config: dict, dtype: str,
                     extra_dir: str | None) -> None:
    from safetensors.torch import save_file

    out_dtype = _DTYPES[dtype]
    tensors = {k: v.detach().to(out_dtype).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if extra_dir is not None and Path(extra_dir).is_dir():
        copy_hf_extra(extra_dir, out)
    cfg = dict(hf_config)
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:  # the dtype the weights are written in
        cfg[k] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _model_to_hf_tensors(model, dims: ModelDims) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return local_to_hf([(model_layouts(model), model_local_params(model))], dims)


def _mcore_to_hf_worker(rank: int, world_size: int, mcore_dir: str, out_dir: str, dtype: str | None) -> None:
    from megarl.trainer.model import build_gpt_model
    from megarl.utils.dist import init_model_parallel

    meta = read_meta(mcore_dir)
    init_model_parallel(1, 1, seed=0)
    dims = ModelDims.from_hf_config(meta["hf_config"])
    model = build_gpt_model(dims, params_dtype=_DTYPES[meta["params_dtype"]],
                            vocab_divisible_by=meta.get("vocab_divisible_by", DEFAULT_VOCAB_DIVISIBLE_BY))
    load_model_checkpoint(model, mcore_dir)
    extra = Path(mcore_dir) / EXTRA_DIR
    _write_hf_folder(Path(out_dir), _model_to_hf_tensors(model, dims), meta["hf_config"],
                     dtype or meta.get("hf_dtype") or meta["params_dtype"], str(extra) if extra.is_dir() else None)


PEFT_PREFIX = "base_model.model."  # peft's PeftModel wraps the HF model as base_model (LoraModel) .model


def peft_adapters(model) -> dict[str, torch.Tensor]:
    """A LoRA model's adapters (one TP=1 rank) under peft's key names for the HF model:
    ``base_model.model.<HF module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], so that
    ``W_hf + lora_alpha/r * B A`` is the merged HF weight. A fused Megatron linear gives each HF projection
    its rows of B and the whole A (q/k/v share linear_qkv's A, gate/up share linear_fc1's): exact, since the
    fused delta is B A row by row. Row-parallel linears (o_proj, down_proj) map A's columns as W's."""
    from megarl.trainer.lora import lora_modules

    layouts, out = model_layouts(model), {}
    for name, mod in lora_modules(model).items():
        layout = layouts[f"{name}.weight"]
        a, b = mod.lora_A.detach(), mod.lora_B.detach()
        for p in layout.pieces:
            module = PEFT_PREFIX + p.hf_name.removesuffix(".weight")
            ka, kb = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
            if p.dim == 0:  # rows of W (column-parallel: q/k/v of qkv, gate/up of fc1): rows of B, all of A
                out.setdefault(ka, a.clone())
                out.setdefault(kb, torch.zeros(p.hf_shape[0], b.shape[1], dtype=b.dtype))
                out[kb].narrow(0, p.hf_start, p.length).copy_(b.narrow(0, p.local_start, p.length))
            else:  # columns of W (row-parallel input): columns of A, all of B
                out.setdefault(kb, b.clone())
                out.setdefault(ka, torch.zeros(a.shape[0], p.hf_shape[1], dtype=a.dtype))
                out[ka].narrow(1, p.hf_start, p.length).copy_(a.narrow(1, p.local_start, p.length))
    return out


def peft_config(lora: dict, adapters: dict[str, torch.Tensor]) -> dict:
    """peft's adapter_config.json for :func:`peft_adapters` (LoRA, no dropout, no bias, rslora off: the
    scale is lora_alpha / r as megarl's)."""
    targets = sorted({k.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for k in adapters if k.endswith("lora_A.weight")})
    base = lora.get("base") or {}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]),
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "revision": None,
            "base_model_name_or_path": base.get("path"), "megarl_base_sha256": base.get("sha256")}


def _train_to_hf_worker(rank: int, world_size: int, step_dir: str, out_dir: str, hf_config: dict,
                        extra_dir: str | None, dtype: str | None, adapters_only: bool = False) -> None:
    from megarl.trainer.model import build_gpt_model
    from megarl.utils.dist import init_model_parallel

    meta = check_checkpoint(step_dir)
    export = meta.get("export") or {}
    init_model_parallel(1, 1, seed=0)
    dims = ModelDims.from_hf_config(hf_config)
    params_dtype = meta["model"]["params_dtype"]
    # every element is filled from the checkpoint (vocab padding included): no random init
    model = build_gpt_model(dims, params_dtype=_DTYPES[params_dtype], init_weights=False,
                            vocab_divisible_by=export.get("vocab_divisible_by") or DEFAULT_VOCAB_DIVISIBLE_BY)
    lora = meta.get("lora")
    if lora is not None:  # adapters as saved (A, B resharded to TP=1 by the load below)
        from megarl.trainer.lora import apply_lora, lora_modules, merged_delta

        apply_lora(model, lora["rank"], lora["alpha"], lora["targets"])
    # weights only, resharded from the saved TP/PP to 1 x 1; the model signature is checked
    load_checkpoint(step_dir, model=[model], optimizer=None, load_rng=False)
    out, dtype = Path(out_dir), dtype or params_dtype
    if adapters_only:
        from safetensors.torch import save_file

        adapters = {k: v.to(_DTYPES[dtype]).contiguous() for k, v in peft_adapters(model).items()}
        out.mkdir(parents=True, exist_ok=True)
        save_file(adapters, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(peft_config(lora, adapters), indent=2))
        return
    if lora is not None:  # W + alpha/r B A, computed as the DDMA sender merges (fp32, then the weight's dtype)
        with torch.no_grad():
            for mod in lora_modules(model).values():
                mod.weight.copy_((mod.weight.float() + merged_delta(mod)).to(mod.weight.dtype))
    _write_hf_folder(out, _model_to_hf_tensors(model, dims), hf_config, dtype, extra_dir)


def mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
                timeout_s: float = 1800.0, hf_dir: str | Path | None = None, adapters_only: bool = False) -> Path:
    """Convert a megarl Megatron checkpoint back to an HF folder: safetensors, config.json, and the
    tokenizer / generation config when the source had them.

    ``mcore_dir``: a checkpoint from ``hf_to_mcore`` (any saved TP/PP; ``dtype`` defaults to the
    original HF checkpoint's), or a training checkpoint -- a step folder, a checkpoint dir (its
    ``latest``) or a run folder with ``checkpoints/`` -- saved at any TP/PP/DP (``dtype`` defaults
    to the trainer's params dtype, so the weights are written exactly). ``hf_dir`` supplies the HF
    config and tokenizer for a training checkpoint that does not record them. Invalid input raises
    CheckpointError before any process starts.

    A LoRA training checkpoint (trainer.lora_rank > 0) is written merged (``W + lora_alpha/r * B A``); with
    ``adapters_only`` its adapters alone in peft's format (adapter_config.json, adapter_model.safetensors,
    :func:`peft_adapters`), to load over the base its meta.json names."""
    from megarl.utils.dist import run_multiprocess

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {sorted(_DTYPES)}")
    kind, src = find_mcore_source(mcore_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: choose a new --out folder")
    if adapters_only and (kind == "model" or check_checkpoint(src).get("lora") is None):
        raise CheckpointError(f"{src} holds no LoRA adapters (not a training checkpoint with trainer.lora_rank > 0): "
                              f"drop --adapters-only to export its weights")
    if kind == "model":
        log.info("mcore_to_hf: model checkpoint %s -> %s", src, out)
        run_multiprocess(_mcore_to_hf_worker, 1, str(src), str(out), dtype, timeout_s=timeout_s)
    else:
        meta = check_checkpoint(src)
        hf_config, extra = _train_export_sources(src, meta, hf_dir)
        log.info("mcore_to_hf: training checkpoint %s (step %d, saved at %s) -> %s", src, meta["step"],
                 meta.get("parallel"), out)
        run_multiprocess(_train_to_hf_worker, 1, str(src), str(out), hf_config, extra, dtype, adapters_only,
                         timeout_s=timeout_s)
    return out


def describe(mcore_dir: str | Path) -> dict[str, Any]:
    """The metadata of a converted checkpoint (for CLIs and logs)."""
    return read_meta(mcore_dir)
