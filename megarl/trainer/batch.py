"""Moved to :mod:`megarl.batch` (below every role, so the role Protocols can name it); this name
stays only until controller/weight_sync.py and tests/test_weight_sync.py import it from there."""

from megarl.batch import RolloutBatch

__all__ = ["RolloutBatch"]
