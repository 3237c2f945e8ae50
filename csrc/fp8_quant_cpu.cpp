// Row-wise (per output channel) absmax FP8 e4m3 quantization on the CPU.
//
// The scheme of csrc/cuda/fp8_quant.cu, for DDMA senders and receivers without a GPU:
//   scale[r] = max(absmax(x[r, :]) / 448, min_scale)                    (float32, true division)
//   q[r, c]  = e4m3(clamp(float(x[r, c]) / scale[r], -448, 448))        (round to nearest even)
// Bit-exact with the pure-torch reference megarl/ddma/quantize.py:quantize_per_channel_ref, i.e.
// `(x.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)` (torch's CPU division by
// a tensor and by a Python float are both IEEE true division; tests/e2e/test_fp8_quantize.py checks).
// The element step divides rather than multiplying by 1/scale: x * fl(1/s) can land one float32
// ulp away from x / s, which flips the e4m3 rounding of a quotient sitting on a midpoint; vLLM's
// own per-channel weight quantizer divides too (see megarl/ddma/quantize.py). The CUDA kernel
// multiplies by the reciprocal today, so its codes can differ by one step (~3e-4 of bf16 codes).
//
// Policy for special values: a row whose absmax is inf or NaN is rejected (ValueError naming the
// row) instead of being sent as garbage; -0.0 stays -0.0 (bits 0x80); scaled values at or below
// half the smallest e4m3 subnormal (2^-10; the tie goes to even, i.e. zero) become a signed zero.
// An all-zero row (or one with no columns) gets scale = min_scale and zero codes.
//
// q is returned as uint8 holding the e4m3 bit patterns: gloo (DDMA's CPU transport) cannot send
// float8 tensors, and `q.view(torch.float8_e4m3fn)` recovers the float8 view for free.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

constexpr float kE4m3Max = 448.0f;
// Rows per parallel chunk: about 32K elements each, so small matrices stay on one thread.
constexpr int64_t kGrainElements = 32768;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 -> e4m3fn bits for any non-NaN v: saturate to +-448, then round to nearest even.
// Straight-line integer code (no branches, no float min/max) so the row loop vectorizes.
inline uint8_t e4m3_from_float(float v) {
  const uint32_t u = bits_of(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  // For non-NaN floats, clamping the magnitude's bit pattern at 448's (0x43E00000) is exactly
  // clamp(v, -448, 448): positive floats order like their bits. x / scale can round a hair
  // above 448 (absmax / fl(absmax / 448)); this saturates it instead of overflowing.
  const uint32_t a = std::min(u & 0x7FFFFFFFu, 0x43E00000u);
  // Normal e4m3 (|v| >= 2^-6): keep 3 of float32's 23 mantissa bits. Adding 0x7FFFF plus the
  // lowest kept bit rounds to nearest even on the integer bits (a carry correctly bumps the
  // exponent); >> 20 leaves [exponent:8 | mantissa:3], and 960 = (127 - 7) << 3 rebiases.
  const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
  // Subnormal e4m3 (|v| < 2^-6): the code is round(|v| / 2^-9). |v| * 512 is exact (power of
  // two) and below 8, so adding 2^23 rounds it to an integer under the default RNE mode and that
  // integer is the low mantissa bits of the sum. A result of 8 is 0x08, the smallest normal.
  const uint32_t subnormal = bits_of(float_of(a) * 512.0f + 8388608.0f) - 0x4B000000u;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < 0x3C800000u);  // 2^-6; all ones
  return static_cast<uint8_t>(((subnormal & is_subnormal) | (normal & ~is_subnormal)) | sign);
}

// e4m3fn bits -> float32 for every code (0x7F and 0xFF are NaN; e4m3fn has no infinities).
std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xF;
    const int mantissa = code & 0x7;
    float magnitude;
    if (exponent == 0xF && mantissa == 0x7) {
      magnitude = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      magnitude = std::ldexp(static_cast<float>(mantissa), -9);
    } else {
      magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    }
    table[code] = (code & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = make_e4m3_table();
  return table;
}

// Per input dtype: the storage bits, and float32 from them without branches (exact), so the row
// loops vectorize. Magnitude bit patterns (sign cleared) order like the values they encode, and
// inf/NaN are exactly the patterns >= kNonFinite: an integer max finds the absmax and flags
// non-finite rows in one pass, with none of float max's NaN caveats.
template <typename T> struct Io;
template <> struct Io<float> {
  using Bits = uint32_t;
  static constexpr Bits kMagnitude = 0x7FFFFFFFu, kNonFinite = 0x7F800000u;
  static Bits bits(float v) { return bits_of(v); }
  static float to_float(Bits b) { return float_of(b); }
};
template <> struct Io<c10::BFloat16> {
  using Bits = uint16_t;
  static constexpr Bits kMagnitude = 0x7FFF, kNonFinite = 0x7F80;
  static Bits bits(c10::BFloat16 v) { return v.x; }
  static float to_float(Bits b) { return float_of(static_cast<uint32_t>(b) << 16); }
};
template <> struct Io<c10::Half> {
  using Bits = uint16_t;
  static constexpr Bits kMagnitude = 0x7FFF, kNonFinite = 0x7C00;
  static Bits bits(c10::Half v) { return v.x; }
  static float to_float(Bits b) { return c10::detail::fp16_ieee_to_fp32_value(b); }
};

void check_2d_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [rows, cols], got ", t.dim(),
                    " dimensions (1-D tensors such as norm weights are not quantized)");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, name,
                    " needs unit column stride (any row stride is fine), got strides ",
                    t.strides(), "; call .contiguous() first");
}

