"""DDMA landing tables as ranges (megarl/ddma/runs.py blocks; issue 46 item 1-2).

A landing used to expand its runs into two int64 indices per element (16 B/element: cuda_ipc kept them
on the vLLM GPU for good, the FP8 landing rebuilt them on the CPU every sync). Runs now fold into
strided blocks, built once per plan, O(runs) host ints, and land with one strided copy per block.

- hand-counted tables: a dim-1 piece (one run per row) folds into one block, Megatron's per-group qkv
  runs into three, an FP8 run is cut at source-row edges;
- blocks land exactly what the per-element indices landed (bit for bit, FP8 included), on a seeded
  set of random run lists;
- the tables of real plans (Llama-3.1-8B, fp8 wire, trainer TP1 -> vLLM TP1 and TP2, as cuda_ipc
  builds them) are bounded by the number of runs, and are a tiny fraction of what 16 B/element was.

Each test names the break it catches (planted by hand, seen failing, restored).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from megarl.ddma.plan_types import Copy
from megarl.ddma.runs import (BLOCK_INTS, FP8_BLOCK_INTS, copy_blocks, copy_byte_blocks, dequant_blocks, fp8_blocks,
                              land_blocks, table_bytes)
from megarl.ddma.transport.base import land_fp8, land_fp8_per_element, packed_fp8_blocks, rows_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_copy_blocks_fold_rows_and_qkv_groups():
    """Break caught: a block's stride taken from the wrong side, or a run folded in whose start is off by one."""
    # a dim-1 piece: 4 rows of 3 columns out of a 6-wide source into a 3-wide destination
    assert copy_blocks([3, 9, 15, 21], [0, 3, 6, 9], [3, 3, 3, 3]) == ((3, 6, 0, 3, 4, 3),)
    # Megatron's per-group qkv (2 groups of [q 4 rows; k 2; v 2], 1 column) -> vLLM's [q; k; v], in the
    # plan's order (group by group: q, k, v interleaved)
    src, dst, n = [], [], []
    for g in range(2):
        for start, rows, out in ((0, 4, 4 * g), (4, 2, 8 + 2 * g), (6, 2, 12 + 2 * g)):
            src.append(8 * g + start)
            dst.append(out)
            n.append(rows)
    # (blocks by run length, then destination: k, v, q)
    assert copy_blocks(src, dst, n) == ((4, 8, 8, 2, 2, 2), (6, 8, 12, 2, 2, 2), (0, 8, 0, 4, 2, 4))
    # a start one past the next row's: a block of its own, not a fold
    assert copy_blocks([0, 10, 21], [0, 5, 10], [5, 5, 5]) == ((0, 10, 0, 5, 2, 5), (21, 0, 10, 0, 1, 5))
    assert copy_blocks([], [], []) == ()
    assert all(len(b) == BLOCK_INTS for b in copy_blocks([0, 5], [7, 1], [2, 2]))


def test_fp8_blocks_cut_at_source_rows():
    """Break caught: a run's partial first row scaled with the next row's scale (row edge off by one)."""
    cols = 4
    # one run of source elements 2-13 of a 4-wide source (row 0 cols 2-3, rows 1-2 whole, row 3 cols 0-1),
    # its codes at 100.. of a message, landing at 50..
    blocks = fp8_blocks([100], [2], [50], [12], [0], cols)
    assert blocks == ((100, 0, 0, 0, 50, 0, 1, 2),  # partial row 0: scale 0
                      (102, 4, 1, 1, 52, 4, 2, 4),  # rows 1-2, whole: scales 1, 2
                      (110, 0, 3, 0, 60, 0, 1, 2))  # partial row 3: scale 3
    assert all(len(b) == FP8_BLOCK_INTS for b in blocks)
    # a dim-1 piece in FP8: the second half of every row of a 4-row source, one block, one scale per row
    assert fp8_blocks([2, 6, 10, 14], [2, 6, 10, 14], [0, 2, 4, 6], [2, 2, 2, 2], [0] * 4, cols) == \
        ((2, 4, 0, 1, 0, 2, 4, 2),)


