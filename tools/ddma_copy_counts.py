"""How many copies one DDMA sync makes on a GPU worker, against the planned runs (issue 46).

On CUDA every copy is a launch, so a sync whose copies follow its runs one by one pays a launch per run:
a trainer at TP2 feeding a TP1 worker sends ``o_proj`` and ``down_proj`` one run per row. This prints, for
the first generator worker of a layout, its planned runs and the copies each CUDA transport makes:

- ``nccl``: per chunk of the bucket schedule, the runs folded into strided blocks (``_Runs.blocks``) plus the
  FP8 message parts after merging (``_Runs.other``); ``fp8_parts``: those parts before merging;
- ``cuda_ipc``: per (sender, engine parameter), the blocks it lands (``copy_blocks`` / ``fp8_blocks``).

From the plan alone (no tensors, no GPU):

    python3 tools/ddma_copy_counts.py --model configs/models/llama-3.1-8b.json --trainer 2 --generator 1 --wire fp8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES, chunk_bytes  # noqa: E402
from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, vllm_param_layouts  # noqa: E402
from megarl.ddma.plan import plan_sync  # noqa: E402
from megarl.ddma.runs import copy_blocks, fp8_blocks  # noqa: E402
from megarl.ddma.transport.base import is_fp8  # noqa: E402
from megarl.ddma.transport.buckets import _Runs, chunk_segments, pair_streams, param_groups  # noqa: E402
from megarl.models.layouts import ModelDims  # noqa: E402


def copy_counts(dims: ModelDims, src: TrainerTopology, dst: GeneratorTopology, wire: str = "engine",
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """The first worker's runs and each CUDA transport's copies for one sync (bf16 engine)."""
    spec = types.SimpleNamespace(engine_dtype="bfloat16", wire=wire)
    plan = plan_sync(dims, src, dst)
    d = sorted(plan.dst_shapes)[0]
    groups = param_groups(vllm_param_layouts(dims, dst.tp, d.tp, dst.vocab_padding), 2, bucket_bytes)
    chunk = chunk_bytes(bucket_bytes)
    runs = nccl = fp8_parts = ipc = 0
    for s in sorted(plan.src_shapes):
        copies = plan.pairs.get((s, d), [])
        runs += len(copies)
        by_param: dict[str, list] = {}
        for c in copies:
            by_param.setdefault(c.dst_param, []).append(c)
        for cs in by_param.values():
            shape = tuple(plan.src_shapes[s][cs[0].src_param])
            cols = [[c.src_offset for c in cs], [c.dst_offset for c in cs], [c.numel for c in cs]]
            ipc += len(fp8_blocks(cols[0], *cols, [0] * len(cs), shape[1]) if is_fp8(spec, shape)
                       else copy_blocks(*cols))
        for segs in pair_streams(plan, spec, s, d, groups):
            total = sum(x.nbytes for x in segs)
            for j in range(-(-total // chunk)):
                parts = list(chunk_segments(segs, j * chunk, (j + 1) * chunk))
                fp8_parts += sum(1 for seg, _, _ in parts if seg.kind != "data")
                r = _Runs(parts, lambda seg: seg.dparam if seg.kind == "data" else None, False)
                nccl += sum(len(b) for _, b in r.blocks()) + len(r.other)
    return {"worker": [d.replica, d.tp], "wire": wire, "bucket_bytes": bucket_bytes, "runs": runs,
            "nccl_copies": nccl, "nccl_fp8_parts_unmerged": fp8_parts, "cuda_ipc_copies": ipc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF config.json (configs/models/)")
    ap.add_argument("--trainer", type=int, default=2, help="trainer TP (PP 1, DP 1; default 2)")
    ap.add_argument("--generator", type=int, default=1, help="generator TP (default 1)")
    ap.add_argument("--wire", choices=("engine", "fp8"), default="engine", help="sync.wire (default engine)")
    ap.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES >> 20, help="sync.bucket_mb (default 32)")
    args = ap.parse_args(argv)
    with open(args.model) as f:
        cfg = json.load(f)
    cfg.pop("rope_scaling", None)  # the plan depends on shapes only
    out = copy_counts(ModelDims.from_hf_config(cfg), TrainerTopology(args.trainer, 1, 1),
                      GeneratorTopology(args.generator, 1), args.wire, args.bucket_mb << 20)
    print(f"{os.path.basename(args.model)} trainer TP{args.trainer} -> generator TP{args.generator}, wire "
          f"{args.wire}: worker {out['worker']} gets {out['runs']:,} runs a sync; nccl makes {out['nccl_copies']:,} "
          f"copies ({out['nccl_fp8_parts_unmerged']:,} FP8 message parts before merging), cuda_ipc "
          f"{out['cuda_ipc_copies']:,}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
