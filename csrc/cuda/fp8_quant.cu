// Row-wise absmax FP8 e4m3 quantization kernels and their host launchers (see fp8_quant.h).
//
// One thread block per row: the block reduces |x| to the row's absmax (warp shuffles, then one
// value per warp through shared memory), thread 0 writes the scale, and every thread converts
// its strided slice of the row. Rows of a weight matrix are thousands of elements, so a block
// per row keeps all 256 threads busy and needs no inter-block communication.

#include "fp8_quant.h"

#include <climits>

namespace megarl {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Max of `v` over the block; every thread gets the result.
__device__ float block_max(float v) {
  __shared__ float per_warp[kThreadsPerBlock / kWarpSize];
  __shared__ float result;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  v = warp_max(v);
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
    v = lane < num_warps ? per_warp[lane] : 0.0f;
    v = warp_max(v);
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_rows_kernel(const T* __restrict__ in, int64_t cols, int64_t in_row_stride,
                         float min_scale, __nv_fp8_e4m3* __restrict__ out,
                         float* __restrict__ scales) {
  const int64_t row = blockIdx.x;
  const T* x = in + row * in_row_stride;
  __nv_fp8_e4m3* q = out + row * cols;

  float absmax = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    absmax = fmaxf(absmax, fabsf(to_float(x[c])));
  }
  absmax = block_max(absmax);

  // IEEE float32 divisions (nvcc's default -prec-div=true; never build with --use_fast_math), as
  // megarl/ddma/quantize.py's torch reference does on every device: bit-identical codes and scales.
  const float scale = fmaxf(absmax / MEGARL_FP8_E4M3_MAX, min_scale);
  if (threadIdx.x == 0) scales[row] = scale;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    // The float constructor rounds to nearest even and saturates to +-448 (__NV_SATFINITE), so
    // x / scale landing a hair above 448 through rounding cannot become NaN.
    q[c] = __nv_fp8_e4m3(to_float(x[c]) / scale);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_rows_kernel(const __nv_fp8_e4m3* __restrict__ q, const float* __restrict__ scales,
                           int64_t cols, __nv_bfloat16* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const float scale = scales[row];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    out[row * cols + c] = __float2bfloat16(static_cast<float>(q[row * cols + c]) * scale);
  }
}

bool valid_shape(int64_t rows, int64_t cols) {
  // One block per row: the grid's x dimension caps the row count.
  return rows >= 0 && cols >= 0 && rows <= INT_MAX;
}

template <typename T>
cudaError_t launch_quantize(const T* in, int64_t rows, int64_t cols, int64_t in_row_stride,
                            float min_scale, __nv_fp8_e4m3* out, float* scales,
                            cudaStream_t stream) {
  if (!valid_shape(rows, cols) || in_row_stride < cols || !(min_scale > 0.0f)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (in == nullptr || out == nullptr || scales == nullptr) return cudaErrorInvalidValue;
  quantize_rows_kernel<T><<<static_cast<unsigned>(rows), kThreadsPerBlock, 0, stream>>>(
      in, cols, in_row_stride, min_scale, out, scales);
  return cudaGetLastError();
}

}  // namespace
}  // namespace megarl

extern "C" cudaError_t megarl_fp8_e4m3_quantize_rows_bf16(const __nv_bfloat16* in, int64_t rows,
                                                          int64_t cols, int64_t in_row_stride,
                                                          float min_scale, __nv_fp8_e4m3* out,
                                                          float* scales, cudaStream_t stream) {
  return megarl::launch_quantize(in, rows, cols, in_row_stride, min_scale, out, scales, stream);
}

extern "C" cudaError_t megarl_fp8_e4m3_quantize_rows_f16(const __half* in, int64_t rows,
                                                         int64_t cols, int64_t in_row_stride,
                                                         float min_scale, __nv_fp8_e4m3* out,
                                                         float* scales, cudaStream_t stream) {
  return megarl::launch_quantize(in, rows, cols, in_row_stride, min_scale, out, scales, stream);
}

extern "C" cudaError_t megarl_fp8_e4m3_quantize_rows_f32(const float* in, int64_t rows,
                                                         int64_t cols, int64_t in_row_stride,
                                                         float min_scale, __nv_fp8_e4m3* out,
                                                         float* scales, cudaStream_t stream) {
  return megarl::launch_quantize(in, rows, cols, in_row_stride, min_scale, out, scales, stream);
}

extern "C" cudaError_t megarl_fp8_e4m3_dequantize_rows_bf16(const __nv_fp8_e4m3* q,
                                                            const float* scales, int64_t rows,
                                                            int64_t cols, __nv_bfloat16* out,
                                                            cudaStream_t stream) {
  if (!megarl::valid_shape(rows, cols)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (q == nullptr || scales == nullptr || out == nullptr) return cudaErrorInvalidValue;
  megarl::dequantize_rows_kernel<<<static_cast<unsigned>(rows), megarl::kThreadsPerBlock, 0,
                                   stream>>>(q, scales, cols, out);
  return cudaGetLastError();
}
