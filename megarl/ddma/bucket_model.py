"""The bucket model of the point-to-point transports, torch-free: how many messages a (sender, worker)
pair's bytes take. One place for the transports (``transport/buckets.py``), ``megarl plan-sync``
(``project.py``) and the simulator (``sim/workload.py``), so the cost model and the bench agree.

A pair's stream moves in messages of :func:`chunk_bytes` (half of ``sync.bucket_mb``: a rank keeps
:data:`IN_FLIGHT` rounds posted), so a pair of ``n`` bytes takes about ``ceil(n / chunk)`` messages
(the transport also cuts the stream where a parameter group of ``bucket_mb`` staging ends: at most one
more message per group). Each message costs the backend's per-message latency on top of its bytes.
"""

from __future__ import annotations

IN_FLIGHT = 2  # rounds a rank keeps posted: pack / land one while the previous one moves
DEFAULT_BUCKET_BYTES = 32 << 20  # sync.bucket_mb's default (megarl/ddma/config.py), in bytes


def chunk_bytes(bucket_bytes: int) -> int:
    """Bytes per message of a pair: the bucket split over the rounds a rank keeps in flight."""
    return max(1, bucket_bytes // IN_FLIGHT)


def pair_messages(nbytes: int, bucket_bytes: int) -> int:
    """Messages a pair of ``nbytes`` takes under the bucket schedule (the group cuts aside)."""
    return -(-nbytes // chunk_bytes(bucket_bytes))


__all__ = ["IN_FLIGHT", "DEFAULT_BUCKET_BYTES", "chunk_bytes", "pair_messages"]
