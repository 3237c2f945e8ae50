// FP8 (e4m3) per-channel quantization on CPU (reference: megarl/ddma/quantize.py)

#include <torch/extension.h>

void register_fp8_quant_cpu(pybind11::module_& m) { (void)m; }
