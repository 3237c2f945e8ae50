// Row-wise (per output channel) absmax FP8 e4m3 quantization for the generator's weights.
//
// For a row-major [rows, cols] matrix x: scale[r] = max(absmax(x[r, :]) / 448, min_scale) and
// q[r, c] = fp8_e4m3(x[r, c] / scale[r]) (round to nearest even, saturated to +-448), so that
// x ~= q * scale[r]. For a Linear weight [out_features, in_features] a row is an output channel,
// which is the scheme vLLM calls per-channel FP8 weights.
//
// Only CUDA toolkit headers: this compiles with nvcc alone, without torch or a GPU.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// Largest finite e4m3 value.
#define MEGARL_FP8_E4M3_MAX 448.0f

// in: [rows, cols] with row stride in_row_stride (elements); out: dense [rows, cols];
// scales: [rows] float32. min_scale > 0 guards all-zero rows (1e-12 is a sensible default).
// Returns cudaSuccess or the launch error; cudaErrorInvalidValue for bad arguments.
cudaError_t megarl_fp8_e4m3_quantize_rows_bf16(const __nv_bfloat16* in, int64_t rows, int64_t cols,
                                               int64_t in_row_stride, float min_scale,
                                               __nv_fp8_e4m3* out, float* scales,
                                               cudaStream_t stream);
cudaError_t megarl_fp8_e4m3_quantize_rows_f16(const __half* in, int64_t rows, int64_t cols,
                                              int64_t in_row_stride, float min_scale,
                                              __nv_fp8_e4m3* out, float* scales,
                                              cudaStream_t stream);
cudaError_t megarl_fp8_e4m3_quantize_rows_f32(const float* in, int64_t rows, int64_t cols,
                                              int64_t in_row_stride, float min_scale,
                                              __nv_fp8_e4m3* out, float* scales,
                                              cudaStream_t stream);

// Inverse, for verification probes: out[r, c] = float(q[r, c]) * scales[r] as bf16.
cudaError_t megarl_fp8_e4m3_dequantize_rows_bf16(const __nv_fp8_e4m3* q, const float* scales,
                                                 int64_t rows, int64_t cols, __nv_bfloat16* out,
                                                 cudaStream_t stream);

#ifdef __cplusplus
}
#endif
