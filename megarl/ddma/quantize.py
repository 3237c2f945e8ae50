"""FP8 e4m3 per-output-channel weight quantization for DDMA weight sync (halves the bytes sent).

For a 2-D weight ``x`` ``[rows, cols]`` (a Linear weight ``[out_features, in_features]``: a row is
an output channel)::

    scale[r] = max(fl32(absmax(x[r, :]) / 448), fl32(min_scale))      # float32 true division
    q[r, c]  = e4m3(clamp(fl32(float(x[r, c]) / scale[r]), -448, 448))  # round to nearest even

so ``x ~= q * scale[r]``. ``q`` travels as ``uint8`` holding the e4m3 bit patterns (gloo cannot
send float8 tensors; ``q.view(torch.float8_e4m3fn)`` is free) and ``scale`` as float32. The CPU
kernel (``megarl._C.fp8_e4m3_quantize_rows``, csrc/fp8_quant_cpu.cpp) is bit-exact with
``quantize_per_channel_ref``. Only 2-D tensors are quantized: DDMA sends 1-D ones (norm weights,
biases) as they are, so ``quantize_per_channel`` raises ValueError for any other rank. Rows that
contain inf or NaN raise ValueError (a diverged weight should fail loudly, not ship as NaN codes);
-0.0 stays -0.0.

Round-trip error. e4m3 keeps 4 significant bits (3 stored), so rounding ``t = x / scale`` to the
nearest code errs by at most half a code step: ``2^-4 * |t|`` for normal codes (step ``2^(e-3)``
for ``2^e <= |t|``) and ``2^-10`` below 2^-6 (subnormal step 2^-9). Multiplying back by the scale
and rounding to the output dtype (unit roundoff ``u``: 2^-8 bf16, 2^-11 f16, 2^-24 f32) gives
``|dequantize(q) - x| <= (2^-4 * |x| + 2^-10 * scale) * (1 + u) + (u + 2^-22) * |x| + h`` per
element, the 2^-22 covering the float32 division and multiply (each 2^-24 relative) and ``h``
(half the output dtype's smallest subnormal, 2^-25 for f16) results below its normal range.

Compatibility with vLLM's re-quantization (``generator.quantization=fp8_per_channel``, the one FP8
mode on CPU). The receiver dequantizes ``(q, scale)`` to the engine dtype (bf16) and vLLM
re-quantizes the weight with ``Fp8PtpcOnlineLinearMethod.process_weights_after_loading``
(vllm 0.32, vllm/model_executor/layers/quantization/online/fp8.py:440-460), which on CPU is plain
torch: ``amax = weight_amax(w, dim=-1)`` (utils/quant_utils.py:40-45),
``scale = (amax.float() / tensor(448.)).clamp_min(1.0 / (tensor(448.) * 512))``
(``_fp8_channel_scale``, online/fp8.py:79-86) and
``q = (w / scale).clamp_(-448, 448).to(float8_e4m3fn)`` (``_fp8_quant_per_channel``, online/fp8.py:94-104:
true division on purpose, as here). That is our formula except the floor: vLLM clamps scales at
``VLLM_FP8_MIN_SCALE = fl32(1 / 229376) ~= 4.36e-6`` (rows with absmax below ~2^-9), our default
``min_scale`` is 1e-12. Consequences, for a bf16 weight ``w`` and ``w' = bf16(q * scale)``:

* Rows whose scale is at least VLLM_FP8_MIN_SCALE come back bit-identical, codes and scales.
  Scale: the row's largest element quantizes to exactly +-448 (``A / fl32(A / 448)`` is within
  two float32 ulps of 448, far from the 432 midpoint with 416), so vLLM sees ``A' = bf16(fl32(448 *
  scale))``; that is within 2^-23 relative of ``A``, which is a bf16 value whose neighbours are
  >= 2^-8 relative away, so ``A' = A`` and vLLM's scale is ours. Codes: ``w' / scale`` is ``q``
  times ``(1 + r)`` with ``|r| <= 2^-8 + 2^-22`` (bf16 rounding plus two float32 roundings), while
  the nearest rounding midpoint is at least 2^-5 relative away from any nonzero code (a power of
  two's lower neighbour; 1/14 for subnormal codes), so vLLM rounds back to ``q``; zeros stay
  signed zeros. For float32/float16 originals ``A'`` is ``A`` rounded to bf16, so vLLM's scale is
  off by at most ``2^-8 + 2^-22`` relative; the codes still match (``|r| <= 2^-7 + 2^-21 < 2^-5``).
* Rows with a smaller scale (absmax below ~2^-9, including all-zero rows) are re-quantized by vLLM
  on its coarser grid ``VLLM_FP8_MIN_SCALE``: its result differs from ours but is within vLLM's own
  rounding bound of what it received, ``|q' * s_v - w'| <= 2^-4 * |w'| + 2^-10 * s_v`` (no
  saturation: ``|w'| / s_v < 448``).
* With ``min_scale=VLLM_FP8_MIN_SCALE`` every row is bit-identical (a clamped row's largest code
  is at most 448, whose dequantized bf16 value is exactly 2^-9 and 2^-9 / 448 is the floor again),
  and nothing is lost: vLLM would apply that floor on receipt anyway.

On CUDA tensors ``quantize_per_channel`` uses csrc/cuda/fp8_quant.cu when the extension was built
with CUDA (the DDMA sender calls it for CUDA parameters with ``sync.wire=fp8``, so codes are made
on the device). It is bit-identical to ``quantize_per_channel_ref`` run on the same device, codes
and scales: both divide truly in float32 (the kernel's ``x / scale`` and ``absmax / 448`` compile
to IEEE division; the reference divides by a tensor, never by a Python float, which torch's CUDA
kernel would turn into a multiply by the reciprocal) and round to nearest even, saturating at
448. ``tests/e2e/test_fp8_quantize.py::test_cuda_kernel_matches_torch_reference_bit_for_bit`` (``gpu``)
and ``tools/gpu_fp8_check.py`` check it. Without the CUDA build, CUDA tensors go through the torch
reference, which runs on any device.

No vLLM or Megatron imports here: DDMA senders run in the trainer.
"""

