// The one Python module of megarl's C++ extension (megarl._C). Each source file registers its own
// functions; add a new file to EXTENSION_SOURCES in setup.py and a register_* call here.

#include <torch/extension.h>

void register_merge_runs(pybind11::module_& m);     // csrc/merge_runs.cpp
void register_plan(pybind11::module_& m);           // csrc/plan.cpp
void register_fp8_quant_cpu(pybind11::module_& m);  // csrc/fp8_quant_cpu.cpp
void register_ddma_transport(pybind11::module_& m); // csrc/ddma_transport.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megarl native helpers (C++): DDMA planning, transport and FP8 quantization";
  register_merge_runs(m);
  register_plan(m);
  register_fp8_quant_cpu(m);
  register_ddma_transport(m);
#ifdef MEGARL_WITH_CUDA
  void register_fp8_quant_cuda(pybind11::module_& m);  // csrc/cuda/fp8_quant_binding.cpp
  register_fp8_quant_cuda(m);
  void register_checksum_cuda(pybind11::module_& m);  // csrc/cuda/checksum_binding.cpp
  register_checksum_cuda(m);
#endif
}
