"""cuda_ipc publishes per bucket, not per tensor (issue 46): a trainer rank's sync exports one IPC handle per
storage its wire lives in, for each worker that reads it (the conversion buckets of ``sync.bucket_bytes``;
same-dtype wire tensors are views of the trainer's parameters, one handle per parameter storage, so one
per DDP buffer), waits for its conversions once per sync (one synchronize, not one per tensor), and sends its
digests as one store value per sync. Counted in one process with HostIpcDouble, the GPU-boundary double for
CudaIpcOps (tests/harness/ddma.py; its signatures are checked in tests/e2e/test_cuda_api_drift.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology, source_rank_layouts
from megarl.ddma.sync import DdmaSender, SyncSpec, host_store
from megarl.ddma.transport import cuda_ipc
from megarl.ddma.transport.base import plan_buckets
from megarl.models.layouts import hf_to_local
from tests.harness.ddma import HostIpcDouble, _dims, _hf

BUCKET = 64 << 10  # small buckets, so the rank's conversions fill several


def _sender(monkeypatch, trainer_dtype, wire, params=None):
    monkeypatch.setattr(cuda_ipc, "IPC_OPS", HostIpcDouble())
    monkeypatch.setattr(HostIpcDouble, "synchronized", [])
    dims = _dims("llama_kv2_tied")
    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 2), "127.0.0.1", store.port,
                    transport="cuda_ipc", wire=wire, bucket_bytes=BUCKET)  # two TP1 replicas read everything
    if params is None:
        params = hf_to_local(_hf(dims, 1, trainer_dtype).__getitem__, source_rank_layouts(dims, spec.src, 0, 0))
    return DdmaSender(spec, SrcRank(0, 0, 0), params), store


def _publish(sender):
    wire, scales, _ = sender._wire_tensors()
    return sender.transport.publish(wire, scales)


@pytest.mark.parametrize("trainer_dtype,wire", [(torch.float32, "engine"), (torch.float32, "fp8")])
def test_converted_wire_is_one_handle_per_bucket_per_reading_worker(monkeypatch, trainer_dtype, wire):
    sender, _ = _sender(monkeypatch, trainer_dtype, wire)
    convs = sender._conversions()
    # the rank's buckets, as DdmaSender._buffers cuts them (plan_buckets over the conversions' bytes)
    buckets = plan_buckets([n * dt.itemsize for _, n, dt in convs], BUCKET)
    assert 1 < len(buckets) < len(convs)  # several buckets, each holding several wire tensors
    table = _publish(sender)
    # every wire tensor is converted (fp32 -> bf16, or fp8 codes + scales): all of them sit in the buckets
    assert len(table["ipc"]["where"]) == len(convs)
    assert len(table["ipc"]["buckets"]) == len(buckets)
    # each bucket exported once for each of the two workers that read it (one export, one consumer)
    assert all(sorted(h) == [1, 2] for h in table["ipc"]["buckets"].values())
    assert sender.transport.exports.exports == 2 * len(buckets)
    assert HostIpcDouble.synchronized == ["cpu"]  # the conversions waited for once, not per tensor
    _publish(sender)  # the next sync: same storages, no new export, again one synchronize
    assert sender.transport.exports.exports == 2 * len(buckets)
    assert HostIpcDouble.synchronized == ["cpu", "cpu"]


def test_same_dtype_views_share_their_storage_handle(monkeypatch):
    """bf16 trainer parameters are the wire as they are: views of one flat buffer (Megatron DDP's
    param buffer) publish one handle per worker for all of them."""
    dims = _dims("llama_kv2_tied")
    layouts = source_rank_layouts(dims, TrainerTopology(1, 1, 1), 0, 0)
    loose = hf_to_local(_hf(dims, 1, torch.bfloat16).__getitem__, layouts)
    flat = torch.empty(sum(t.numel() for t in loose.values()), dtype=torch.bfloat16)
    params, off = {}, 0
    for name, t in loose.items():
        params[name] = flat[off:off + t.numel()].view(t.shape).copy_(t)
        off += t.numel()
    sender, _ = _sender(monkeypatch, torch.bfloat16, "engine", params)
    assert sender._conversions() == []  # nothing converted: the parameters are the wire
    table = _publish(sender)
    assert len(table["ipc"]["buckets"]) == 1 and sender.transport.exports.exports == 2
    (k, _), = table["ipc"]["buckets"].items()
    assert {where[0] for where in table["ipc"]["where"].values()} == {k}
    assert sorted(off for _, off in table["ipc"]["where"].values())[0] == 0
    # the same tensors, each its own storage: one handle per parameter storage per worker
    sender2, _ = _sender(monkeypatch, torch.bfloat16, "engine", loose)
    table2 = _publish(sender2)
    assert len(table2["ipc"]["buckets"]) == len(loose) and sender2.transport.exports.exports == 2 * len(loose)


def test_a_sync_sets_two_store_keys_per_rank_whatever_the_tensors(monkeypatch):
    """The rank's table (addresses, one handle per bucket and worker) and its digests (every (worker, HF tensor)
    sum) are one store value each per sync: two round trips, not one per tensor. The digests themselves are
    one launch per (worker, HF tensor, source parameter), read back once (tests/unit/test_ddma_digest_batch.py)."""
    sender, store = _sender(monkeypatch, torch.float32, "engine")
    for worker in (1, 2):  # both workers acknowledged: the sender returns after publishing
        store.set(f"ddma/v1/done{worker}", b"1")
    before = store.num_keys()
    stats = sender.sync(1)
    assert store.num_keys() - before == 2, stats
    table, sums = pickle.loads(store.get("ddma/v1/src0")), pickle.loads(store.get("ddma/v1/sums0"))
    assert len(table["ipc"]["buckets"]) == len(plan_buckets([n * dt.itemsize for _, n, dt in sender._conversions()],
                                                            BUCKET))
    assert {j for j, _ in sums} == {1, 2} and len({n for _, n in sums}) > 10  # every HF tensor of both workers
