"""``megarl bench sync``'s landing figure: index memory and landing time of one worker's sync, the per-element
path of before issue 46 against the block tables of after, side by side in one process (megarl/bench/sync.py
prints it after its table; ``--landing-only`` writes it alone)."""

from __future__ import annotations

import math
import time

import torch

from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
from megarl.models.layouts import ModelDims


def landing_figures(dims: ModelDims, src: TrainerTopology, dst: GeneratorTopology, trials: int = 3) -> dict:
    """Index memory and landing time of one worker's sync, before and after issue 46, side by side in
    this process (both paths are still callable), on host tensors, one thread.

    - ``fp8``: every 2-D weight as ``sync.wire=fp8`` lands it (codes + row scales of each sender's
      copies, packed as zero_copy / gloo / nccl receive them). Before: ``land_fp8_per_element``, which
      built two int64 indices per element on the CPU at every sync. After: ``land_fp8`` over the block
      table built once per plan (the build is timed apart, ``table_build_s``).
    - ``engine``: cuda_ipc's engine-dtype landing out of each sender's whole wire tensor. Before: an
      indexed gather with two int64 indices per element, kept for good, above 16 runs per (sender,
      parameter) (built off the clock, as it was once per plan), slice copies below. After: one strided
      copy per block.
    ``index_bytes_before``: 16 B per element indexed (what cuda_ipc kept, and what the FP8 landing
    rebuilt every sync); ``index_bytes_after``: the block tables (O(runs)). The landed bits must agree.
    """
    from megarl.ddma.plan import plan_sync
    from megarl.ddma.runs import copy_blocks, land_blocks, table_bytes
    from megarl.ddma.transport.base import land_fp8, land_fp8_per_element, packed_fp8_blocks, rows_of
    from megarl.ddma.verify import run_indices

    torch.set_num_threads(1)
    plan = plan_sync(dims, src, dst)
    worker = sorted(plan.dst_shapes)[0]
    g = torch.Generator().manual_seed(46)
    fp8_items, engine_items = [], []
    for (s, d), copies in sorted(plan.pairs.items()):
        if d != worker:
            continue
        by_param: dict[str, list] = {}
        for c in copies:
            by_param.setdefault(c.dst_param, []).append(c)
        for dparam, cs in by_param.items():
            shape = tuple(plan.src_shapes[s][cs[0].src_param])
            n = sum(c.numel for c in cs)
            if len(shape) == 2:
                codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
                codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN codes
                seg = torch.rand(sum(b - a for a, b in (rows_of(c, shape[1]) for c in cs)), generator=g)
                fp8_items.append((dparam, cs, shape[1], codes, seg))
            wire = torch.randn(math.prod(shape), generator=g).to(torch.bfloat16)
            engine_items.append((dparam, cs, wire))
    dst_shapes = plan.dst_shapes[worker]
    out = {name: torch.empty(math.prod(sh), dtype=torch.bfloat16) for name, sh in dst_shapes.items()}
    ref = {name: torch.empty_like(t) for name, t in out.items()}

    t = time.perf_counter()
    fp8_tables = [packed_fp8_blocks(cs, cols) for _, cs, cols, _, _ in fp8_items]
    engine_tables = [copy_blocks([c.src_offset for c in cs], [c.dst_offset for c in cs], [c.numel for c in cs])
                     for _, cs, _ in engine_items]
    table_build_s = time.perf_counter() - t
    gathered = [i for i, (_, cs, _) in enumerate(engine_items) if len(cs) > 16]  # the old MANY_RUNS rule
    old_idx = {i: tuple(run_indices([getattr(c, f) for c in engine_items[i][1]], [c.numel for c in engine_items[i][1]])
                        for f in ("src_offset", "dst_offset")) for i in gathered}

    def fp8_before(dest):
        for dparam, cs, cols, codes, seg in fp8_items:
            land_fp8_per_element(dest[dparam], cs, cols, codes, seg)

    def fp8_after(dest):
        for (dparam, cs, cols, codes, seg), blocks in zip(fp8_items, fp8_tables):
            land_fp8(dest[dparam], cs, cols, codes, seg, blocks)

    def engine_before(dest):
        for i, (dparam, cs, wire) in enumerate(engine_items):
            flat = dest[dparam]
            if i in old_idx:
                flat[old_idx[i][1]] = wire[old_idx[i][0]]
            else:
                for c in cs:
                    flat[c.dst_offset:c.dst_offset + c.numel].copy_(wire[c.src_offset:c.src_offset + c.numel])

    def engine_after(dest):
        for (dparam, _, wire), blocks in zip(engine_items, engine_tables):
            land_blocks(dest[dparam], wire, blocks)

    result = {"worker": str(worker), "threads": 1, "trials": trials}
    for kind, before, after, elements, idx_before, tables in (
            ("fp8", fp8_before, fp8_after, sum(it[3].numel() for it in fp8_items),
             16 * sum(it[3].numel() for it in fp8_items), fp8_tables),
            ("engine", engine_before, engine_after, sum(sum(c.numel for c in it[1]) for it in engine_items),
             sum(16 * sum(c.numel for c in engine_items[i][1]) for i in gathered), engine_tables)):
        times = {"before": [], "after": []}
        for t in (*out.values(), *ref.values()):
            t.zero_()
        for rnd in range(trials + 1):  # round 0: warm-up (pages in), untimed; then alternate, order rotated
            for name in (("before", "after") if rnd % 2 else ("after", "before")):
                dest = ref if name == "before" else out
                t = time.perf_counter()
                (before if name == "before" else after)(dest)
                if rnd:
                    times[name].append(time.perf_counter() - t)
        for name in out:  # every parameter (those this kind does not land are zero on both sides)
            if not torch.equal(out[name].view(torch.int16), ref[name].view(torch.int16)):
                raise SystemExit(f"bench sync landing: {kind} blocks landed other bits than the per-element path in "
                                 f"{name}: a bug, not a speed")
        result[kind] = {"elements": elements, "runs": sum(len(it[1]) for it in (fp8_items if kind == "fp8"
                                                                              else engine_items)),
                        "blocks": sum(len(b) for b in tables), "index_bytes_before": idx_before,
                        "index_bytes_after": table_bytes([b for tab in tables for b in tab]),
                        "land_s_before": min(times["before"]), "land_s_after": min(times["after"]),
                        "land_s_before_all": times["before"], "land_s_after_all": times["after"]}
    result["table_build_s"] = table_build_s
    return result


def print_landing(fig: dict) -> None:
    print(f"\nlanding on worker {fig['worker']} (one thread, best of {fig['trials']}, before/after side by side):")
    print(f"{'':<8}{'elements':>13}{'runs':>9}{'blocks':>8}{'index B before':>16}{'index B after':>15}"
          f"{'land s before':>15}{'land s after':>14}")
    for kind in ("fp8", "engine"):
        f = fig[kind]
        print(f"{kind:<8}{f['elements']:>13,}{f['runs']:>9,}{f['blocks']:>8,}{f['index_bytes_before']:>16,}"
              f"{f['index_bytes_after']:>15,}{f['land_s_before']:>15.3f}{f['land_s_after']:>14.3f}")
    print(f"block tables built once per plan in {fig['table_build_s']:.3f} s")
