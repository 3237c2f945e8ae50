"""Which GPUs a child process sees: the device ordinals of a plan, written as its CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
from typing import Mapping, Sequence


def cuda_visible(ordinals: Sequence[int], environ: Mapping[str, str] | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child process that is to use ``ordinals`` of the devices this process
    sees. A device plan's ids (``megarl.config.placement``) are ordinals among *visible* devices
    (``torch.cuda.device_count()`` counts under our own ``CUDA_VISIBLE_DEVICES``), so under
    ``CUDA_VISIBLE_DEVICES=4,5,6,7`` ordinal 0 is GPU 4: written as '0', the child would run on GPU 0,
    another job's. Entries are passed on as written (ids, or the GPU-/MIG- UUIDs Slurm and Kubernetes may
    set); unset or empty: the ordinals are the physical ids."""
    env = os.environ if environ is None else environ
    entries = [e.strip() for e in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if not entries:
        return ",".join(str(d) for d in ordinals)
    bad = [d for d in ordinals if not 0 <= d < len(entries)]
    if bad:
        raise ValueError(f"device ordinal(s) {bad} are not among the {len(entries)} device(s) this process sees "
                         f"(CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}); check cluster.trainer_devices / "
                         f"cluster.generator_devices")
    return ",".join(entries[d] for d in ordinals)


__all__ = ["cuda_visible"]
