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
from tests.test_ddma_sync import _dims, _hf

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
