// The DDMA verification digest on the GPU: the same sum as megarl/ddma/verify.py's weighted_checksum
// and the CPU kernel weighted_checksum_segments (csrc/ddma_transport.cpp), for device memory.
//
// Over segments i (local element offset off[i], length len[i], HF flat start hf[i]):
//   sum_{i, k < len[i]} bits(flat[off[i] + k]) * w(hf[i] + k)  mod 2^64,
//   w(x) = (x * 2654435761 + 97) mod 2^32,
// bits being the raw 1-, 2- or 4-byte pattern, zero-extended. Unsigned 64-bit arithmetic wraps
// modulo 2^64 on every device, so the order of summation does not matter and the result is the CPU's.
//
// Only CUDA toolkit headers: this compiles with nvcc alone, without torch or a GPU.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// data: the tensor's first element (device); elem_size: 1, 2 or 4 bytes. off, len, hf, ends: n_segments
// int64 each, on the device; ends[i] = len[0] + ... + len[i] (inclusive prefix sum), total = ends[n-1].
// out: one uint64 on the device, which the kernel ADDS to (zero it first). Returns the launch error,
// or cudaErrorInvalidValue for bad arguments.
cudaError_t megarl_weighted_checksum_segments(const void* data, int elem_size, const int64_t* off,
                                              const int64_t* len, const int64_t* hf, const int64_t* ends,
                                              int64_t n_segments, int64_t total,
                                              unsigned long long* out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
