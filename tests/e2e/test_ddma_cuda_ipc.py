"""cuda_ipc's logic (megarl/ddma/transport/cuda_ipc.py), between real processes with its four CUDA calls
(export, open, synchronize, collect) replaced by ``HostIpcDouble`` (tests/harness/ddma.py), the GPU-boundary
double whose signatures tests/e2e/test_cuda_api_drift.py checks: buckets, the handle caches (export once per
topology, once per reading worker), the acknowledgement protocol, the source views a worker keeps and the
block copies are the real code. ``reduce_tensor``'s real CUDA branch is inspected with only its GPU-only
calls doubled, and the open failure's message is checked against the ptrace probe. The real CUDA run is
``gpu``-marked here and in tools/gpu_ddma_ipc.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types

import pytest
import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.plan import plan_sync
from megarl.ddma.runs import FP8_BLOCK_INTS
from megarl.ddma.transport.cuda_ipc import ExportCache, explain_open_failure, ptrace_permitted, storage_key
from tests.harness.ddma import _dims, _expected, _run, shard_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("trainer_dtype,wire,realloc", [(torch.float32, "engine", False),
                                                        (torch.bfloat16, "engine", False),
                                                        (torch.float32, "fp8", False),
                                                        (torch.float32, "engine", True)])
def test_cuda_ipc_protocol_lands_exact_and_exports_once(trainer_dtype, wire, realloc):
    """Break caught: landing tables rebuilt per sync or grown per element (index_bytes), a block's
    destination off by one (the exact bytes), a worker landing from its last sync's source views after the
    sender re-exported (``realloc``: new buckets every sync; the old ones still hold the last version)."""
    dims = _dims("llama_kv2_tied")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(1, 2)  # TP2 senders -> two TP1 replicas
    _, res = _run(dims, src, dst, transport="cuda_ipc", wire=wire, trainer_dtype=trainer_dtype,
                  versions=(1, 2, 3), bucket_bytes=64 << 10, realloc=realloc)
    assert len(res["got"]) == 2 * 3
    plan, index_bytes = plan_sync(dims, src, dst), {}
    for rank, v, (got, stats) in res["got"]:
        want = _expected(dims, dst, v, trainer_dtype, torch.bfloat16)[rank.tp]
        for n, w in want.items():
            if wire == "engine" or w.dim() == 1:
                assert torch.equal(got[n].view(torch.int16), w.view(torch.int16)), (rank, v, n)
        # handles opened once per topology, not per sync (realloc: every sync's new buckets); every sync collects
        assert stats["ipc_opens"] == res["got"][0][2][1]["ipc_opens"] or v == 1 or realloc
        assert stats["collects"] >= v
        # landing tables: O(runs), built once (the same bytes every sync), never 16 B per element
        # (cuda_ipc's per-element _index_cache, before issue 46: every element with FP8)
        copies = [c for (_, d), cs in plan.pairs.items() if d == rank for c in cs]
        assert 0 < stats["index_bytes"] <= 3 * FP8_BLOCK_INTS * 8 * len(copies)
        assert stats["index_bytes"] == index_bytes.setdefault(rank, stats["index_bytes"])
        if wire == "fp8":
            assert 16 * sum(c.numel for c in copies) > 20 * stats["index_bytes"]
    by_version = {}
    for rank, v, stats in res["sent"]:
        by_version.setdefault(rank, {})[v] = stats
        assert set(stats["synchronized"]) == {"cpu"}  # the wire's device (then the workers', in their process)
    # one export, one consumer: every export is opened by exactly one worker (each TP1 replica reads
    # every sender storage, so each storage is exported twice), never one handle for both
    opens = {rank: stats["ipc_opens"] for rank, v, (_, stats) in res["got"] if v == 3}
    assert sum(st[3]["ipc_exports"] for st in by_version.values()) == sum(opens.values()) > 0
    for _, _, (_, stats) in res["got"]:
        assert set(stats["synchronized"]) == {"cpu"}
    for rank, st in by_version.items():
        # exported once (one handle per storage: bf16 params are views of the live tensors; fp32 and
        # fp8 conversions sit in 64 KiB buckets), never again while storages stay put
        if realloc:  # every sync's buckets are new storages: exported (and opened) again
            assert 0 < st[1]["ipc_exports"] < st[2]["ipc_exports"] < st[3]["ipc_exports"]
        else:
            assert st[1]["ipc_exports"] == st[2]["ipc_exports"] == st[3]["ipc_exports"] > 0
        assert st[3]["collects"] >= 3
        if trainer_dtype == torch.float32 and wire == "engine":
            shard = sum(math.prod(s) * 2 for s in shard_shapes(dims, src, rank))
            assert st[1]["ipc_exports"] <= -(-shard // (64 << 10)) + 2  # buckets, not one per tensor


class _CountingOps:
    """GPU-boundary double for ExportCache: records exports instead of making CUDA IPC handles."""

    device_type = "cpu"

    def __init__(self):
        self.exported = []

    def export(self, storage_bytes):
        self.exported.append(storage_bytes.data_ptr())
        return ("handle", storage_bytes.data_ptr())


def test_export_cache_reexports_only_when_a_storage_changes():
    ops = _CountingOps()
    cache = ExportCache(ops)
    bucket = torch.zeros(1024, dtype=torch.uint8)
    a, b = bucket[:256].view(torch.float32), bucket[512:768].view(torch.float32)
    t1 = cache.table({"a": a, "b": b})
    assert len(ops.exported) == 1 and len(t1["buckets"]) == 1  # one handle per bucket, not per tensor
    assert t1["where"]["b"][1] == 512
    cache.table({"a": a, "b": b})
    assert len(ops.exported) == 1  # same storages: nothing re-exported
    c = torch.zeros(64)  # b's storage replaced (a new allocation)
    t3 = cache.table({"a": a, "b": c})
    assert len(ops.exported) == 2 and len(t3["buckets"]) == 2
    t4 = cache.table({"b": c})  # a's storage no longer used: its handle is dropped
    assert len(t4["buckets"]) == 1 and len(cache.handles) == 1


def test_export_cache_one_export_per_reading_worker():
    """Each export has one reference count, which the one process that opens it releases
    (torch/csrc/CudaIPCTypes.cpp): a storage two workers read is exported twice, once for each, and a
    worker gets only its own handle."""
    ops = _CountingOps()
    cache = ExportCache(ops)
    bucket = torch.zeros(1024, dtype=torch.uint8)
    a, b = bucket[:256], bucket[512:]
    t = cache.table({"a": a, "b": b}, {"a": [3, 4], "b": [4]})
    (k, handles), = t["buckets"].items()
    assert sorted(handles) == [3, 4] and len(ops.exported) == 2
    cache.table({"a": a, "b": b}, {"a": [3, 4], "b": [4, 5]})  # a third worker reads b: one more export
    assert len(ops.exported) == 3
    cache.table({"a": a, "b": b}, {"a": [3, 4], "b": [4, 5]})
    assert len(ops.exported) == 3  # nothing new


def test_export_cache_reexports_a_new_storage_at_the_same_address():
    """A storage freed and another allocated at the same address and size has the same storage key;
    its old handle names the old allocation, so it is exported again, under a new key (workers reopen)."""
    ops = _CountingOps()
    cache = ExportCache(ops)
    mem = bytearray(512)
    first = torch.frombuffer(mem, dtype=torch.uint8)
    k1, where = next(iter(cache.table({"w": first})["buckets"])), storage_key(first)
    del first  # its storage is gone
    second = torch.frombuffer(mem, dtype=torch.uint8)  # a new storage, same address and size
    assert storage_key(second) == where
    k2 = next(iter(cache.table({"w": second})["buckets"]))
    assert len(ops.exported) == 2 and k1 != k2
def test_cuda_ipc_worker_lets_go_of_stale_storages_before_it_acknowledges():
    """The sender calls ipc_collect right after the last ack: a storage it no longer exports must be
    released (its reference count at zero) by then, so the worker drops it before signalling."""
    from megarl.ddma.layouts import DstRank
    from megarl.ddma.transport.cuda_ipc import CudaIpcTransport
    from tests.harness.ddma import HostIpcDouble

    events = []

    class Store:
        def set(self, key, value):
            events.append(("ack", sorted(t.opens.opened)))

    class Side:
        spec, rank, device, store = None, DstRank(0, 0), torch.device("cpu"), Store()
        tables = {SrcRank(0, 0, 0): {"pid": 7, "ipc": {"buckets": {"live#2": {}}}}}

        def group_rank(self, r):
            return 1

    t = CudaIpcTransport(Side(), ops=HostIpcDouble())
    t.opens.opened = {(7, "live#2"): torch.zeros(1), (7, "stale#1"): torch.zeros(1)}
    s = SrcRank(0, 0, 0)  # the source views a worker keeps between syncs hold their storages too
    t._views = {(s, "a"): ((7, "live#2", 0), ()), (s, "b"): ((7, "stale#1", 256), ())}
    t.ack(3)
    assert events == [("ack", [(7, "live#2")])]
    assert list(t._views) == [(s, "a")]


def test_ptrace_message_names_yama_scope_one(monkeypatch):
    """Under Yama ptrace_scope=1 a denied pidfd_getfd is Yama's descendants rule (a worker is no
    ancestor of the trainer), not a missing container capability."""
    from megarl.ddma.transport import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "ptrace_permitted", lambda pid: False)
    monkeypatch.setattr(cuda_ipc, "yama_ptrace_scope", lambda: 1)
    msg = explain_open_failure(4242, RuntimeError("pidfd_getfd: Operation not permitted"))
    assert "ptrace_scope=1" in msg and "PR_SET_PTRACER" in msg and "ancestor" in msg
    assert "no CAP_SYS_PTRACE in this container" not in msg and "sync.transport=nccl" in msg
    monkeypatch.setattr(cuda_ipc, "yama_ptrace_scope", lambda: 0)
    msg0 = explain_open_failure(4242, RuntimeError("x"))
    assert "ptrace_scope" not in msg0 and "no CAP_SYS_PTRACE in this container" in msg0
    monkeypatch.setattr(cuda_ipc, "yama_ptrace_scope", lambda: 3)
    assert "expandable_segments" in explain_open_failure(4242, RuntimeError("x"))


def test_cuda_ipc_open_maps_on_the_workers_device(monkeypatch):
    """The real ``reduce_tensor`` through its CUDA branch (only the GPU-only calls are doubles:
    ``_share_cuda_`` on the sender, ``_new_shared_cuda`` and ``torch.cuda._lazy_init`` on the worker):
    argument 6 of the handle is the sender's device index, and ``CudaIpcOps.open`` maps the memory on
    the worker's own device (cuda:1 here), not on the sender's (cuda:0: another worker's GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from megarl.ddma.transport.cuda_ipc import STORAGE_DEVICE_ARG, CudaIpcOps

    memory = torch.arange(64, dtype=torch.uint8)
    opened_on = []

    class CudaStorageDouble:
        """Stands for a CUDA TypedStorage on device 0; its memory is ``memory``'s host storage."""

        _untyped_storage = types.SimpleNamespace(device=torch.device("cuda", 0))

        def _share_cuda_(self):  # GPU-only: (device, handle, size, offset, refcounter, its offset, event, sync)
            return (0, b"ipc-handle", memory.untyped_storage().nbytes(), 0, b"refcounter", 0, b"event", False)

        def _weak_ref(self):
            return memory.untyped_storage()._weak_ref()

        @classmethod
        def _new_shared_cuda(cls, device, handle, size, offset, *refcount_and_event):  # GPU-only
            opened_on.append(device)
            assert handle == b"ipc-handle" and size == memory.untyped_storage().nbytes()
            return memory.untyped_storage()

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "_typed_storage", lambda self: CudaStorageDouble())
        handle = CudaIpcOps().export(memory)
    fn, args = handle
    assert fn is rebuild_cuda_tensor and len(args) == 15
    assert args[STORAGE_DEVICE_ARG] == 0  # the sender's device index
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # GPU-only
    got = CudaIpcOps().open(handle, torch.device("cuda", 1))
    assert opened_on == [1]
    assert torch.equal(got, memory)


