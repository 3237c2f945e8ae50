"""Native (C++) helpers with pure-Python fallbacks.

`megarl._C` is built by `pip install --no-build-isolation -e .` (csrc/). When it is missing (the
build failed, or a source checkout never built it) every function here still works through its
Python reference, after one warning that says how to build the fast path. This module only loads
the extension; each caller keeps its own reference beside it (``megarl/ddma/runs.py``,
``megarl/ddma/plan_native.py``, ``megarl/ddma/quantize.py``), so nothing here imports upward.
"""

from __future__ import annotations

import warnings
from typing import Callable

try:
    from megarl import _C  # type: ignore[attr-defined]
except ImportError as error:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

HAS_NATIVE = _C is not None
_warned = False


def warn_fallback_once() -> None:
    """Warn, once per process, that a pure-Python reference stands in for the C++ extension."""
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
