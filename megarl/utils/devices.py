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


def cuda_peer_access(pairs, timeout_s: float = 60.0) -> bool | None:
    """Whether every (trainer, generator) device-ordinal pair in ``pairs`` has CUDA peer access (a pair on
    one device needs none); None when it cannot be found out. Asked in a short-lived child process: the
    caller (the controller) must not hold a CUDA context of its own on a GPU the executors use."""
    import json
    import subprocess
    import sys

    pairs = sorted({(int(a), int(b)) for a, b in pairs if int(a) != int(b)})
    if not pairs:
        return True
    code = ("import json, sys, torch; pairs = json.loads(sys.argv[1]); "
            "print(json.dumps(all(torch.cuda.can_device_access_peer(a, b) for a, b in pairs)))")
    try:
        out = subprocess.run([sys.executable, "-c", code, json.dumps(pairs)], capture_output=True, text=True,
                             timeout=timeout_s)
        return bool(json.loads(out.stdout.strip().splitlines()[-1])) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


__all__ = ["cuda_peer_access", "cuda_visible"]
