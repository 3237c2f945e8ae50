"""A sync's digests are queued on the device and read back once a side (issue 46: the CUDA IPC sync spent
29 of its 54 ms on ~146 digests a side, each a table copy, a launch and an 8-byte readback with a stream
sync). megarl/ddma/verify.py's DigestBatch gives each key checksum_segments' sum to the bit, whatever
the order of its adds, and a sync checked with it still catches a corrupted landing.

The batched CUDA kernel (``megarl._C.weighted_checksum_segments_cuda_add``, csrc/cuda/checksum_binding.cpp)
runs only on a GPU (tools/gpu_checksum_check.py checks it there against the CPU kernel). Here its place is
taken by HostDigestAddDouble, the GPU-boundary double: the same arguments (a device table [offsets |
lengths | hf_starts | ends], the total, an int64 out it ADDS to), read on the host by the CPU kernel; its
argument names are checked against the binding's source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megarl.ddma import verify
from megarl.ddma.layouts import (DstRank, GeneratorTopology, TrainerTopology, source_rank_layouts,
                                 vllm_param_layouts)
from megarl.ddma.sync import DdmaReceiver, DdmaSender, DdmaVerifyError, SyncSpec, _Side, host_store
from megarl.ddma.verify import DigestBatch, checksum_segments, checksum_segments_torch
from megarl.models.layouts import hf_to_local
from tests.harness.ddma import _dims, _hf

MASK = (1 << 64) - 1
ROOT = Path(__file__).resolve().parents[2]


class HostDigestAddDouble:
    """GPU-boundary double of ``weighted_checksum_segments_cuda_add(flat, table, total, out)``: checks the
    table's layout as the kernel reads it (ends the inclusive prefix sum of lengths, total its last entry)
    and adds the digest into ``out[0]`` mod 2**64."""

    def __init__(self):
        self.calls = 0

    def __call__(self, flat, table, total, out):
        self.calls += 1
        n = table.numel() // 4
        assert table.dtype == torch.int64 and table.numel() == 4 * n and out.dtype == torch.int64
        off, lens, hf, ends = table.view(4, n)
        assert torch.equal(ends, torch.cumsum(lens, 0)) and int(ends[-1]) == total
        v = checksum_segments(flat, (off.clone(), lens.clone(), hf.clone()))
        out[0] += v - (1 << 64) if v >= 1 << 63 else v  # int64 adds wrap mod 2**64, as the kernel's


def test_double_takes_the_bindings_arguments():
    src = (ROOT / "csrc/cuda/checksum_binding.cpp").read_text()
    m = re.search(r'm\.def\("weighted_checksum_segments_cuda_add".*?"\s*\n', src, re.S)
    assert m, "the batched binding is gone from csrc/cuda/checksum_binding.cpp"
    assert re.findall(r'pybind11::arg\("(\w+)"\)', m.group(0)) == ["flat", "table", "total", "out"]
    assert HostDigestAddDouble.__call__.__code__.co_varnames[1:5] == ("flat", "table", "total", "out")


def _segments(g, numel, n):
    lens = torch.randint(0, 300, (n,), generator=g)
    offs = (torch.rand(n, generator=g) * (numel - lens)).long()
    return offs, lens, torch.randint(0, 1 << 40, (n,), generator=g)  # HF starts past 2**32: weights wrap


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_deferred_sums_equal_checksum_segments(monkeypatch, dtype, path):
    """Several keys, several adds each (different tensors, different segments), one reset, one set: each
    key's value is the sum of checksum_segments over what it was given, mod 2**64, from one readback."""
    double = HostDigestAddDouble()
    monkeypatch.setattr(verify, "_cuda_add_kernel", lambda flat: double if path == "kernel" else None)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-(1 << 31), (1 << 31) - 1, (4096,), generator=g, dtype=torch.int32)
               .view(torch.uint8)[:4096 * dtype.itemsize].view(dtype) for _ in range(3)]
    tables: dict = {}
    batch, want = DigestBatch(tables, deferred=True), {}
    for i in range(12):
        key, t = i % 4, tensors[i % 3]
        segs = _segments(g, t.numel(), 1 + i % 5)
        batch.add(key, t, segs, table_key=i)
        want[key] = (want.get(key, 0) + checksum_segments_torch(t, segs)) & MASK
    batch.reset(3)  # a parameter reported again: its earlier digests are dropped
    segs = _segments(g, 4096, 7)
    batch.add(3, tensors[0], segs, table_key="again")
    want[3] = checksum_segments_torch(tensors[0], segs)
    batch.set(0, 12345)  # a digest computed elsewhere (zero_copy's fused copy) adds to the key
    want[0] = (want[0] + 12345) & MASK
    assert batch.values() == want
    assert batch.readbacks == 1  # every queued digest came back in one copy
    assert want and all(v != 0 for v in want.values())  # the sums are not the trivial ones
    if path == "kernel":
        assert double.calls == 13 and len(tables) == 13  # each segment table put on the device once
        batch2 = DigestBatch(tables, deferred=True)  # the next sync reuses them
        batch2.add("k", tensors[1], (torch.tensor([0]), torch.tensor([5]), torch.tensor([9])), table_key=0)
        assert len(tables) == 13  # table key 0's table, not the segments passed: built once per plan


