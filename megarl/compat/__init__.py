"""Compatibility layers for the pinned dependency stack (see DESIGN.md)."""

from megarl.compat.megatron_cpu import apply_cpu_compat

__all__ = ["apply_cpu_compat"]
