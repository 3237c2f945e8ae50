"""Native (C++) helpers with pure-Python fallbacks.

`megarl._C` is built by `pip install --no-build-isolation -e .` (csrc/). When it is missing (the
build failed, or a source checkout never built it) every function here still works through its
Python reference. This module only loads the extension; each caller keeps its own reference beside
it (``megarl/ddma/runs.py``, ``megarl/ddma/plan_native.py``, ``megarl/ddma/quantize.py``,
``megarl/ddma/verify.py``, ``megarl/ddma/zero_copy.py``), so nothing here imports upward.

Not silent: ``megarl train`` calls :func:`fallback_message` at start and logs it as ONE warning
(or, with ``sync.native=required``, stops with a config error); executor processes it starts
inherit ``MEGARL_NATIVE_ANNOUNCED=1`` and do not warn again. Outside ``megarl train`` (tools,
tests) the first fallback warns once per process (:func:`warn_fallback_once`).

``MEGARL_NO_NATIVE=1`` makes this process act as if the extension were not built (a debug and test
switch: the Python references then run everywhere).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

if os.environ.get("MEGARL_NO_NATIVE") == "1":
    _C = None
    _IMPORT_ERROR: ImportError | None = ImportError("MEGARL_NO_NATIVE=1 is set")
else:
    try:
        import torch  # noqa: F401 - loads libc10/libtorch, which the extension links against

        from megarl import _C  # type: ignore[attr-defined]
    except ImportError as error:  # not built, or built against another torch
        _C = None
        _IMPORT_ERROR = error
    else:
        _IMPORT_ERROR = None

HAS_NATIVE = _C is not None
ANNOUNCED_ENV = "MEGARL_NATIVE_ANNOUNCED"
BUILD_HINT = "`pip install --no-build-isolation --no-deps -e .` from the repository root"
# What runs in Python without the extension (each with the module holding its reference).
PYTHON_FALLBACKS = (
    "the DDMA planner (megarl/ddma/plan.py reference, ~20x slower at 405B)",
    "DDMA checksums (megarl/ddma/verify.py, torch ops over index tensors)",
    "the zero_copy transport's run copies (ctypes memmove / process_vm_readv, GIL held)",
    "contiguous-run merging (megarl/ddma/runs.py)",
    "FP8 quantization on CPU (megarl/ddma/quantize.py torch reference)",
)
_warned = False


def fallback_message() -> str | None:
    """The one start-up warning when the extension is missing (None when it is loaded)."""
    if HAS_NATIVE:
        return None
    return (f"megarl._C (the C++ extension) is not available ({_IMPORT_ERROR}); these run in Python "
            f"instead: {'; '.join(PYTHON_FALLBACKS)}. Build it with {BUILD_HINT}, or set "
            "sync.native=required to make this an error.")


def mark_announced() -> None:
    """The start-up warning was logged: this process and its children stay quiet about it."""
    global _warned
    _warned = True
    os.environ[ANNOUNCED_ENV] = "1"


def warn_fallback_once() -> None:
    """Warn, once per process, that a pure-Python reference stands in for the C++ extension
    (nothing when ``megarl train`` already said so at start)."""
    global _warned
    if not _warned and os.environ.get(ANNOUNCED_ENV) != "1":
        _warned = True
        warnings.warn(
            f"megarl._C (the C++ extension) is not available ({_IMPORT_ERROR}); using the slower "
            f"pure-Python reference. Build it with `pip install --no-build-isolation -e .` "
            "from the repository root.",
            RuntimeWarning,
            stacklevel=3,
        )
    _warned = True


_cuda_ok: dict[int, bool] = {}


def cuda_kernels_for(device) -> bool:
    """Whether the extension's CUDA kernels (csrc/cuda/) can run on CUDA ``device``: built for its
    generation (``megarl.cuda_archs.runs_on``). A GPU they were not built for (a V100 under the default
    archs, or a build that dropped one) gets the torch references instead, with one warning naming it and
    the rebuild; a kernel launched there would fail the sync with 'no kernel image is available'."""
    import torch

    from megarl.cuda_archs import ARCHS_ENV, runs_on

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _cuda_ok:
        archs = native_function("cuda_archs")
        built = archs() if archs is not None else ""
        capability = torch.cuda.get_device_capability(index)
        _cuda_ok[index] = not built or runs_on(capability, built)  # unknown build: as before, assume so
        if not _cuda_ok[index]:
            major, minor = capability
            warnings.warn(f"megarl._C's CUDA kernels were built for {built}; GPU {index} "
                          f"({torch.cuda.get_device_name(index)}, sm_{major}{minor}) can run none of them, so FP8 "
                          f"quantization and checksums there use the torch references (slower). Rebuild for it: "
                          f"{ARCHS_ENV}={major}.{minor} {BUILD_HINT}", RuntimeWarning, stacklevel=2)
    return _cuda_ok[index]


def native_function(name: str) -> Callable | None:
    """``megarl._C.<name>``, or None when the extension is missing or was built without it."""
    return getattr(_C, name, None) if _C is not None else None


__all__ = ["HAS_NATIVE", "PYTHON_FALLBACKS", "cuda_kernels_for", "fallback_message", "mark_announced",
           "warn_fallback_once", "native_function"]
