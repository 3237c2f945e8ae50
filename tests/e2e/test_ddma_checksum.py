"""DDMA's verification digest at memory speed: the C++ kernel (AVX2 where the CPU has it, a scalar loop
otherwise) gives the torch reference's sum bit for bit, and a sync's digests catch the three corruptions
a transfer can make -- a flipped bit, two chunks swapped, a chunk zeroed -- in what the engine holds.

The sums are integers mod 2**64, so the kernels must agree exactly (no tolerance)."""

from __future__ import annotations

import pytest
import torch

from megarl.ddma.layouts import (DstRank, GeneratorTopology, TrainerTopology, source_rank_layouts,
                                 vllm_param_layouts)
from megarl.ddma.sync import DdmaReceiver, DdmaSender, DdmaVerifyError, SyncSpec, host_store
from megarl.ddma.verify import checksum_segments, checksum_segments_torch
from megarl.models.layouts import hf_to_local
from megarl.native import native_function
from tests.harness.ddma import _dims, _hf

_kernel = native_function("weighted_checksum_segments")
needs_native = pytest.mark.skipif(_kernel is None, reason="megarl._C not built (the torch reference is all there is)")


def _segments(g: torch.Generator, numel: int, n: int) -> tuple[torch.Tensor, ...]:
    """``n`` random segments inside ``numel`` elements: lengths 0..40 (every vector tail: 16- and 8-wide
    steps and the scalar rest), HF starts anywhere in [0, 2**40) so weights wrap mod 2**32."""
    lens = torch.randint(0, 41, (n,), generator=g)
    offs = (torch.rand(n, generator=g) * (numel - lens)).long()
    hfs = torch.randint(0, 1 << 40, (n,), generator=g)
    return offs, lens, hfs


@needs_native
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_vector_kernel_equals_scalar_and_torch(dtype):
    g = torch.Generator().manual_seed(1)
    numel = 1 << 12
    flat = torch.randint(0, 255, (numel,), generator=g, dtype=torch.uint8) if dtype == torch.uint8 else \
        torch.randn(numel, generator=g).to(dtype)
    if dtype != torch.uint8:  # the top bit set in every lane somewhere: products use all 32 bits
        flat[::7] = -flat[::7]
    for n in (1, 3, 64):
        segs = _segments(g, numel, n)
        ref = checksum_segments_torch(flat, segs)
        assert int(_kernel(flat, *segs, True)) == ref
        assert int(_kernel(flat, *segs, False)) == ref
    whole = (torch.tensor([0]), torch.tensor([numel]), torch.tensor([(1 << 32) - 5]))  # one long run across a wrap
    assert int(_kernel(flat, *whole, True)) == int(_kernel(flat, *whole, False)) == checksum_segments_torch(flat, whole)


def _one_sync(corrupt=None):
    """Two trainer ranks (TP2) publish their digests for one TP1 worker; the worker lands every parameter
    (the independent ``hf_to_local`` of the same weights), ``corrupt`` changes one engine tensor in place
    after it landed, and the worker verifies. Sender and receiver digests come from their own layouts."""
    dims = _dims("llama_kv4_untied")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(1, 1)
    store = host_store()
    spec = SyncSpec(dims, src, dst, "127.0.0.1", store.port, engine_dtype="bfloat16", timeout_s=30.0)
    hf = _hf(dims, 1, torch.bfloat16)
    tables = {}
    for r in sorted(src.ranks()):
        params = hf_to_local(hf.__getitem__, source_rank_layouts(dims, src, r.tp, r.pp))
        sender = DdmaSender(spec, r, params)
        tables[r] = {"sums": sender._checksums(sender._wire_tensors()[0], {})}
    recv = DdmaReceiver(spec, DstRank(0, 0))
    recv.begin_landing(tables)
    engine = hf_to_local(hf.__getitem__, vllm_param_layouts(dims, dst.tp, 0, dst.vocab_padding))
    if corrupt is not None:
        corrupt(engine["model.layers.1.mlp.down_proj.weight"].view(-1).view(torch.int16))
    for name, t in engine.items():
        recv.check_landed(name, t)
    recv.verify_landed(1)


def _flip_bit(bits: torch.Tensor) -> None:
    bits[1234] ^= 1 << 3  # a low mantissa bit: the value barely moves


def _swap_chunks(bits: torch.Tensor) -> None:
    a, b = bits[256:512].clone(), bits[1024:1280].clone()
    assert not torch.equal(a, b)
    bits[256:512], bits[1024:1280] = b, a  # same bytes, wrong places: a plain byte sum would not see it


def _zero_chunk(bits: torch.Tensor) -> None:
    bits[4096:4096 + 512] = 0


def test_clean_sync_verifies():
    _one_sync()  # the control: the digests of both layouts agree on the right bytes


@pytest.mark.parametrize("corrupt", [_flip_bit, _swap_chunks, _zero_chunk], ids=["flipped_bit", "swapped_chunk",
                                                                                  "zeroed_chunk"])
def test_digest_catches_corruption(corrupt):
    with pytest.raises(DdmaVerifyError, match=r"model\.layers\.1\.mlp\.down_proj\.weight checksum"):
        _one_sync(corrupt)


def test_checksum_segments_takes_the_kernel():
    """The path a sync takes on host tensors is the native kernel when built (else the torch reference)."""
    flat = torch.randn(1000).to(torch.bfloat16)
    segs = (torch.tensor([0, 500]), torch.tensor([400, 500]), torch.tensor([7, 99]))
    assert checksum_segments(flat, segs) == checksum_segments_torch(flat, segs)


_fused = native_function("copy_checksum_runs")