def _random_copies(rng: random.Random, n: int) -> tuple[list[Copy], int]:
    """Disjoint destination runs (gaps between some) from anywhere in an n-element source, in an order
    that sometimes has constant strides (the folds) and sometimes not."""
    copies, dpos = [], 0
    if rng.random() < 0.4:  # rows of one length at a constant stride: folds
        length = rng.randint(1, max(1, n // 4))
        stride = rng.randint(length, max(length, n // 3))
        for i in range(rng.randint(2, 5)):
            if i * stride + length > n:
                break
            copies.append(Copy("h", "p", i * stride, "d", dpos, length))
            dpos += length + rng.choice([0, 0, 1])
        return copies, dpos
    for _ in range(rng.randint(1, 6)):
        length = rng.randint(1, n)
        copies.append(Copy("h", "p", rng.randint(0, n - length), "d", dpos, length))
        dpos += length + rng.choice([0, 0, 2])
    return copies, dpos


def _fp8_codes(n: int, g: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN codes
    return codes


def test_blocks_land_what_per_element_indices_landed():
    """Seeded random run lists: engine-dtype copies and FP8 dequantization (packed as zero_copy / gloo /
    nccl receive it, and in the sender's layout as cuda_ipc reads it) equal the per-element reference
    bit for bit, and write nothing outside the runs. Break caught: any off-by-one in a run's destination
    offset (e.g. ``d0 + 1`` in ``land_blocks``), a wrong scale base in ``packed_fp8_blocks``."""
    rng, g = random.Random(46), torch.Generator().manual_seed(46)
    for trial in range(150):
        rows, cols = rng.randint(1, 12), rng.randint(1, 12)
        n = rows * cols
        copies, size = _random_copies(rng, n)
        if not copies:
            continue
        src_off, dst_off, lens = ([getattr(c, f) for c in copies] for f in ("src_offset", "dst_offset", "numel"))
        # engine dtype
        src = torch.randn(n, generator=g)
        want = torch.full((size,), float("nan"))
        for c in copies:
            want[c.dst_offset:c.dst_offset + c.numel] = src[c.src_offset:c.src_offset + c.numel]
        got = torch.full((size,), float("nan"))
        land_blocks(got, src, copy_blocks(src_off, dst_off, lens))
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (trial, copies)
        # FP8, packed message (codes concatenated, then each copy's row span of scales)
        codes, scales = _fp8_codes(n, g), torch.rand(rows, generator=g) * 3
        msg = torch.cat([codes[c.src_offset:c.src_offset + c.numel] for c in copies])
        seg = torch.cat([scales[slice(*rows_of(c, cols))] for c in copies])
        want = torch.full((size,), float("nan"), dtype=torch.bfloat16)
        land_fp8_per_element(want, copies, cols, msg, seg)
        got = torch.full((size,), float("nan"), dtype=torch.bfloat16)
        land_fp8(got, copies, cols, msg, seg, packed_fp8_blocks(copies, cols))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (trial, copies)
        # FP8 in the sender's layout, its whole scale vector (cuda_ipc)
        got = torch.full((size,), float("nan"), dtype=torch.bfloat16)
        dequant_blocks(got, codes, scales, fp8_blocks(src_off, src_off, dst_off, lens, [0] * len(copies), cols))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (trial, copies)


@pytest.mark.parametrize("unit", [1, 2, 8])
def test_byte_blocks_copy_in_words_at_any_alignment(unit):
    """nccl's CUDA path (copy_byte_blocks): byte runs of ``unit``-byte elements between byte views that start
    at storage offsets 0 to 7, each block moved in the widest word its offsets, strides, length and both
    views' storage offsets allow; the bytes equal a per-run byte copy, nothing written outside the runs.
    The same for cuda_ipc's landing (land_blocks: source views in words) of bf16 at any element offset.
    Break caught: a word width from the strides alone (a misaligned view: torch refuses it), a destination
    off the word boundary viewed in words, a block's stride off by one (the bytes)."""
    rng, g = random.Random(unit), torch.Generator().manual_seed(unit)
    for trial in range(120):
        rows, cols = rng.randint(1, 12), rng.randint(1, 12)
        copies, size = _random_copies(rng, rows * cols)
        if not copies:
            continue
        shift_src, shift_dst = rng.randint(0, 7), rng.randint(0, 7)
        src = torch.randint(0, 256, (rows * cols * unit + shift_src,), generator=g, dtype=torch.uint8)[shift_src:]
        dst = torch.zeros(size * unit + shift_dst, dtype=torch.uint8)[shift_dst:]
        want = dst.clone()
        for c in copies:
            want[c.dst_offset * unit:(c.dst_offset + c.numel) * unit] = \
                src[c.src_offset * unit:(c.src_offset + c.numel) * unit]
        blocks = copy_blocks([c.src_offset * unit for c in copies], [c.dst_offset * unit for c in copies],
                             [c.numel * unit for c in copies])
        assert copy_byte_blocks(dst, src, blocks) == len(blocks) <= len(copies)
        assert torch.equal(dst, want), (trial, shift_src, shift_dst, copies)
        # cuda_ipc's landing (source views kept in words) of bf16 elements, both sides at element offsets
        # 0-3: a destination off the 8-byte boundary takes the source view's bytes
        if unit == 2:
            src16 = torch.randint(-30000, 30000, (rows * cols + 3,), generator=g, dtype=torch.int16)[shift_src % 4:]
            src16 = src16[:rows * cols].view(torch.bfloat16)
            dst16 = torch.zeros(size + 3, dtype=torch.int16)[shift_dst % 4:][:size]
            want16 = dst16.clone()
            for c in copies:
                want16[c.dst_offset:c.dst_offset + c.numel] = src16.view(torch.int16)[c.src_offset:c.src_offset + c.numel]
            land_blocks(dst16.view(torch.bfloat16), src16,
                        copy_blocks(*([getattr(c, f) for c in copies] for f in ("src_offset", "dst_offset", "numel"))))
            assert torch.equal(dst16, want16), (trial, shift_src, shift_dst, copies)


def test_large_blocks_land_in_row_chunks(monkeypatch):
    """A block larger than CHUNK_ELEMENTS lands in row chunks (bounded scratch) with the same bits.
    Break caught: a chunk's row offset applied to one side only."""
    from megarl.ddma import runs

    monkeypatch.setattr(runs, "CHUNK_ELEMENTS", 10)
    g = torch.Generator().manual_seed(1)
    cols, rows = 4, 9
    codes, scales = _fp8_codes(rows * cols, g), torch.rand(rows, generator=g)
    copies = [Copy("h", "p", 0, "d", 0, rows * cols)]
    want = torch.empty(rows * cols, dtype=torch.bfloat16)
    land_fp8_per_element(want, copies, cols, codes, scales)
    got = torch.empty(rows * cols, dtype=torch.bfloat16)
    peak = dequant_blocks(got, codes, scales, fp8_blocks([0], [0], [0], [rows * cols], [0], cols))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert peak == 2 * cols * (4 + 2)  # two rows per chunk: float32 product + bf16 cast


def _old_index_bytes(copies: list[Copy], fp8: bool) -> int:
    """What cuda_ipc's ``_index_cache`` held for one (sender, parameter) before: two int64 indices per
    element wherever it gathered (FP8 always; otherwise above 16 runs)."""
    return 16 * sum(c.numel for c in copies) if fp8 or len(copies) > 16 else 0


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_cuda_ipc_tables_of_llama_8b_are_o_runs(gen_tp):
    """Llama-3.1-8B (configs/models/llama-3.1-8b.json), trainer TP1, fp8 wire, as cuda_ipc builds its
    tables (``CudaIpcTransport._blocks``, plan only, no weights): the bytes held are bounded by the
    number of runs (at most 3 blocks of 8 int64s per run), and far below the 16 B/element held before
    (12.9 GB at TP1 with the engine dtype's gathers; 128 GB with FP8's). Break caught: a table keyed
    per sync, or per-element indices creeping back (the bound by runs fails)."""
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.ddma.plan import plan_sync
    from megarl.ddma.transport.cuda_ipc import CudaIpcTransport
    from megarl.models.layouts import ModelDims

    with open(os.path.join(REPO, "configs/models/llama-3.1-8b.json")) as f:
        cfg = json.load(f)
    cfg.pop("rope_scaling", None)  # the plan depends on shapes only (as megarl plan-sync does)
    dims = ModelDims.from_hf_config(cfg)
    plan = plan_sync(dims, TrainerTopology(1, 1, 1), GeneratorTopology(gen_tp, 1))
    for d in sorted(plan.dst_shapes):  # each worker's tables: what one vLLM GPU held
        t = CudaIpcTransport.__new__(CudaIpcTransport)  # only its table logic: no side, no CUDA call
        t._tables, t._index_bytes = {}, 0
        runs = elements = old_fp8 = old_engine = 0
        for (s, dd), copies in plan.pairs.items():
            if dd != d:
                continue
            by_param: dict[str, list[Copy]] = {}
            for c in copies:
                by_param.setdefault(c.dst_param, []).append(c)
            for cs in by_param.values():
                shape = plan.src_shapes[s][cs[0].src_param]
                fp8 = len(shape) == 2  # sync.wire=fp8: every 2-D weight
                t._blocks(s, cs, shape[1] if fp8 else None)
                runs += len(cs)
                elements += sum(c.numel for c in cs)
                old_fp8 += _old_index_bytes(cs, fp8)
                old_engine += _old_index_bytes(cs, False)
        held = t.index_bytes()
        assert held == sum(table_bytes(b) for b in t._tables.values())
        assert 0 < held <= 3 * FP8_BLOCK_INTS * 8 * runs
        assert old_fp8 > 5_000 * held
        if gen_tp == 1:
            assert elements == 8_030_261_248  # every parameter, one worker
            assert old_engine == pytest.approx(12.9e9, rel=0.01)  # the figure (engine dtype)
            assert old_fp8 > 0.99 * 16 * elements  # FP8: every element but the norms'
            assert held < 1 << 20  # under a MiB
        else:
            assert held < 16 << 20  # o_proj / down_proj: one run per row, folded into blocks


def test_bench_landing_figure_before_and_after():
    """``megarl bench sync``'s landing figure (megarl/bench/sync.py ``landing_figures``) on the --quick model,
    trainer TP2 -> one worker (dim-1 pieces: one run per row): both paths land the same bits (it raises
    otherwise), the index bytes drop from 16 B/element to the block tables, bounded by the runs.
    Break caught: blocks that land other bits than the per-element path (e.g. a dequantized row one
    element off: the bench refuses to report a speed)."""
    from megarl.bench import sync as bench_sync
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.models.layouts import ModelDims

    fig = bench_sync.landing_figures(ModelDims.from_hf_config(bench_sync.QUICK_DIMS), TrainerTopology(2, 1, 1),
                                     GeneratorTopology(1, 1), trials=1)
    for kind in ("fp8", "engine"):
        f = fig[kind]
        assert f["runs"] > 1000 and f["blocks"] < f["runs"] / 10  # one run per row folds into blocks
        assert 0 < f["index_bytes_after"] <= 3 * FP8_BLOCK_INTS * 8 * f["runs"]
        assert len(f["land_s_before_all"]) == len(f["land_s_after_all"]) == 1
    assert fig["fp8"]["index_bytes_before"] == 16 * fig["fp8"]["elements"]
    assert fig["fp8"]["index_bytes_before"] > 1000 * fig["fp8"]["index_bytes_after"]