def test_ptrace_probe_and_failure_message_name_the_fallback():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert ptrace_permitted(child.pid) is not False  # our own child: readable (None: a kernel without pidfd)
        msg = explain_open_failure(child.pid, RuntimeError("pidfd_getfd: Operation not permitted"))
        assert "sync.transport=nccl" in msg and f"pid {child.pid}" in msg
    finally:
        child.kill()
        child.wait()
    assert ptrace_permitted(child.pid) in (False, None)  # a dead pid is never readable


@pytest.mark.parametrize("scope, says", [(1, "Yama ptrace_scope=1"), (2, "Yama ptrace_scope=2"),
                                         (None, "may not take trainer pid 77's file descriptors")])
def test_a_refused_ptrace_names_its_cause(monkeypatch, scope, says):
    """A denied probe (as in a container without CAP_SYS_PTRACE) explains why by Yama's scope."""
    import megarl.ddma.transport.cuda_ipc as ipc

    monkeypatch.setattr(ipc, "ptrace_permitted", lambda pid: False)
    monkeypatch.setattr(ipc, "yama_ptrace_scope", lambda: scope)
    msg = explain_open_failure(77, RuntimeError("pidfd_getfd: Operation not permitted"))
    assert says in msg and "sync.transport=nccl" in msg, msg


@pytest.mark.gpu
def test_cuda_ipc_between_processes_on_one_gpu():
    """The real CUDA run: tools/gpu_ddma_ipc.py (TP2 senders -> TP1 and TP2 receivers, exact, checksums on)."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools/gpu_ddma_ipc.py"), "--syncs", "3"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