@needs_native
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vector", [True, False], ids=["avx2", "scalar"])
def test_copy_checksum_runs_copies_and_equals_the_kernel(dtype, vector):
    """The fused copy + digest (csrc copy_checksum_runs) writes exactly the runs and returns, per group, the
    digest weighted_checksum_segments gives over the same segments of what landed: random bytes, odd
    lengths (every vector tail), odd source/destination element offsets (unaligned loads and stores), and one
    run long enough for the streaming-store path."""
    g = torch.Generator().manual_seed(2)
    numel, n = (1 << 20) // dtype.itemsize, 48
    src = torch.randint(-(1 << 31), (1 << 31) - 1, (numel * 4 // 4,), generator=g, dtype=torch.int32)
    src = src.view(torch.uint8)[:numel * dtype.itemsize].view(dtype)
    dst = torch.zeros(numel * 2, dtype=dtype)
    lens = torch.randint(0, 80, (n,), generator=g)
    lens[0], lens[1] = 1000, 77  # long runs: the 32-byte loop, then a tail
    lens[2] = (1 << 19) // dtype.itemsize + 37  # past csrc's kStreamBytes: a scalar head, streamed stores, a tail
    dst_offs = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), lens[:-1] + 3]), 0)  # disjoint, odd gaps
    src_offs = (torch.rand(n, generator=g) * (numel - lens)).long()
    hfs = torch.randint(0, 1 << 40, (n,), generator=g)
    groups = torch.randint(0, 3, (n,), generator=g)
    es = dtype.itemsize
    got = _fused(src_offs * es + src.data_ptr(), dst_offs * es + dst.data_ptr(), lens, hfs, groups, 3, es, vector)
    for i in range(n):
        a, b, k = int(src_offs[i]), int(dst_offs[i]), int(lens[i])
        assert torch.equal(dst[b:b + k].view(torch.uint8), src[a:a + k].view(torch.uint8)), i
    for grp in range(3):
        sel = groups == grp
        want = int(_kernel(dst, dst_offs[sel], lens[sel], hfs[sel], False))
        assert int(got[grp]) & 0xFFFFFFFFFFFFFFFF == want, grp
    untouched = torch.ones(dst.numel(), dtype=torch.bool)
    for i in range(n):
        untouched[int(dst_offs[i]):int(dst_offs[i]) + int(lens[i])] = False
    assert bool((dst[untouched].view(torch.uint8 if es == 1 else torch.int16 if es == 2 else torch.int32) == 0).all())


def _zero_copy_into(corrupt=None):
    """One zero_copy sync in this process, landed straight into engine tensors (DdmaReceiver.receive_into):
    two trainer ranks (PP2) share their bf16 wire (views of their parameters) and publish digests of it;
    ``corrupt`` then changes the PP-rank-1 sender's ``linear_fc2`` of HF layer 1 in place -- the bytes the worker copies
    are no longer the ones the sender summed, as in a corrupted transfer -- and TP rank 1 of a TP2 worker
    (vocab padding rows) lands and verifies. The fused copy + digest must carry the verification: no
    parameter is checksummed after landing."""
    import os
    import pickle

    from megarl.ddma.transport.base import key
    from tests.harness.ddma import _expected_vllm

    dims = _dims("llama_kv4_untied")
    src, dst = TrainerTopology(1, 2, 1), GeneratorTopology(2, 1)
    store = host_store()
    spec = SyncSpec(dims, src, dst, "127.0.0.1", store.port, engine_dtype="bfloat16", timeout_s=30.0)
    hf = _hf(dims, 1, torch.bfloat16)
    senders = []
    for r in sorted(src.ranks()):
        sender = DdmaSender(spec, r, hf_to_local(hf.__getitem__, source_rank_layouts(dims, src, r.tp, r.pp)))
        wire, scales, _ = sender._wire_tensors()
        table = {"pid": os.getpid(), **sender.transport.publish(wire, scales)}  # as DdmaSender.sync: the
        store.set(key(1, f"src{sender.group_rank(r)}"), pickle.dumps(table))   # addresses, then the digests
        store.set(key(1, f"sums{sender.group_rank(r)}"), pickle.dumps(sender._checksums(wire, scales)))
        senders.append(sender)
    if corrupt is not None:
        name = next(n for n, l in senders[1].layouts.items()
                    if any(p.hf_name == "model.layers.1.mlp.down_proj.weight" for p in l.pieces))
        corrupt(senders[1].params[name].view(-1).view(torch.int16))
    recv = DdmaReceiver(spec, DstRank(0, 1))
    recv.check_landed = lambda *a: pytest.fail(f"checksummed after landing: {a[0]} (the fused digest should)")
    engine = {n: torch.full(l.local_shape, float("nan"), dtype=torch.bfloat16) for n, l in recv.layouts.items()}
    recv.receive_into(1, engine)
    want = _expected_vllm(hf, dims, dst.tp, 1)
    assert set(engine) == set(want)
    for n, w in want.items():  # bitwise, padding rows zero
        assert torch.equal(engine[n].view(torch.int16), w.view(torch.int16)), n


@needs_native
def test_zero_copy_into_engine_tensors_lands_exact_and_verifies():
    _zero_copy_into()


@needs_native
@pytest.mark.parametrize("corrupt", [_flip_bit, _swap_chunks, _zero_chunk], ids=["flipped_bit", "swapped_chunk",
                                                                                  "zeroed_chunk"])
def test_fused_digest_catches_corruption_in_transit(corrupt):
    with pytest.raises(DdmaVerifyError, match=r"model\.layers\.1\.mlp\.down_proj\.weight checksum"):
        _zero_copy_into(corrupt)
