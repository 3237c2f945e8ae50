"""The C++ extension megarl._C agrees with its Python reference, and the fallback works."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import megarl.native as native
from megarl.ddma.runs import merge_contiguous_runs, merge_contiguous_runs_ref

# CI builds the extension and sets MEGARL_REQUIRE_NATIVE=1 so a broken build fails instead of skipping.
requires_native = pytest.mark.skipif(
    not native.HAS_NATIVE and os.environ.get("MEGARL_REQUIRE_NATIVE") != "1",
    reason="megarl._C not built (pip install --no-build-isolation --no-deps -e .)",
)

# (src_offsets, dst_offsets, lengths) -> expected merged (src_offsets, dst_offsets, lengths)
HAND_WRITTEN = {
    "empty": (([], [], []), ([], [], [])),
    "single": (([3], [7], [5]), ([3], [7], [5])),
    "all contiguous": (([0, 4, 8], [100, 104, 108], [4, 4, 4]), ([0], [100], [12])),
    "src contiguous, dst gap": (([0, 4], [0, 10], [4, 4]), ([0, 4], [0, 10], [4, 4])),
    "dst contiguous, src gap": (([0, 10], [0, 4], [4, 4]), ([0, 10], [0, 4], [4, 4])),
    "zero length inside a run": (([0, 4, 4], [0, 4, 4], [4, 0, 4]), ([0], [0], [8])),
    "only zero lengths": (([1, 2], [3, 4], [0, 0]), ([], [], [])),
    "contiguous but reversed order stays": (([4, 0], [4, 0], [4, 4]), ([4, 0], [4, 0], [4, 4])),
    "mixed": (
        ([0, 5, 10, 14, 30], [50, 55, 0, 4, 8], [5, 5, 4, 4, 2]),
        ([0, 10, 30], [50, 0, 8], [10, 8, 2]),
    ),
}


def _implementations():
    impls = [pytest.param(merge_contiguous_runs_ref, id="python_ref")]
    impls.append(pytest.param(lambda *a: native._C.merge_contiguous_runs(*a), id="cpp", marks=requires_native))
    return impls


def _tensors(*lists):
    return [torch.tensor(values, dtype=torch.int64) for values in lists]


@pytest.mark.parametrize("merge", _implementations())
@pytest.mark.parametrize("case", sorted(HAND_WRITTEN))
def test_merge_hand_written(merge, case):
    inputs, expected = HAND_WRITTEN[case]
    result = merge(*_tensors(*inputs))
    assert all(t.dtype == torch.int64 for t in result)
    assert [t.tolist() for t in result] == [list(e) for e in expected]


def _random_plan(generator: torch.Generator, n: int):
    """Copies that often continue the previous one on one side, both, or neither."""
    src, dst, lens = [], [], []
    s = d = 0
    for _ in range(n):
        kind = int(torch.randint(0, 4, (1,), generator=generator))
        gap = int(torch.randint(1, 5, (1,), generator=generator))
        s_next = s if kind in (0, 1) else s + gap
        d_next = d if kind in (0, 2) else d + gap
        if kind == 3 and torch.rand(1, generator=generator) < 0.3:
            s_next, d_next = max(0, s - 3), d + gap  # jump backwards in the source
        length = int(torch.randint(0, 6, (1,), generator=generator))
        src.append(s_next)
        dst.append(d_next)
        lens.append(length)
        s, d = s_next + length, d_next + length
    return _tensors(src, dst, lens)


def _apply(plan, source: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.full((size,), -1, dtype=source.dtype)
    for s, d, n in zip(*(t.tolist() for t in plan)):
        out[d : d + n] = source[s : s + n]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_merged_plan_moves_the_same_bytes(seed):
    """Independent of both implementations: executing the merged plan gives the same result."""
    generator = torch.Generator().manual_seed(seed)
    plan = _random_plan(generator, 200)
    merged = merge_contiguous_runs(*plan)
    source = torch.arange(int((plan[0] + plan[2]).max()) + 1)
    size = int((plan[1] + plan[2]).max()) + 1
    assert torch.equal(_apply(merged, source, size), _apply(plan, source, size))
    assert int(merged[2].sum()) == int(plan[2].sum())
    assert (merged[2] > 0).all() and merged[2].numel() < plan[2].numel()


@requires_native
@pytest.mark.parametrize("seed", range(20))
def test_cpp_matches_reference_on_random_plans(seed):
    generator = torch.Generator().manual_seed(seed)
    plan = _random_plan(generator, int(torch.randint(0, 500, (1,), generator=generator)))
    expected = merge_contiguous_runs_ref(*plan)
    got = native._C.merge_contiguous_runs(*plan)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@requires_native
def test_cpp_handles_non_contiguous_views():
    base = torch.tensor([[0, 9], [4, 9], [8, 9]], dtype=torch.int64)
    got = native._C.merge_contiguous_runs(base[:, 0], base[:, 0] + 100, torch.full((3,), 4))
    assert [t.tolist() for t in got] == [[0], [100], [12]]


@pytest.mark.parametrize("merge", _implementations())
@pytest.mark.parametrize(
    "inputs, message",
    [
        (([0, 1], [0], [1, 1]), "must|equal"),
        (([0], [0], [-1]), "negative"),
        (([-2], [0], [1]), "negative offset"),
    ],
)
def test_merge_rejects_bad_plans(merge, inputs, message):
    with pytest.raises(ValueError, match=message):
        merge(*_tensors(*inputs))


def test_native_wrapper_accepts_lists():
    assert [t.tolist() for t in merge_contiguous_runs([0, 2], [5, 7], [2, 2])] == [[0], [5], [4]]


def test_fallback_without_extension_warns_once_and_works():
    # A fresh interpreter where importing megarl._C fails, as on a machine that never built it.
    script = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["megarl._C"] = None  # makes `from megarl import _C` raise ImportError
        import megarl.native as native
        from megarl.ddma.runs import merge_contiguous_runs
        assert not native.HAS_NATIVE
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = merge_contiguous_runs([0, 4], [0, 4], [4, 4])
            second = merge_contiguous_runs([0], [1], [2])
        assert [t.tolist() for t in first] == [[0], [0], [8]], first
        assert [t.tolist() for t in second] == [[0], [1], [2]], second
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        assert "pip install --no-build-isolation -e ." in messages[0], messages[0]
        print("fallback ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fallback ok" in result.stdout
