"""GPU check 2: the bound CUDA FP8 kernel (megarl._C.fp8_e4m3_quantize_rows_cuda) against the torch
reference (megarl/ddma/quantize.py quantize_per_channel_ref), bit for bit: e4m3 codes and scales, on
bf16 / f16 / f32 rows spanning six decades, an all-zero row, both scale floors, a strided view.
Prints one JSON line; exit 1 on any difference. ``MEGARL_GPU_CHECK_PLANT=fp8`` flips one code on
purpose (the check must fail). ``--cpu-dry``: runs the reference against itself on CPU (control flow only).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megarl import native  # noqa: E402
from megarl.ddma.quantize import VLLM_FP8_MIN_SCALE, quantize_per_channel_ref  # noqa: E402


def main() -> int:
    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "fp8"
    fn = native.native_function("fp8_e4m3_quantize_rows_cuda")
    if dry:
        fn = quantize_per_channel_ref
    if fn is None:
        print(json.dumps({"fp8_kernel": {"ok": False, "error": "megarl._C has no fp8_e4m3_quantize_rows_cuda "
                                                                 "(not built with CUDA)"}}))
        return 1
    dev = "cpu" if dry else "cuda"
    cases, bad = 0, []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, cols in ((64, 4096), (37, 255), (5, 1), (3, 5000)):
            g = torch.Generator().manual_seed(rows * cols)
            x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
            x[min(1, rows - 1)] = 0
            views = [x, torch.cat([x, x], dim=1)[:, cols // 2:cols // 2 + cols]]  # contiguous, strided
            for xv in views:
                for min_scale in (1e-12, VLLM_FP8_MIN_SCALE):
                    q, s = fn(xv.to(dev), min_scale)
                    q, s = q.cpu(), s.cpu()
                    if plant and cases == 0:
                        q = q.clone()
                        q.view(-1)[0] ^= 1
                    for where in ("cpu", dev):
                        rq, rs = quantize_per_channel_ref(xv.to(where), min_scale)
                        if not (torch.equal(q, rq.cpu()) and torch.equal(s, rs.cpu())):
                            bad.append(f"{dtype} {rows}x{cols} stride {xv.stride()} min_scale {min_scale:g} vs "
                                       f"reference on {where}: {int((q != rq.cpu()).sum())} codes, "
                                       f"{int((s != rs.cpu()).sum())} scales differ")
                    cases += 1
    ok = not bad and cases > 0
    print(json.dumps({"fp8_kernel": {"ok": ok, "cases": cases, "problems": bad[:5]}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
