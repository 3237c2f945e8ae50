"""What a vLLM engine's parameters hold once an update has landed, seen from inside the engine.

A check of a weight update proves nothing unless it looks at what the engine computes with. On
CPU, vLLM packs every linear weight into a kernel (oneDNN) after loading and leaves an empty
parameter behind, so the engine's weights cannot be read back afterwards. :func:`watch_landing`
therefore reports each parameter at the last moment it is readable: when its layer's weights have
all been loaded into it and vLLM is about to process them (``quant_method.process_weights_after_loading``:
re-quantize FP8, pack for the CPU kernels), and, for layers vLLM does not process (norms), once
the reload is over. A layer whose update never arrived is never reported.

Both the DDMA receiver's checksums (``ddma_source.py``) and the landing tests (which capture every
parameter after a DDMA sync and after vLLM's own loader read the same HF checkpoint, and compare
them bit for bit) use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

OnParam = Callable[[str, torch.Tensor], None]
_HOOK = "process_weights_after_loading"
_ABSENT = object()


@contextlib.contextmanager
def watch_landing(model: torch.nn.Module, on_param: OnParam) -> Iterator[None]:
    """Within this context, ``on_param(vllm_param_name, tensor)`` is called for every parameter
    of ``model`` that an update lands (``tensor`` is only valid during the call: copy it to keep it)."""
    names = {id(m): prefix for prefix, m in model.named_modules()}

    def report(layer: torch.nn.Module) -> None:
        prefix = names.get(id(layer))
        if prefix is None:
            return
        for pname, p in layer.named_parameters(recurse=False):
            on_param(f"{prefix}.{pname}" if prefix else pname, p.detach())

    hooked: list[tuple[object, object]] = []  # (quant_method, what its instance attribute was)
    seen: set[int] = set()
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if qm is None or id(qm) in seen or not callable(getattr(qm, _HOOK, None)):
            continue
        seen.add(id(qm))
        before = qm.__dict__.get(_HOOK, _ABSENT)
        original = getattr(qm, _HOOK)

        def hook(layer, *args, _original=original, **kwargs):
            report(layer)  # loaded, not yet re-quantized or packed
            return _original(layer, *args, **kwargs)

        qm.__dict__[_HOOK] = hook  # an instance attribute shadows the class's method
        hooked.append((qm, before))
    try:
        yield
        for m in model.modules():  # layers vLLM does not process keep their parameters as loaded
            if getattr(m, "quant_method", None) is None:
                report(m)
    finally:
        for qm, before in reversed(hooked):
            if before is _ABSENT:
                qm.__dict__.pop(_HOOK, None)
            else:
                qm.__dict__[_HOOK] = before


__all__ = ["watch_landing", "OnParam"]
