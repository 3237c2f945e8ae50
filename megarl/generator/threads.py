"""CPU thread binding of the vLLM replicas: ``VLLM_CPU_OMP_THREADS_BIND`` per replica, from
``generator.threads_bind`` or an even split of the allowed cores (``auto``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from megarl.generator.config import GeneratorConfig


def threads_binds(cfg: GeneratorConfig, cpus: Sequence[int] | None = None) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each replica ('|' separates its TP ranks)."""
    if cfg.threads_bind != "auto":
        parts = cfg.threads_bind.split(";")
        if len(parts) == 1:
            parts = parts * cfg.replicas
        if len(parts) != cfg.replicas:
            raise ValueError(f"generator.threads_bind={cfg.threads_bind!r} names {len(parts)} replicas; "
                             f"give one binding or generator.replicas={cfg.replicas} separated by ';'")
        for p in parts:
            if len(p.split("|")) != cfg.tp:
                raise ValueError(f"generator.threads_bind entry {p!r} must have generator.tp={cfg.tp} "
                                 f"core lists separated by '|'")
        return parts
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    ranks = cfg.replicas * cfg.tp
    out, r = [], 0
    for _ in range(cfg.replicas):
        lists = []
        for _ in range(cfg.tp):
            if len(cpus) >= ranks:  # an even share per rank
                share = len(cpus) // ranks
                mine = cpus[r * share:(r + 1) * share]
            else:  # more ranks than cores: ranks share cores round-robin
                mine = [cpus[r % len(cpus)]]
            lists.append(_cpu_list(mine))
            r += 1
        out.append("|".join(lists))
    return out


def _cpu_list(cpus: Sequence[int]) -> str:
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)
