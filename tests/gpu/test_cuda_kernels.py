"""csrc/cuda/fp8_quant.cu on a real GPU: bit-exact against torch's own e4m3 conversion.

CPU machines only compile the .cu (tools/compile_cuda.sh, in CI); these tests run where CUDA is.
The kernel is built stand-alone with nvcc into a shared library and called through ctypes with
torch-allocated CUDA buffers, so no torch C++ binding is involved.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
FP8_E4M3_MAX = 448.0
CUDA_ERROR_INVALID_VALUE = 1


@pytest.fixture(scope="module")
def fp8_lib(tmp_path_factory):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found: the CUDA toolkit is needed to build csrc/cuda/fp8_quant.cu")
    library = tmp_path_factory.mktemp("cuda") / "libmegarl_fp8.so"
    subprocess.run(
        [nvcc, "-arch=native", "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC",
         f"-I{REPO / 'csrc'}", str(REPO / "csrc/cuda/fp8_quant.cu"), "-o", str(library)],
        check=True,
    )
    lib = ctypes.CDLL(str(library))
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    for name in ("bf16", "f16", "f32"):
        fn = getattr(lib, f"megarl_fp8_e4m3_quantize_rows_{name}")
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.megarl_fp8_e4m3_dequantize_rows_bf16.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.megarl_fp8_e4m3_dequantize_rows_bf16.restype = ctypes.c_int
    return lib


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _quantize(lib, x: torch.Tensor, min_scale: float = 1e-12):
    suffix = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[x.dtype]
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    rc = getattr(lib, f"megarl_fp8_e4m3_quantize_rows_{suffix}")(
        x.data_ptr(), rows, cols, x.stride(0), min_scale, q.data_ptr(), scales.data_ptr(), _stream())
    torch.cuda.synchronize()
    assert rc == 0, f"launch failed with cudaError {rc}"
    return q, scales


def _reference(x: torch.Tensor, min_scale: float = 1e-12):
    """megarl/ddma/quantize.py's torch reference, on x's device (true float32 divisions)."""
    from megarl.ddma.quantize import quantize_per_channel_ref

    q, scales = quantize_per_channel_ref(x, min_scale)
    return q.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [1, 255, 4096, 5000])
def test_quantize_rows_matches_torch(fp8_lib, dtype, cols):
    generator = torch.Generator(device="cuda").manual_seed(cols)
    row_scale = torch.logspace(-3, 2, 37, device="cuda")[:, None]
    x = (torch.randn(37, cols, device="cuda", generator=generator) * row_scale).to(dtype)
    x[5] = 0  # an all-zero row takes min_scale instead of dividing by zero
    q, scales = _quantize(fp8_lib, x)
    ref_q, ref_scales = _reference(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert q.float().abs().amax(dim=1)[torch.arange(37, device="cuda") != 5].eq(FP8_E4M3_MAX).all()


def test_quantize_rows_respects_row_stride(fp8_lib):
    wide = torch.randn(16, 700, device="cuda", dtype=torch.bfloat16)
    view = wide[:, 100:612]  # rows 700 elements apart, 512 used
    q, scales = _quantize(fp8_lib, view)
    ref_q, ref_scales = _reference(view.contiguous())
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_dequantize_round_trip_error_is_fp8_sized(fp8_lib):
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    q, scales = _quantize(fp8_lib, x)
    out = torch.empty_like(x)
    rc = fp8_lib.megarl_fp8_e4m3_dequantize_rows_bf16(
        q.data_ptr(), scales.data_ptr(), 64, 1024, out.data_ptr(), _stream())
    torch.cuda.synchronize()
    assert rc == 0
    # the kernel does the same one fp32 multiply and RNE cast to bf16: bit-identical
    torch.testing.assert_close(out, (q.float() * scales[:, None]).to(torch.bfloat16), rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step.
    bound = x.float().abs() * (2**-4 + 2**-8) + scales[:, None] * 2**-9
    assert ((out.float() - x.float()).abs() <= bound).all()


def test_bad_arguments_are_rejected(fp8_lib):
    x = torch.randn(4, 8, device="cuda")
    q = torch.empty(4, 8, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(4, device="cuda")
    fn = fp8_lib.megarl_fp8_e4m3_quantize_rows_f32
    # row stride shorter than a row, then a non-positive min_scale
    assert fn(x.data_ptr(), 4, 8, 4, 1e-12, q.data_ptr(), scales.data_ptr(), _stream()) == CUDA_ERROR_INVALID_VALUE
    assert fn(x.data_ptr(), 4, 8, 8, 0.0, q.data_ptr(), scales.data_ptr(), _stream()) == CUDA_ERROR_INVALID_VALUE
