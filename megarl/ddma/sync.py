"""DDMA at run time: every trainer rank sends its shards straight to the generator workers that
need them, as :func:`megarl.ddma.plan.plan_sync` says; no rank gathers the model.

Both sides build the same plan from a small picklable :class:`SyncSpec` (model dims, the two
topologies, where the rendezvous store is), so no plan travels. Per sync (one ``version``):

- **Sender** (:class:`DdmaSender`, one per trainer rank): converts its shards to the wire dtype
  (the engine's dtype; or FP8 e4m3 with per-row scales for 2-D weights, halving bytes), computes
  the verification checksums of what each destination will land, and publishes them in the
  store; its transport (:mod:`megarl.ddma.transport`: ``zero_copy``, ``cuda_ipc``, ``gloo``,
  ``nccl``) then moves or exposes the bytes. Wire tensors stay where the parameters are (CUDA
  parameters give CUDA wire tensors; conversion buffers are allocated on that device, in buckets).
- **Receiver** (:class:`DdmaReceiver`, one per vLLM worker): :meth:`DdmaReceiver.stream` yields
  ``(vllm_param_name, staging)`` one parameter at a time in vLLM's local layout. Each staging tensor
  is its own: vLLM's layerwise reload keeps a layer's tensors until the whole layer has arrived
  (``online_process_loader`` in vllm/model_executor/model_loader/reload/layerwise.py buffers the
  loader's arguments), so a reused buffer would be overwritten before it is copied -- Qwen2's
  ``qkv_proj`` (weight, then bias, one layer) landed wrong that way. The engine reports each
  parameter as it landed (:meth:`DdmaReceiver.check_landed`, from inside the engine), and
  :meth:`DdmaReceiver.verify_landed` compares those checksums with the senders' and raises
  :class:`DdmaVerifyError` naming the tensor, the ranks and the byte range on a mismatch, or the
  parameters that never landed. :meth:`DdmaReceiver.receive` does all three for a receiver without
  an engine (the staging tensors are then what lands).

Rendezvous: a TCPStore (the controller hosts it: :func:`host_store`). The gloo and nccl groups are
built directly on that store, like vLLM's ``StatelessProcessGroup``, so neither the trainer's nor
vLLM's own world is touched. Group ranks: trainer ranks first (sorted ``SrcRank``), then generator
workers (sorted ``DstRank``). Checksums run where the data is (C++ on host tensors; on a device,
queued and read back once a side per sync: :class:`megarl.ddma.verify.DigestBatch`).

The sides live in their own modules: :mod:`megarl.ddma.sync_spec` (what both share), :mod:`megarl.ddma.sender`
and :mod:`megarl.ddma.receiver`; this module names them all.
"""

from __future__ import annotations

from megarl.ddma.receiver import DdmaReceiver
from megarl.ddma.sender import DdmaSender
from megarl.ddma.sync_spec import (WIRES, SyncSpec, _Side, host_store, skipped_params, verified_key,
                                   verified_workers, without)
from megarl.ddma.transport import TRANSPORTS
from megarl.ddma.transport.base import FP8, DdmaTransportError, gloo_group
from megarl.ddma.verify import DdmaVerifyError

__all__ = ["SyncSpec", "DdmaSender", "DdmaReceiver", "DdmaVerifyError", "DdmaTransportError", "host_store",
           "gloo_group", "TRANSPORTS", "WIRES", "FP8", "skipped_params", "verified_key", "verified_workers",
           "without", "_Side"]
