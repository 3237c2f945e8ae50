"""The zero-copy primitives and the verification checksum kernel, against plain references.

``read_runs`` (process_vm_readv) and ``map_shared`` + ``copy_runs`` must copy exactly the named
byte runs out of another live process; the C++ ``weighted_checksum_segments`` must equal the torch
reference (``weighted_checksum`` over ``hf_flat_index``) on every dtype width and layout shape.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from megarl.ddma import zero_copy
from megarl.ddma.layouts import vllm_param_layouts
from megarl.ddma.verify import (checksum_segments, hf_flat_index, hf_segments, run_indices, value_bits,
                                weighted_checksum)
from megarl.models.layouts import ModelDims, local_param_layouts


def _holder(q, done) -> None:
    t = torch.arange(4096, dtype=torch.int32)
    q.put((os.getpid(), zero_copy.share(t)))
    done.wait(60)


@pytest.fixture(scope="module")
def other_process():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_holder, args=(q, done), daemon=True)
    p.start()
    pid, entry = q.get(timeout=60)
    yield pid, entry
    done.set()
    p.join(10)


RUNS = [(0, 16), (400, 4), (4000, 380), (17 * 4, 0)]  # (byte offset, bytes) into the holder's tensor


def _expected() -> torch.Tensor:
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    return torch.cat([src[a:a + n] for a, n in RUNS])


def _dst_addrs(out: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(torch.tensor([0] + [n for _, n in RUNS[:-1]]), 0)
    return offs + out.data_ptr()


def test_read_runs_from_another_process(other_process):
    pid, entry = other_process
    out = torch.zeros(sum(n for _, n in RUNS), dtype=torch.uint8)
    got = zero_copy.read_runs(pid, torch.tensor([a for a, _ in RUNS]) + entry["ptr"], _dst_addrs(out),
                              torch.tensor([n for _, n in RUNS]))
    assert got == out.numel() and torch.equal(out, _expected())


def test_map_shared_and_copy_runs(other_process):
    pid, entry = other_process
    mapped = zero_copy.map_shared(pid, entry["fd"], entry["size"])
    assert mapped is not None
    out = torch.zeros(sum(n for _, n in RUNS), dtype=torch.uint8)
    zero_copy.copy_runs(torch.tensor([a for a, _ in RUNS]) + (mapped.data_ptr() + entry["offset"]), _dst_addrs(out),
                        torch.tensor([n for _, n in RUNS]))
    assert torch.equal(out, _expected())


def test_read_runs_names_the_failure():
    with pytest.raises((OSError, RuntimeError), match="process_vm_readv"):
        zero_copy.read_runs(os.getpid(), [8], [torch.zeros(8, dtype=torch.uint8).data_ptr()], [8])  # address 8


DIMS = ModelDims.from_hf_config(dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=200,
                                     rms_norm_eps=1e-5, tie_word_embeddings=False))


def _layouts():
    yield from local_param_layouts(DIMS, 2, 1, 1, 0).values()  # Megatron: fused qkv per group, dim-1 splits
    yield from vllm_param_layouts(DIMS, 4, 3).values()         # vLLM: replicated KV heads, padded vocab


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_checksum_kernel_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    for layout in _layouts():
        numel = torch.Size(layout.local_shape).numel()
        flat = torch.randint(0, 255, (numel,), generator=g, dtype=torch.uint8) if dtype == torch.uint8 else \
            torch.randn(numel, generator=g).to(dtype)
        shape = layout.local_shape
        for name in dict.fromkeys(p.hf_name for p in layout.pieces):
            # every element of `name`, as runs that cross piece-row blocks (segments must cut them)
            idx = torch.tensor([i for i in range(numel) if _belongs(layout, name, i)], dtype=torch.int64)
            starts, lens = _as_runs(idx.tolist())
            segs = hf_segments(layout, name, starts, lens)
            ref = weighted_checksum(value_bits(flat[idx]), hf_flat_index(layout, name, idx))
            assert checksum_segments(flat, segs) == ref, (shape, name)
            assert torch.equal(run_indices(segs[0].tolist(), segs[1].tolist()), idx)


def test_checksum_sees_a_moved_value():
    layout = vllm_param_layouts(DIMS, 1, 0)["model.layers.0.self_attn.qkv_proj.weight"]
    flat = torch.randn(torch.Size(layout.local_shape).numel()).to(torch.bfloat16)
    name = "model.layers.0.self_attn.q_proj.weight"
    segs = hf_segments(layout, name, [0], [64 * 64])
    swapped = flat.clone()
    swapped[[0, 1]] = flat[[1, 0]]
    assert flat[0] != flat[1] and checksum_segments(flat, segs) != checksum_segments(swapped, segs)


def _belongs(layout, name, i) -> bool:
    shape = layout.local_shape
    for p in layout.pieces:
        if p.hf_name != name:
            continue
        inner = torch.Size(shape[p.dim + 1:]).numel()
        r = (i % (shape[p.dim] * inner)) // inner
        if p.local_start <= r < p.local_start + p.length:
            return True
    return False


def _as_runs(idx: list[int]) -> tuple[list[int], list[int]]:
    starts, lens = [], []
    for i in idx:
        if starts and starts[-1] + lens[-1] == i:
            lens[-1] += 1
        else:
            starts.append(i)
            lens.append(1)
    return starts, lens
