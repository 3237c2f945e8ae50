"""GPU check: the bound CUDA FP8 kernels (megarl._C.fp8_e4m3_quantize_rows_cuda and
fp8_e4m3_dequantize_rows_cuda) against the torch reference (megarl/ddma/quantize.py), bit for bit:
e4m3 codes and scales, on bf16 / f16 / f32 rows spanning six decades, an all-zero row, both scale
floors, a view strided *on the device* (``.to(device)`` of a strided host view is contiguous, so the
strided path never ran before), a row of exactly +-448 and round-to-nearest-even ties (normal and
subnormal), an inf row and a NaN row (``quantize_per_channel`` must raise ValueError), and the
dequantization back to bf16. Prints one JSON line; exit 1 on any difference.
``MEGARL_GPU_CHECK_PLANT=fp8`` flips one code on purpose (the check must fail). ``--cpu-dry``: runs
the reference against itself on CPU (control flow only).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megarl import native  # noqa: E402
from megarl.ddma.quantize import (VLLM_FP8_MIN_SCALE, dequantize_per_channel_ref, quantize_per_channel,  # noqa: E402
                                  quantize_per_channel_ref)

# Scale 1 (absmax 448): the values quantize as they are. e4m3 spacing is 2^-3 in [1, 2), 2 in [16, 32),
# 2^-9 below 2^-6 (subnormals): 1.0625, 1.1875, 17, 19, 3 * 2^-10 are ties (round to the even code).
EDGES = [448.0, -448.0, 1.0625, 1.1875, -1.0625, -1.1875, 17.0, 19.0, 3 * 2.0 ** -10, -3 * 2.0 ** -10, 0.0, 1.0]


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
            wide = torch.cat([x, x], dim=1).to(dev)
            views = [x.to(dev), wide[:, cols // 2:cols // 2 + cols]]  # contiguous; row-strided on the device
            assert cols == 1 or views[1].stride(0) == 2 * cols
            for xv in views:
                for min_scale in (1e-12, VLLM_FP8_MIN_SCALE):
                    q, s = fn(xv, min_scale)
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
    # +-448 and ties: exact codes, against the reference and against torch's own e4m3 cast
    edges = torch.tensor([EDGES], dtype=torch.float32)
    q, s = fn(edges.to(dev), 1e-12)
    rq, rs = quantize_per_channel_ref(edges, 1e-12)
    cast = edges.to(torch.float8_e4m3fn).view(torch.uint8)
    if not (torch.equal(q.cpu(), rq) and torch.equal(q.cpu(), cast) and float(s.cpu()[0]) == 1.0):
        bad.append(f"+-448 / ties: kernel {q.cpu().tolist()} reference {rq.tolist()} cast {cast.tolist()}")
    cases += 1
    # inf / NaN rows: the kernel gives a NaN code, quantize_per_channel raises
    for special in (float("inf"), float("nan")):
        x = torch.ones(3, 8)
        x[1, 5] = special
        try:
            quantize_per_channel(x.to(dev), 1e-12) if not dry else quantize_per_channel_ref(x, 1e-12)
            bad.append(f"a row holding {special} did not raise")
        except ValueError as e:
            if "row 1" not in str(e):
                bad.append(f"a row holding {special} raised naming the wrong row: {e}")
        cases += 1
    # dequantize to bf16: the CUDA kernel vs the reference
    deq = dequantize_per_channel_ref if dry else native.native_function("fp8_e4m3_dequantize_rows_cuda")
    if deq is None:
        bad.append("megarl._C has no fp8_e4m3_dequantize_rows_cuda")
    else:
        g = torch.Generator().manual_seed(7)
        x = (torch.randn(33, 700, generator=g) * torch.logspace(-2, 2, 33)[:, None])
        rq, rs = quantize_per_channel_ref(x, VLLM_FP8_MIN_SCALE)
        got = deq(rq.to(dev), rs.to(dev), torch.bfloat16) if dry else deq(rq.to(dev), rs.to(dev))
        want = dequantize_per_channel_ref(rq, rs, torch.bfloat16)
        if not torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)):
            bad.append(f"dequantize: {int((got.cpu() != want).sum())} of {want.numel()} values differ")
        cases += 1
    ok = not bad and cases > 0
    print(json.dumps({"fp8_kernel": {"ok": ok, "cases": cases, "problems": bad[:5]}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
