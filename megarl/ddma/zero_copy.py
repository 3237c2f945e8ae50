"""Moved to :mod:`megarl.ddma.transport.zero_copy` (this name stays for existing callers)."""

from megarl.ddma.transport.zero_copy import allow_readers, copy_runs, map_shared, read_runs, share  # noqa: F401

__all__ = ["read_runs", "copy_runs", "share", "map_shared", "allow_readers"]
