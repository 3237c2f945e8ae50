"""DDMA transports, one file each, behind one interface (:class:`megarl.ddma.transport.base.Transport`).

- ``zero_copy`` (:mod:`.zero_copy`): same host, host memory: workers copy their runs straight out of
  the trainers' shared memory.
- ``cuda_ipc`` (:mod:`.cuda_ipc`): same host, CUDA: workers open the trainers' exported CUDA IPC
  handles (one per bucket) and copy device to device.
- ``gloo`` (:mod:`.gloo`) and ``nccl`` (:mod:`.nccl`): any host, host memory / CUDA: the bucket schedule
  of :mod:`.buckets` (rounds of planned runs per pair under ``sync.bucket_mb``, two in flight) over a
  gloo / NCCL group of DDMA's own (nccl's code also runs over gloo on CPU, for the tests).

:func:`choose_transport` picks one (no torch import here: config validation uses it).
"""

from __future__ import annotations

from megarl.ddma.transport.choice import TRANSPORT_CHOICES, TRANSPORTS, choose_transport, transport_problem


def get_transport(name: str):
    """The transport class for ``name`` (one of :data:`TRANSPORTS`); imports torch."""
    if name == "zero_copy":
        from megarl.ddma.transport.zero_copy import ZeroCopyTransport as cls
    elif name == "cuda_ipc":
        from megarl.ddma.transport.cuda_ipc import CudaIpcTransport as cls
    elif name == "gloo":
        from megarl.ddma.transport.gloo import GlooTransport as cls
    elif name == "nccl":
        from megarl.ddma.transport.nccl import NcclTransport as cls
    else:
        raise ValueError(f"ddma transport {name!r}: choose one of {TRANSPORTS}")
    return cls


__all__ = ["TRANSPORTS", "TRANSPORT_CHOICES", "choose_transport", "transport_problem", "get_transport"]