from __future__ import annotations

import os
import warnings

import torch

import megarl.native as native

FP8_E4M3_MAX = 448.0
DEFAULT_MIN_SCALE = 1e-12
# vLLM's per-channel scale floor, `1.0 / (fp8_max * 512)` in float32 (online/fp8.py:84-86).
VLLM_FP8_MIN_SCALE = float(torch.tensor(1.0) / (torch.tensor(FP8_E4M3_MAX) * 512))
QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_warned = False


def _warn_fallback_once(reason: str) -> None:
    global _warned
    # `megarl train` already named this fallback in its one start-up warning (megarl.native)
    if not _warned and os.environ.get(native.ANNOUNCED_ENV) != "1":
        _warned = True
        warnings.warn(
            f"{reason}; quantize_per_channel uses the slower pure-torch reference. Build the C++ "
            "extension with `pip install --no-build-isolation -e .` from the repository root.",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_input(x: torch.Tensor, min_scale: float) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"quantize_per_channel takes a 2-D [rows, cols] weight, got shape {tuple(x.shape)}: "
            "DDMA sends 1-D tensors (norm weights, biases) unquantized"
        )
    if x.dtype not in QUANTIZABLE_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    min_scale_f32 = float(torch.tensor(min_scale, dtype=torch.float32))
    if not (min_scale_f32 > 0.0 and min_scale_f32 != float("inf")):
        raise ValueError(f"min_scale must be positive and finite in float32, got {min_scale}")


def _check_codes(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [rows, cols], got shape {tuple(q.shape)}")
    if q.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"q must be uint8 (e4m3 bits) or float8_e4m3fn, got {q.dtype}")
    if scales.dim() != 1 or scales.shape[0] != q.shape[0]:
        raise ValueError(f"scales must be 1-D with {q.shape[0]} entries (one per row of q), "
                         f"got shape {tuple(scales.shape)}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {scales.dtype}")
    if dtype not in QUANTIZABLE_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")