def test_a_table_reaching_past_the_tensor_is_refused(monkeypatch):
    """The kernel cannot check a device table's bounds without a sync, so DigestBatch does (from the table's
    reach, at every call): a tensor shorter than the plan's segments is refused, not read out of bounds."""
    monkeypatch.setattr(verify, "_cuda_add_kernel", lambda flat: HostDigestAddDouble())
    batch = DigestBatch(deferred=True)
    segs = (torch.tensor([0, 90]), torch.tensor([10, 20]), torch.tensor([0, 10]))
    batch.add("a", torch.zeros(110, dtype=torch.bfloat16), segs)
    with pytest.raises(ValueError, match="reaches element 110, outside the tensor of 100 elements"):
        batch.add("a", torch.zeros(100, dtype=torch.bfloat16), segs)


def test_host_tensors_are_summed_at_once():
    """On the host nothing is deferred: the C++ kernel's sums, no readback."""
    batch = DigestBatch()
    flat = torch.arange(100, dtype=torch.int16)
    segs = (torch.tensor([3]), torch.tensor([50]), torch.tensor([1 << 33]))
    batch.add("a", flat, segs)
    assert batch.values() == {"a": checksum_segments(flat, segs)} and batch.readbacks == 0


def _one_sync(corrupt=None):
    """Two trainer ranks (TP2) digest for one TP1 worker; the worker lands the independent hf_to_local of the
    same weights, ``corrupt`` changes one engine tensor after it landed, and the worker verifies."""
    dims = _dims("llama_kv4_untied")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(1, 1)
    store = host_store()
    spec = SyncSpec(dims, src, dst, "127.0.0.1", store.port, engine_dtype="bfloat16", timeout_s=30.0)
    hf = _hf(dims, 1, torch.bfloat16)
    tables, senders = {}, []
    for r in sorted(src.ranks()):
        sender = DdmaSender(spec, r, hf_to_local(hf.__getitem__, source_rank_layouts(dims, src, r.tp, r.pp)))
        tables[r] = {"sums": sender._checksums(sender._wire_tensors()[0], {})}
        senders.append(sender)
    recv = DdmaReceiver(spec, DstRank(0, 0))
    recv.begin_landing(tables)
    engine = hf_to_local(hf.__getitem__, vllm_param_layouts(dims, dst.tp, 0, dst.vocab_padding))
    name = "model.layers.1.mlp.down_proj.weight"
    for n, t in engine.items():
        recv.check_landed(n, t)
    if corrupt:  # a wrong landing, then reported again: the second report replaces the first
        engine[name].view(-1).view(torch.int16)[77] ^= 1 << 2
    recv.check_landed(name, engine[name])  # clean, reported twice: verifies only if replaced, not added
    recv.verify_landed(1)
    return senders, recv


def test_a_deferred_sync_reads_each_sides_digests_back_once_and_catches_a_flip(monkeypatch):
    """The sync's path with the device's bookkeeping forced on host tensors (and the kernel double): every
    digest of a side comes back in one copy, the clean landing verifies, and a flipped bit in a parameter
    reported again is caught (the second report replaced the first, not added to it)."""
    double = HostDigestAddDouble()
    monkeypatch.setattr(verify, "_cuda_add_kernel", lambda flat: double)
    monkeypatch.setattr(_Side, "digests_deferred", True)
    senders, recv = _one_sync()
    assert [s.digest_readbacks for s in senders] == [1, 1] and recv.digest_readbacks == 1
    assert double.calls > 2 * len(recv.layouts)  # every digest went through the batched kernel
    with pytest.raises(DdmaVerifyError, match=r"model\.layers\.1\.mlp\.down_proj\.weight checksum"):
        _one_sync(corrupt=True)
