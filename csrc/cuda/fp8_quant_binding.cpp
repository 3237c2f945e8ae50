// torch binding for the CUDA FP8 e4m3 row quantization kernels (csrc/cuda/fp8_quant.cu).
//
// Compiled only when setup.py builds the CUDA extension, which defines MEGARL_WITH_CUDA and adds
// this file and fp8_quant.cu to the sources; CPU builds never see it. The Python entry points are
// megarl/ddma/quantize.py's quantize_per_channel / dequantize_per_channel, which route CUDA
// tensors here. Same outputs as the CPU kernel's layout: q uint8 [rows, cols] of e4m3 bits and
// float32 scales [rows], on the input's device and the current CUDA stream.
#ifdef MEGARL_WITH_CUDA

#include <torch/extension.h>

// c10's stream and guard headers only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <string>
#include <tuple>

#include "fp8_quant.h"

namespace {

void check_cuda_rc(cudaError_t rc, const char* what) {
  TORCH_CHECK(rc == cudaSuccess, what, " failed: ", cudaGetErrorString(rc));
}

void check_2d_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [rows, cols], got ", t.dim(), " dimensions");
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, name,
                    " needs unit column stride (any row stride is fine), got strides ", t.strides());
}

std::tuple<at::Tensor, at::Tensor> fp8_e4m3_quantize_rows_cuda(const at::Tensor& x, double min_scale) {
  check_2d_cuda(x, "x");
  const float min_scale_f = static_cast<float>(min_scale);
  TORCH_CHECK_VALUE(std::isfinite(min_scale_f) && min_scale_f > 0.0f,
                    "min_scale must be positive and finite in float32, got ", min_scale);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  // A one-row view's stride(0) can be anything; the kernel only needs it to be >= cols.
  const int64_t row_stride = rows <= 1 ? cols : x.stride(0);
  at::Tensor q = at::empty({rows, cols}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {q, scales};
  auto* out = reinterpret_cast<__nv_fp8_e4m3*>(q.data_ptr<uint8_t>());
  float* s = scales.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  cudaError_t rc;
  switch (x.scalar_type()) {
    case at::kBFloat16:
      rc = megarl_fp8_e4m3_quantize_rows_bf16(
          reinterpret_cast<const __nv_bfloat16*>(x.const_data_ptr()), rows, cols, row_stride,
          min_scale_f, out, s, stream);
      break;
    case at::kHalf:
      rc = megarl_fp8_e4m3_quantize_rows_f16(reinterpret_cast<const __half*>(x.const_data_ptr()),
                                             rows, cols, row_stride, min_scale_f, out, s, stream);
      break;
    case at::kFloat:
      rc = megarl_fp8_e4m3_quantize_rows_f32(x.const_data_ptr<float>(), rows, cols, row_stride,
                                             min_scale_f, out, s, stream);
      break;
    default:
      TORCH_CHECK_TYPE(false, "x must be bfloat16, float16 or float32, got ", x.scalar_type());
  }
  check_cuda_rc(rc, "megarl_fp8_e4m3_quantize_rows");
  return {q, scales};
}

at::Tensor fp8_e4m3_dequantize_rows_cuda(const at::Tensor& q, const at::Tensor& scales) {
  check_2d_cuda(q, "q");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kByte || q.scalar_type() == at::kFloat8_e4m3fn,
                   "q must be uint8 (e4m3 bits) or float8_e4m3fn, got ", q.scalar_type());
  TORCH_CHECK_VALUE(scales.dim() == 1 && scales.size(0) == q.size(0) && scales.is_cuda() &&
                        scales.get_device() == q.get_device(),
                    "scales must be a 1-D CUDA tensor with one entry per row of q on q's device");
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, "scales must be float32, got ",
                   scales.scalar_type());
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous();  // the dequantize kernel takes dense rows
  const at::Tensor sc = scales.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kBFloat16));
  if (q.size(0) == 0) return out;
  check_cuda_rc(megarl_fp8_e4m3_dequantize_rows_bf16(
                    reinterpret_cast<const __nv_fp8_e4m3*>(qc.const_data_ptr()),
                    sc.const_data_ptr<float>(), q.size(0), q.size(1),
                    reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
                    c10::cuda::getCurrentCUDAStream().stream()),
                "megarl_fp8_e4m3_dequantize_rows_bf16");
  return out;
}

}  // namespace

void register_fp8_quant_cuda(pybind11::module_& m) {
  m.def("fp8_e4m3_quantize_rows_cuda", &fp8_e4m3_quantize_rows_cuda, pybind11::arg("x"),
        pybind11::arg("min_scale") = 1e-12,
        "CUDA twin of fp8_e4m3_quantize_rows (csrc/cuda/fp8_quant.cu): (q uint8, scales float32).");
  m.def("fp8_e4m3_dequantize_rows_cuda", &fp8_e4m3_dequantize_rows_cuda, pybind11::arg("q"),
        pybind11::arg("scales"),
        "CUDA dequantize to bfloat16: (float(q[r, c]) * scales[r]).to(bfloat16).");
#ifndef MEGARL_CUDA_ARCHS
#define MEGARL_CUDA_ARCHS ""  // a build by other means: unknown (megarl.native then assumes they run)
#endif
  m.def("cuda_archs", [] { return std::string(MEGARL_CUDA_ARCHS); },
        "What the CUDA kernels were built for, as setup.py's -gencode flags say: 'sm_80,...,compute_100'.");
}

#endif  // MEGARL_WITH_CUDA