def quantize_per_channel_ref(
    x: torch.Tensor, min_scale: float = DEFAULT_MIN_SCALE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference: ``(q uint8 [rows, cols] of e4m3 bits, scales float32 [rows])``."""
    _check_input(x, min_scale)
    xf = x.float()
    # amax over an empty dim is an error in torch; a row without columns has absmax 0.
    absmax = xf.abs().amax(dim=1) if x.shape[1] else xf.new_zeros(x.shape[0])
    bad = (~torch.isfinite(absmax)).nonzero()
    if bad.numel():
        raise ValueError(f"x row {int(bad[0])} contains inf or NaN; FP8 quantization needs finite values")
    # A tensor divisor, not a Python float: torch's CUDA division by a CPU scalar multiplies by its
    # float32 reciprocal (BinaryDivTrueKernel.cu), one ulp off a true division; tensor / tensor
    # divides truly on every device, as the C++ and CUDA kernels do. clamp_min rounds min_scale to
    # float32, as both kernels do.
    scales = (absmax / torch.full_like(absmax, FP8_E4M3_MAX)).clamp_min(min_scale)
    q = (xf / scales[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scales


def dequantize_per_channel_ref(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pure-torch reference: ``(float(q[r, c]) * scales[r]).to(dtype)``."""
    _check_codes(q, scales, dtype)
    codes = q if q.dtype == torch.float8_e4m3fn else q.view(torch.float8_e4m3fn)
    return (codes.float() * scales[:, None]).to(dtype)


def _native(name: str):
    return getattr(native._C, name, None) if native.HAS_NATIVE else None


def quantize_per_channel(
    x: torch.Tensor, min_scale: float = DEFAULT_MIN_SCALE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise absmax FP8 e4m3 quantization of a 2-D weight (see the module docstring).

    Returns ``(q, scales)``: ``q`` uint8 ``[rows, cols]`` holding e4m3 bits, ``scales`` float32
    ``[rows]``, on ``x``'s device. Raises ValueError for a tensor that is not 2-D, a row with
    inf/NaN or a non-positive ``min_scale``, TypeError for a dtype other than bf16/f16/f32.
    """
    _check_input(x, min_scale)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernels take any row stride but need unit column stride
    if x.device.type == "cpu":
        fn = _native("fp8_e4m3_quantize_rows")
        if fn is not None:
            return fn(x, min_scale)
        _warn_fallback_once(
            "megarl._C has no fp8_e4m3_quantize_rows (stale build)" if native.HAS_NATIVE
            else f"megarl._C (the C++ extension) is not available ({native._IMPORT_ERROR})")
    elif x.device.type == "cuda":
        fn = _native("fp8_e4m3_quantize_rows_cuda")
        if fn is not None and native.cuda_kernels_for(x.device):
            q, scales = fn(x, min_scale)
            # The CUDA kernel does not check for inf/NaN, but a row holding one always gets a NaN
            # code (x / inf or NaN itself) and finite rows never do (saturation): same policy.
            bad = ((q & 0x7F) == 0x7F).any(dim=1).nonzero()
            if bad.numel():
                raise ValueError(f"x row {int(bad[0])} contains inf or NaN; FP8 quantization needs "
                                 "finite values")
            return q, scales
    return quantize_per_channel_ref(x, min_scale)


def dequantize_per_channel(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(float(q[r, c]) * scales[r]).to(dtype)``: the weight the receiver hands to vLLM.

    ``q`` is uint8 (or float8_e4m3fn) ``[rows, cols]``, ``scales`` float32 ``[rows]``; ``dtype``
    one of bf16/f16/f32. Bit-exact between the C++ kernel and the torch reference.
    """
    _check_codes(q, scales, dtype)
    if q.device.type == "cpu" and scales.device.type == "cpu":
        fn = _native("fp8_e4m3_dequantize_rows")
        if fn is not None:
            return fn(q if q.shape[1] <= 1 or q.stride(1) == 1 else q.contiguous(), scales, dtype)
    elif q.is_cuda and dtype == torch.bfloat16 and scales.device == q.device:
        fn = _native("fp8_e4m3_dequantize_rows_cuda")  # bf16 only; the same multiply and RNE cast
        if fn is not None and native.cuda_kernels_for(q.device):
            return fn(q, scales)
    return dequantize_per_channel_ref(q, scales, dtype)
