"""Native (C++) helpers with pure-Python fallbacks.

`megarl._C` is built by `pip install --no-build-isolation -e .` (csrc/). When it is missing (the
build failed, or a source checkout never built it) every function here still works through its
Python reference, after one warning that says how to build the fast path.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from megarl.ddma.runs import RunsLike, as_run_tensor, merge_contiguous_runs_ref

try:
    from megarl import _C  # type: ignore[attr-defined]
except ImportError as error:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

HAS_NATIVE = _C is not None
_warned = False


def _warn_fallback_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"megarl._C (the C++ extension) is not available ({_IMPORT_ERROR}); using the slower "
            "pure-Python reference. Build it with `pip install --no-build-isolation -e .` "
            "from the repository root.",
            RuntimeWarning,
            stacklevel=3,
        )


def native_function(name: str) -> Callable | None:
    """``megarl._C.<name>``, or None when the extension is missing or was built without it."""
    return getattr(_C, name, None) if _C is not None else None


def merge_contiguous_runs(
    src_offsets: RunsLike, dst_offsets: RunsLike, lengths: RunsLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge consecutive copies contiguous in both source and destination (see ddma/runs.py)."""
    if _C is None:
        _warn_fallback_once()
        return merge_contiguous_runs_ref(src_offsets, dst_offsets, lengths)
    return _C.merge_contiguous_runs(
        as_run_tensor(src_offsets, "src_offsets"),
        as_run_tensor(dst_offsets, "dst_offsets"),
        as_run_tensor(lengths, "lengths"),
    )