template <typename T>
void quantize_rows(const at::Tensor& x, float min_scale, uint8_t* q, float* scales) {
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  const int64_t row_stride = x.stride(0);
  const T* base = x.const_data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* in = base + r * row_stride;
      uint8_t* out = q + r * cols;
      typename Io<T>::Bits absmax_bits = 0;
      for (int64_t c = 0; c < cols; ++c) {
        absmax_bits = std::max<typename Io<T>::Bits>(absmax_bits,
                                                     Io<T>::bits(in[c]) & Io<T>::kMagnitude);
      }
      if (absmax_bits >= Io<T>::kNonFinite) {
        // Checked (and reported) after the parallel loop: exceptions are best thrown once.
        scales[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float absmax = Io<T>::to_float(absmax_bits);
      const float scale = std::max(absmax / kE4m3Max, min_scale);
      scales[r] = scale;
      for (int64_t c = 0; c < cols; ++c) {
        out[c] = e4m3_from_float(Io<T>::to_float(Io<T>::bits(in[c])) / scale);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fp8_e4m3_quantize_rows(const at::Tensor& x, double min_scale) {
  check_2d_cpu(x, "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
                   "x must be bfloat16, float16 or float32, got ", dtype);
  // The reference clamps a float32 tensor with min_scale, which rounds it to float32 first.
  const float min_scale_f = static_cast<float>(min_scale);
  TORCH_CHECK_VALUE(std::isfinite(min_scale_f) && min_scale_f > 0.0f,
                    "min_scale must be positive and finite in float32, got ", min_scale);
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  at::Tensor q = at::empty({rows, cols}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({rows}, x.options().dtype(at::kFloat));
  uint8_t* q_ptr = q.data_ptr<uint8_t>();
  float* s_ptr = scales.data_ptr<float>();
  switch (dtype) {
    case at::kBFloat16: quantize_rows<c10::BFloat16>(x, min_scale_f, q_ptr, s_ptr); break;
    case at::kHalf: quantize_rows<c10::Half>(x, min_scale_f, q_ptr, s_ptr); break;
    default: quantize_rows<float>(x, min_scale_f, q_ptr, s_ptr); break;
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_VALUE(!std::isnan(s_ptr[r]), "x row ", r,
                      " contains inf or NaN; FP8 quantization needs finite values");
  }
  return {q, scales};
}

template <typename T>
void dequantize_rows(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                     int64_t q_row_stride, T* out) {
  const float* table = e4m3_table().data();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = q + r * q_row_stride;
      T* dst = out + r * cols;
      const float scale = scales[r];
      // One float32 multiply, then the dtype's round-to-nearest-even cast: what torch does for
      // (q.float() * scale[:, None]).to(dtype).
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<T>(table[in[c]] * scale);
    }
  });
}

at::Tensor fp8_e4m3_dequantize_rows(const at::Tensor& q, const at::Tensor& scales,
                                    at::ScalarType out_dtype) {
  check_2d_cpu(q, "q");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kByte || q.scalar_type() == at::kFloat8_e4m3fn,
                   "q must be uint8 (e4m3 bits) or float8_e4m3fn, got ", q.scalar_type());
  TORCH_CHECK_VALUE(scales.dim() == 1 && scales.size(0) == q.size(0), "scales must be 1-D with ",
                    q.size(0), " entries (one per row of q), got shape ", scales.sizes());
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, "scales must be float32, got ",
                   scales.scalar_type());
  TORCH_CHECK_VALUE(scales.device().is_cpu(), "scales must be a CPU tensor, got device ",
                    scales.device());
  TORCH_CHECK_TYPE(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
                   "out_dtype must be bfloat16, float16 or float32, got ", out_dtype);
  const int64_t rows = q.size(0);
  const int64_t cols = q.size(1);
  const at::Tensor s = scales.contiguous();
  at::Tensor out = at::empty({rows, cols}, q.options().dtype(out_dtype));
  const auto* q_ptr = static_cast<const uint8_t*>(q.const_data_ptr());
  const float* s_ptr = s.const_data_ptr<float>();
  const int64_t row_stride = q.stride(0);
  switch (out_dtype) {
    case at::kBFloat16:
      dequantize_rows(q_ptr, s_ptr, rows, cols, row_stride, out.data_ptr<c10::BFloat16>());
      break;
    case at::kHalf:
      dequantize_rows(q_ptr, s_ptr, rows, cols, row_stride, out.data_ptr<c10::Half>());
      break;
    default:
      dequantize_rows(q_ptr, s_ptr, rows, cols, row_stride, out.data_ptr<float>());
      break;
  }
  return out;
}

}  // namespace

void register_fp8_quant_cpu(pybind11::module_& m) {
  m.def("fp8_e4m3_quantize_rows", &fp8_e4m3_quantize_rows, pybind11::arg("x"),
        pybind11::arg("min_scale") = 1e-12,
        "Row-wise absmax FP8 e4m3 quantization of a 2-D CPU tensor (bf16/f16/f32, unit column\n"
        "stride, any row stride). Returns (q, scales): q uint8 [rows, cols] holding e4m3 bits and\n"
        "scales float32 [rows], scale[r] = max(absmax(x[r]) / 448, min_scale), so x ~= q * scale.\n"
        "Rows containing inf or NaN raise ValueError.");
  m.def("fp8_e4m3_dequantize_rows", &fp8_e4m3_dequantize_rows, pybind11::arg("q"),
        pybind11::arg("scales"), pybind11::arg("out_dtype"),
        "Inverse of fp8_e4m3_quantize_rows: (float(q[r, c]) * scales[r]).to(out_dtype) for a\n"
        "uint8 (or float8_e4m3fn) [rows, cols] CPU tensor and float32 scales [rows].");
}
