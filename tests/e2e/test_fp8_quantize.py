"""FP8 e4m3 per-channel quantization (megarl/ddma/quantize.py, csrc/fp8_quant_cpu.cpp).

The C++ kernel must be bit-exact with the torch reference (codes and scales, every dtype and
layout), the round trip must stay within the e4m3 half-step bound, bad arguments must raise, and
vLLM's own CPU per-channel re-quantization of our dequantized weights must give back our codes
and scales (derivations in megarl/ddma/quantize.py's docstring).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import megarl.native as native
from megarl.ddma import quantize as fq
from megarl.ddma.quantize import (
    FP8_E4M3_MAX,
    VLLM_FP8_MIN_SCALE,
    dequantize_per_channel,
    dequantize_per_channel_ref,
    quantize_per_channel,
    quantize_per_channel_ref,
)

# CI builds the extension and sets MEGARL_REQUIRE_NATIVE=1 so a broken build fails instead of skipping.
requires_native = pytest.mark.skipif(
    not native.HAS_NATIVE and os.environ.get("MEGARL_REQUIRE_NATIVE") != "1",
    reason="megarl._C not built (pip install --no-build-isolation --no-deps -e .)",
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Unit roundoff (half an ulp at 1) of each output dtype: 8, 11 and 24 significant bits.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# Half the smallest subnormal of each output dtype: the absolute rounding error below its normals.
HALF_TINIEST = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float32: 2.0**-150}


def _native_quantize(x, min_scale=1e-12):
    return native._C.fp8_e4m3_quantize_rows(x, min_scale)


def _native_dequantize(q, scales, dtype):
    return native._C.fp8_e4m3_dequantize_rows(q, scales, dtype)


def _rows(dtype: torch.dtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows spanning many magnitudes (into float32's subnormals), with special rows."""
    generator = torch.Generator().manual_seed(seed)
    # float16 spans 6e-8..65504, bf16/f32 far more: go down to where x / scale hits e4m3 subnormals
    # and, for float32, to float32 subnormal inputs.
    low, high = (-6.0, 4.0) if dtype == torch.float16 else (-40.0, 30.0)
    magnitude = torch.logspace(low, high, max(rows, 1))[:rows, None]
    x = torch.randn(rows, cols, generator=generator) * magnitude
    # Heavy tails inside a row: many entries land in the e4m3 subnormal range (|x/scale| < 2^-6).
    x = x * torch.rand(rows, cols, generator=generator).pow(8)
    x = x.to(dtype)
    if rows > 3 and cols:
        x[1] = 0.0  # all-zero row: scale = min_scale, codes all zero
        x[2] = -0.0  # all negative zeros: codes 0x80
        x[3, ::2] = -x[3, ::2]
        x[3, 0] = -0.0
    return x


def _assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    (qa, sa), (qb, sb) = a, b
    assert qa.dtype == qb.dtype == torch.uint8 and sa.dtype == sb.dtype == torch.float32
    assert torch.equal(sa, sb), (sa - sb).abs().max()
    mismatch = (qa != qb).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} codes differ, first at {mismatch[0].tolist()}"


# --------------------------------------------------------------------------- native vs reference


@requires_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 4096), (7, 1), (37, 255), (64, 1001), (5, 0), (0, 7)])
def test_native_matches_reference(dtype, shape):
    x = _rows(dtype, *shape, seed=shape[0] * 7919 + shape[1])
    _assert_same(_native_quantize(x), quantize_per_channel_ref(x))
    for min_scale in (VLLM_FP8_MIN_SCALE, 0.5):  # a floor that binds for many rows
        _assert_same(_native_quantize(x, min_scale), quantize_per_channel_ref(x, min_scale))


