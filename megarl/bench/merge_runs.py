"""Benchmark: C++ `megarl._C.merge_contiguous_runs` against its pure-Python reference.

Plans shaped like DDMA's: row-by-row copies of a weight shard, where some consecutive rows are
contiguous on both sides (they merge) and some are not. Both run side by side in one process;
the script prints the ratio and writes a JSON (and a PNG when matplotlib is installed).

    megarl bench merge_runs [--out runs/bench] [--sizes 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from megarl import native
from megarl.ddma.runs import merge_contiguous_runs, merge_contiguous_runs_ref


def make_row_plan(num_rows: int, row_len: int = 64, break_every: int = 8, seed: int = 0):
    """Row copies of a shard; every `break_every`-th destination row skips a gap (no merge)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.arange(num_rows, dtype=torch.int64)
    src = rows * row_len
    gaps = (rows % break_every == 0).to(torch.int64) * torch.randint(1, 4, (num_rows,), generator=generator)
    dst = rows * row_len + torch.cumsum(gaps, 0) * row_len
    lengths = torch.full((num_rows,), row_len, dtype=torch.int64)
    return src, dst, lengths


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="megarl bench merge_runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench", help="output folder for the JSON and PNG")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000], help="copies per plan")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per size (best is kept)")
    args = parser.parse_args()
    if not native.HAS_NATIVE:
        raise SystemExit("megarl._C is not built: run `pip install --no-build-isolation --no-deps -e .` first")

    torch.set_num_threads(1)
    results = []
    for size in args.sizes:
        plan = make_row_plan(size)
        expected = merge_contiguous_runs_ref(*plan)
        got = merge_contiguous_runs(*plan)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), "C++ and reference disagree"
        ref_s = best_time(lambda: merge_contiguous_runs_ref(*plan), args.repeats)
        cpp_s = best_time(lambda: merge_contiguous_runs(*plan), args.repeats)
        results.append(
            {"copies": size, "merged_copies": int(got[0].numel()), "python_ref_s": ref_s, "cpp_s": cpp_s,
             "speedup": ref_s / cpp_s}
        )
        print(f"{size:>8} copies -> {got[0].numel():>7} runs | python {ref_s * 1e3:9.3f} ms | "
              f"C++ {cpp_s * 1e3:8.3f} ms | C++ is {ref_s / cpp_s:7.1f}x faster")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "merge_runs.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'merge_runs.json'}")
    from megarl.utils.plots import pyplot, save

    plt = pyplot("merge_runs")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [r["copies"] for r in results]
    ax.loglog(sizes, [r["python_ref_s"] * 1e3 for r in results], "o-", label="Python reference")
    ax.loglog(sizes, [r["cpp_s"] * 1e3 for r in results], "s-", label="C++ (megarl._C)")
    ax.set_xlabel("copies in plan")
    ax.set_ylabel("best time (ms)")
    ax.set_title("merge_contiguous_runs")
    ax.legend()
    save(fig, out / "merge_runs.png", dpi=100)
    print(f"wrote {out / 'merge_runs.png'}")


if __name__ == "__main__":
    main()
