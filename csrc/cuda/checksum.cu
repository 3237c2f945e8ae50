// The DDMA digest kernel (see checksum.h).
//
// The segments' elements, taken in order, form one flat range [0, total); each block takes a fixed
// slice of it (kElemsPerBlock), so the work is even however the segments are sized (a parameter can
// be one segment of millions of elements or thousands of short rows). Thread 0 finds the first
// segment the slice touches by binary search over the prefix sums; the block then walks the
// segments in its slice together, its threads striding over each (consecutive threads read
// consecutive elements: coalesced). Each thread keeps a uint64 partial sum; the block reduces them
// with warp shuffles and adds its one result to *out with a 64-bit atomic (wrapping mod 2^64, as the
// sum is defined).

#include "checksum.h"

namespace megarl {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kElemsPerBlock = 16 * kThreads;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint64_t kWMul = 2654435761ull;
constexpr uint64_t kWAdd = 97ull;

__device__ __forceinline__ uint64_t weight(int64_t hf_index) {
  // Only the low 32 bits matter, and unsigned products keep them whatever wraps above.
  return (static_cast<uint64_t>(hf_index) * kWMul + kWAdd) & 0xffffffffull;
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    checksum_kernel(const T* __restrict__ data, const int64_t* __restrict__ off, const int64_t* __restrict__ len,
                    const int64_t* __restrict__ hf, const int64_t* __restrict__ ends, int64_t n_segments,
                    int64_t total, unsigned long long* __restrict__ out) {
  __shared__ int64_t first;
  __shared__ uint64_t per_warp[kThreads / kWarpSize];
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kElemsPerBlock;
  const int64_t hi = lo + kElemsPerBlock < total ? lo + kElemsPerBlock : total;
  if (threadIdx.x == 0) {  // the first segment whose end lies past lo
    int64_t a = 0, b = n_segments - 1;
    while (a < b) {
      const int64_t mid = (a + b) / 2;
      if (ends[mid] > lo) b = mid; else a = mid + 1;
    }
    first = a;
  }
  __syncthreads();
  uint64_t acc = 0;
  int64_t pos = lo;
  for (int64_t s = first; s < n_segments && pos < hi; ++s) {
    const int64_t seg_end = ends[s];
    const int64_t seg_start = seg_end - len[s];
    const int64_t stop = seg_end < hi ? seg_end : hi;
    const T* base = data + off[s] - seg_start;   // element j of the flat range lives at base[j]
    const int64_t hf_base = hf[s] - seg_start;   // and has HF index hf_base + j
    for (int64_t j = pos + threadIdx.x; j < stop; j += kThreads) {
      acc += static_cast<uint64_t>(base[j]) * weight(hf_base + j);
    }
    if (stop > pos) pos = stop;
  }
  acc = warp_sum(acc);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) per_warp[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / kWarpSize ? per_warp[lane] : 0;
    acc = warp_sum(acc);
    if (lane == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
  }
}

template <typename T>
cudaError_t launch(const void* data, const int64_t* off, const int64_t* len, const int64_t* hf,
                   const int64_t* ends, int64_t n_segments, int64_t total, unsigned long long* out,
                   cudaStream_t stream) {
  const int64_t blocks = (total + kElemsPerBlock - 1) / kElemsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;  // 8.8e12 elements: beyond any one tensor
  checksum_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(data), off, len, hf, ends, n_segments, total, out);
  return cudaGetLastError();
}

}  // namespace
}  // namespace megarl

extern "C" cudaError_t megarl_weighted_checksum_segments(const void* data, int elem_size, const int64_t* off,
                                                         const int64_t* len, const int64_t* hf,
                                                         const int64_t* ends, int64_t n_segments, int64_t total,
                                                         unsigned long long* out, cudaStream_t stream) {
  if (n_segments < 0 || total < 0 || out == nullptr) return cudaErrorInvalidValue;
  if (n_segments == 0 || total == 0) return cudaSuccess;
  if (data == nullptr || off == nullptr || len == nullptr || hf == nullptr || ends == nullptr) {
    return cudaErrorInvalidValue;
  }
  switch (elem_size) {
    case 1: return megarl::launch<uint8_t>(data, off, len, hf, ends, n_segments, total, out, stream);
    case 2: return megarl::launch<uint16_t>(data, off, len, hf, ends, n_segments, total, out, stream);
    case 4: return megarl::launch<uint32_t>(data, off, len, hf, ends, n_segments, total, out, stream);
    default: return cudaErrorInvalidValue;
  }
}