@requires_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_respects_row_stride(dtype):
    wide = _rows(dtype, 48, 700, seed=3)
    view = wide[:, 100:612]  # rows 700 elements apart, 512 used
    assert view.stride() == (700, 1)
    _assert_same(_native_quantize(view), quantize_per_channel_ref(view.contiguous()))
    every_other_row = wide[::2, :333]
    _assert_same(_native_quantize(every_other_row), quantize_per_channel_ref(every_other_row.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrapper_accepts_any_layout(dtype):
    """quantize_per_channel copies a non-unit column stride (e.g. a transposed weight) first."""
    x = _rows(dtype, 40, 24, seed=4).t()
    assert x.stride(1) != 1
    _assert_same(quantize_per_channel(x), quantize_per_channel_ref(x.contiguous()))


@requires_native
def test_native_rejects_non_unit_column_stride():
    with pytest.raises(ValueError, match="unit column stride"):
        _native_quantize(torch.randn(8, 4).t())


@requires_native
def test_float32_to_e4m3_conversion_is_torchs():
    """With the row max at 448 the scale is exactly 1 and x / 1 = x, so the codes are the bare
    float32 -> e4m3 conversion: compare it with torch's over a dense sweep of [0, 448] (every
    997th float32 bit pattern) plus every e4m3 rounding midpoint and its float32 neighbours."""
    sweep = torch.arange(0, 0x43E00001, 997, dtype=torch.int64).to(torch.int32).view(torch.float32)
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    midpoints = (codes[:-1] + codes[1:]) / 2  # exact in float32 (5 significant bits)
    bits = midpoints.view(torch.int32)
    near = torch.cat([bits - 1, bits, bits + 1]).view(torch.float32)
    values = torch.cat([torch.tensor([FP8_E4M3_MAX]), sweep, near, codes])
    x = torch.cat([values, -values])[None]
    q, scales = _native_quantize(x)
    assert scales.item() == 1.0
    assert torch.equal(q, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


@requires_native
@pytest.mark.parametrize("quantize", [_native_quantize, quantize_per_channel_ref], ids=["cpp", "ref"])
def test_hand_computed_codes(quantize):
    """Codes worked out by hand, independent of torch's conversion (scale 1: row max 448)."""
    unit = 2.0**-9  # smallest e4m3 subnormal
    cases = [  # (value, code); a list, since 0.0 and -0.0 are the same dict key
        (448.0, 0x7E), (-448.0, 0xFE), (1.0, 0x38), (-1.0, 0xB8), (0.0, 0x00), (-0.0, 0x80),
        (2.0**-6, 0x08),  # smallest normal
        (7 * unit, 0x07), (0.5 * unit, 0x00), (1.5 * unit, 0x02), (2.5 * unit, 0x02),  # ties to even
        (7.5 * unit, 0x08),  # rounds up into the normals
        (-(2.0**-12), 0x80),  # below half the smallest subnormal: a signed zero
        (1.0625, 0x38), (1.1875, 0x3A),  # ties between 1, 1.125 and 1.25: to the even mantissa
        (240.0, 0x77), (416.0, 0x7D), (424.0, 0x7D),
        (432.0, 0x7E),  # the 416/448 midpoint: to even, 448
    ]
    x = torch.tensor([[value for value, _ in cases]], dtype=torch.float32)
    q, scales = quantize(x)
    assert scales.item() == 1.0
    assert q[0].tolist() == [code for _, code in cases]


@requires_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_max_maps_to_448_and_saturates(dtype):
    """Every nonzero row's absmax becomes exactly +-448 (code 0x7E/0xFE), including the ~8% of rows
    where absmax / fl(absmax / 448) rounds a hair above 448."""
    x = _rows(dtype, 200, 64, seed=5)
    x[:, 0] = torch.linspace(1.0, 100.0, 200).to(dtype) * torch.where(torch.arange(200) % 2 == 0, 1.0, -1.0).to(dtype)
    absmax = x.float().abs().amax(dim=1)
    above = absmax / (absmax / FP8_E4M3_MAX) > FP8_E4M3_MAX
    assert above.any()  # the rounding case is exercised
    q, scales = _native_quantize(x)
    max_codes = q.view(torch.float8_e4m3fn).float().abs().amax(dim=1)
    assert (max_codes == FP8_E4M3_MAX).all()
    assert not (q & 0x7F == 0x7F).any()  # never a NaN code
    _assert_same((q, scales), quantize_per_channel_ref(x))


@requires_native
def test_special_rows():
    x = torch.zeros(4, 16)
    x[2] = -0.0
    x[3, 5] = 1e-45  # a float32 subnormal: scale = max(1e-45 / 448 = 0, min_scale)
    q, scales = _native_quantize(x)
    assert scales.tolist() == [pytest.approx(1e-12, rel=1e-7)] * 4
    assert (q[:2] == 0).all() and (q[2] == 0x80).all()
    _assert_same((q, scales), quantize_per_channel_ref(x))


# ----------------------------------------------------------------------------------- dequantize


@requires_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_reference_for_every_code(dtype):
    q = torch.arange(256, dtype=torch.uint8).repeat(9, 3)  # all codes, NaN codes 0x7F/0xFF included
    scales = torch.logspace(-30, 3, 9, dtype=torch.float32)
    scales[4] = 1.0
    out, ref = _native_dequantize(q, scales, dtype), dequantize_per_channel_ref(q, scales, dtype)
    assert out.dtype == dtype
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan) and nan.sum() == 2 * 3 * 9
    # bit-exact (signed zeros included) except NaN payloads
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.masked_fill(nan, 0).view(bits), ref.masked_fill(nan, 0).view(bits))
    # float8 codes are accepted as well as their uint8 bits
    assert torch.equal(dequantize_per_channel(q.view(torch.float8_e4m3fn), scales, dtype)
                       .masked_fill(nan, 0).view(bits), ref.masked_fill(nan, 0).view(bits))
    # a non-contiguous q (any row stride) works too
    strided = q[:, 100:500]
    assert torch.equal(_native_dequantize(strided, scales, dtype).masked_fill(nan[:, 100:500], 0).view(bits),
                       ref[:, 100:500].masked_fill(nan[:, 100:500], 0).view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_within_half_step(dtype):
    """|dequantize(quantize(x)) - x| <= (2^-4 |x| + 2^-10 scale)(1 + u) + (u + 2^-22)|x| + h.

    e4m3 has 3 mantissa bits (4 significant): rounding t = x / scale to the nearest code errs by
    at most half a step, 2^-4 |t| for normal codes and 2^-10 (half the 2^-9 subnormal step) below
    2^-6. Scaling back by `scale` and rounding to the output dtype (unit roundoff u; absolute h,
    half its smallest subnormal, where the result lands below its normals) gives the bound;
    2^-22 covers the float32 divide and multiply (2^-24 relative each)."""
    x = _rows(dtype, 64, 1024, seed=6)
    q, scales = quantize_per_channel(x)
    out = dequantize_per_channel(q, scales, dtype)
    assert out.dtype == dtype
    u = UNIT_ROUNDOFF[dtype]
    xf, s = x.float().double(), scales.double()[:, None]
    bound = (2.0**-4 * xf.abs() + 2.0**-10 * s) * (1 + u) + (u + 2.0**-22) * xf.abs() + HALF_TINIEST[dtype]
    error = (out.double() - xf).abs()
    assert (error <= bound).all(), (error - bound).max()
    assert torch.equal(out.signbit(), x.signbit())  # signed zeros survive
    # the bound is not loose: some element uses more than half of it
    assert (error > bound / 2).any()


# ------------------------------------------------------------------------------ bad arguments


def _quantizers():
    impls = [pytest.param(quantize_per_channel, id="wrapper"), pytest.param(quantize_per_channel_ref, id="ref")]
    impls.append(pytest.param(_native_quantize, id="cpp", marks=requires_native))
    return impls


@pytest.mark.parametrize("quantize", _quantizers())
def test_bad_arguments_raise(quantize):
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(16))  # a norm weight: not quantized by DDMA
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize(torch.ones(4, 4, dtype=torch.int32))
    for min_scale in (0.0, -1.0, float("inf"), 1e-50):  # 1e-50 is 0 in float32
        with pytest.raises(ValueError, match="min_scale"):
            quantize(torch.randn(4, 4), min_scale)
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(5, 8)
        x[3, 2] = bad
        with pytest.raises(ValueError, match="row 3 contains inf or NaN"):
            quantize(x)


@pytest.mark.parametrize("dequantize", [
    pytest.param(dequantize_per_channel, id="wrapper"), pytest.param(dequantize_per_channel_ref, id="ref"),
    pytest.param(_native_dequantize, id="cpp", marks=requires_native)])
def test_dequantize_bad_arguments_raise(dequantize):
    q, scales = torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4)
    with pytest.raises(ValueError, match="2-D"):
        dequantize(q[0], scales, torch.bfloat16)
    with pytest.raises(TypeError, match="uint8"):
        dequantize(q.float(), scales, torch.bfloat16)
    with pytest.raises(ValueError, match="one per row"):
        dequantize(q, torch.ones(3), torch.bfloat16)
    with pytest.raises(TypeError, match="float32"):
        dequantize(q, scales.double(), torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        dequantize(q, scales, torch.float64)


@requires_native
def test_native_is_cpu_only():
    """The C++ CPU kernels reject other devices (meta stands in for CUDA on a CUDA-less machine),
    and a torch without CUDA builds no CUDA binding at all."""
    with pytest.raises(ValueError, match="CPU tensor"):
        _native_quantize(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="CPU tensor"):
        _native_dequantize(torch.empty(4, 4, dtype=torch.uint8, device="meta"), torch.ones(4), torch.bfloat16)
    if torch.version.cuda is None:
        assert not hasattr(native._C, "fp8_e4m3_quantize_rows_cuda")


def test_fallback_warns_once_and_matches(monkeypatch):
    monkeypatch.setattr(native, "_C", None)
    monkeypatch.setattr(native, "HAS_NATIVE", False)
    monkeypatch.setattr(fq, "_warned", False)
    x = _rows(torch.bfloat16, 9, 33, seed=7)
    with pytest.warns(RuntimeWarning, match="pure-torch reference"):
        result = quantize_per_channel(x)
    _assert_same(result, quantize_per_channel_ref(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_per_channel(x)  # the second call is silent
        dequantize_per_channel(*result, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernel_matches_torch_reference_bit_for_bit(dtype):
    """The bound CUDA kernel (csrc/cuda/fp8_quant.cu via megarl._C.fp8_e4m3_quantize_rows_cuda, what
    quantize_per_channel and the DDMA sender call on CUDA tensors) equals the torch reference bit for
    bit, e4m3 codes and scales, against the reference run on the GPU and on the CPU (both divide
    truly in float32). Rows span six decades, one is all zero (min_scale), one is a strided view."""
    fn = native.native_function("fp8_e4m3_quantize_rows_cuda")
    if fn is None:
        assert os.environ.get("MEGARL_REQUIRE_NATIVE") != "1", "megarl._C was built without its CUDA kernels"
        pytest.skip("megarl._C built without CUDA kernels")
    for rows, cols in ((64, 4096), (37, 255), (5, 1)):
        x = _rows(dtype, rows, cols, seed=8 + cols)
        x[1] = 0
        for min_scale in (1e-12, VLLM_FP8_MIN_SCALE):
            q, scales = quantize_per_channel(x.cuda(), min_scale)
            assert q.is_cuda and q.dtype == torch.uint8
            raw_q, raw_scales = fn(x.cuda(), min_scale)  # the binding itself
            assert torch.equal(raw_q, q) and torch.equal(raw_scales, scales)
            for ref_q, ref_scales in (quantize_per_channel_ref(x.cuda(), min_scale), quantize_per_channel_ref(x, min_scale)):
                assert torch.equal(scales.cpu(), ref_scales.cpu())
                assert torch.equal(q.cpu(), ref_q.cpu())
    wide = _rows(dtype, 16, 700, seed=3).cuda()
    view = wide[:, 100:612]  # row stride 700, 512 used
    q, scales = quantize_per_channel(view)
    ref_q, ref_scales = quantize_per_channel_ref(view.contiguous().cpu())
    assert torch.equal(q.cpu(), ref_q) and torch.equal(scales.cpu(), ref_scales)
    out = dequantize_per_channel(q, scales, torch.bfloat16)
    assert torch.equal(out.cpu(), dequantize_per_channel_ref(q.cpu(), scales.cpu(), torch.bfloat16))
    bad = x.cuda()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="row 3 contains inf or NaN"):
        quantize_per_channel(bad)


# -------------------------------------------------------------------- vLLM's re-quantization


@pytest.fixture(scope="module")
def vllm_fp8():
    """vLLM's online per-channel FP8 weight quantizer, the pure-torch code
    Fp8PtpcOnlineLinearMethod.process_weights_after_loading runs on CPU (TP 1)."""
    online = pytest.importorskip("vllm.model_executor.layers.quantization.online.fp8")
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    def requantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = online._fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
        q = online._fp8_quant_per_channel(w, scale)
        return q.view(torch.uint8), scale.reshape(-1)

    # Our constant is vLLM's floor, computed the same way.
    assert online._fp8_channel_scale(torch.zeros(1)).item() == VLLM_FP8_MIN_SCALE
    return requantize


def _weights(dtype: torch.dtype) -> torch.Tensor:
    """Weight-like rows (std 1e-6 .. 1) straddling vLLM's floor (absmax ~2^-9), plus a zero row."""
    generator = torch.Generator().manual_seed(9)
    w = torch.randn(96, 1024, generator=generator) * torch.logspace(-6, 0, 96)[:, None]
    w[10] = 0.0
    return w.to(dtype)


def test_vllm_requantization_is_identity(vllm_fp8):
    """bf16 weight -> ours -> bf16 -> vLLM: identical codes and scales on every row whose scale is
    at or above vLLM's floor; below it vLLM re-rounds on its own grid, within its rounding bound."""
    w = _weights(torch.bfloat16)
    q, scales = quantize_per_channel(w)
    received = dequantize_per_channel(q, scales, torch.bfloat16)
    vq, vscales = vllm_fp8(received)
    above = scales >= VLLM_FP8_MIN_SCALE
    assert 10 < above.sum() < len(above) - 10  # both regimes are exercised
    assert torch.equal(vscales[above], scales[above])
    assert torch.equal(vq[above], q[above])
    # Below the floor: vLLM's scale is the floor, and q' * s_v is within half an e4m3 step of
    # what it received: |q' s_v - w'| <= 2^-4 |w'| + 2^-10 s_v (|w'| / s_v < 448: no
    # saturation), plus 2^-22 |w'| for its float32 divide and our float32 multiply.
    assert (vscales[~above] == VLLM_FP8_MIN_SCALE).all()
    got = vq[~above].view(torch.float8_e4m3fn).double() * VLLM_FP8_MIN_SCALE
    sent = received[~above].double()
    bound = (2.0**-4 + 2.0**-22) * sent.abs() + 2.0**-10 * VLLM_FP8_MIN_SCALE
    assert ((got - sent).abs() <= bound).all()


def test_vllm_requantization_with_vllm_floor_is_identity_on_every_row(vllm_fp8):
    """min_scale=VLLM_FP8_MIN_SCALE: the round trip through vLLM is the identity on all rows."""
    w = _weights(torch.bfloat16)
    q, scales = quantize_per_channel(w, VLLM_FP8_MIN_SCALE)
    vq, vscales = vllm_fp8(dequantize_per_channel(q, scales, torch.bfloat16))
    assert (scales == VLLM_FP8_MIN_SCALE).sum() > 10
    assert torch.equal(vscales, scales)
    assert torch.equal(vq, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vllm_requantization_of_wider_originals(vllm_fp8, dtype):
    """From a float32/float16 master weight the row max is rounded to bf16 on the way, so vLLM's
    scale moves by at most 2^-8 + 2^-22 relative (bf16 rounding plus two float32 roundings), while
    the codes still come back identical (their relative drift <= 2^-7 + 2^-21 < 2^-5, the nearest
    rounding midpoint)."""
    w = _weights(dtype)
    q, scales = quantize_per_channel(w)
    vq, vscales = vllm_fp8(dequantize_per_channel(q, scales, torch.bfloat16))
    # rows clear of vLLM's floor even after the scale moves by that much
    clear = scales >= VLLM_FP8_MIN_SCALE * (1 + 2.0**-7)
    assert clear.sum() > 10
    assert ((vscales[clear].double() / scales[clear].double() - 1).abs() <= 2.0**-8 + 2.0**-22).all()
    assert torch.equal(vq[clear], q[clear])
