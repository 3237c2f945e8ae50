// torch binding for the DDMA digest kernel on CUDA tensors (csrc/cuda/checksum.cu).
//
// Compiled only when setup.py builds the CUDA extension (MEGARL_WITH_CUDA). The Python entry point is
// megarl/ddma/verify.py's checksum_segments, which routes contiguous CUDA tensors here; the segment
// tables (small, int64, on the CPU as hf_segments makes them) are checked here like the CPU kernel
// checks them, then copied to the device in one transfer. Only the 8-byte result comes back.
//
// weighted_checksum_segments_cuda_add is the batched form a sync uses (megarl/ddma/verify.py's
// DigestBatch): the table is already on the device (built once per plan), the digest is ADDED into an
// int64 device tensor, and nothing is copied or waited for: one sync's digests are launches on the
// current stream, read back together once. Its segments' bounds are checked when the table is built
// (DigestBatch checks their reach against the tensor at every call), not here: a device table cannot
// be read without a sync.
#ifdef MEGARL_WITH_CUDA

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "checksum.h"

namespace {

void check_table(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.scalar_type() == at::kLong && t.device().is_cpu(), name,
                    " must be a 1-D int64 CPU tensor");
  TORCH_CHECK_VALUE(t.numel() == n, name, " has ", t.numel(), " entries, expected ", n);
}

void weighted_checksum_segments_cuda_add(const at::Tensor& flat, const at::Tensor& table, int64_t total,
                                         const at::Tensor& out) {
  TORCH_CHECK_VALUE(flat.is_cuda() && flat.is_contiguous(), "flat must be a contiguous CUDA tensor, got ",
                    flat.device());
  const int64_t elem = flat.element_size();
  TORCH_CHECK_VALUE(elem == 1 || elem == 2 || elem == 4, "checksums take 1/2/4-byte dtypes, got ",
                    flat.scalar_type());
  TORCH_CHECK_VALUE(table.dim() == 1 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                        table.device() == flat.device() && table.numel() % 4 == 0,
                    "table must be a contiguous 1-D int64 tensor [offsets | lengths | hf_starts | ends] on ",
                    flat.device(), ", got ", table.scalar_type(), " ", table.sizes(), " on ", table.device());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kLong && out.numel() >= 1 && out.is_contiguous() &&
                        out.device() == flat.device(),
                    "out must be a contiguous int64 tensor of at least one element on ", flat.device());
  TORCH_CHECK_VALUE(total >= 0, "total must be >= 0, got ", total);
  const int64_t n = table.numel() / 4;
  if (n == 0 || total == 0) return;
  const c10::cuda::CUDAGuard guard(flat.device());
  const int64_t* d = table.const_data_ptr<int64_t>();
  const cudaError_t rc = megarl_weighted_checksum_segments(
      flat.const_data_ptr(), static_cast<int>(elem), d, d + n, d + 2 * n, d + 3 * n, n, total,
      reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == cudaSuccess, "megarl_weighted_checksum_segments failed: ", cudaGetErrorString(rc));
}

uint64_t weighted_checksum_segments_cuda(const at::Tensor& flat, const at::Tensor& offsets,
                                         const at::Tensor& lengths, const at::Tensor& hf_starts) {
  TORCH_CHECK_VALUE(flat.is_cuda() && flat.is_contiguous(), "flat must be a contiguous CUDA tensor, got ",
                    flat.device());
  const int64_t elem = flat.element_size();
  TORCH_CHECK_VALUE(elem == 1 || elem == 2 || elem == 4, "checksums take 1/2/4-byte dtypes, got ",
                    flat.scalar_type());
  const int64_t n = offsets.numel();
  check_table(offsets, "offsets", n);
  check_table(lengths, "lengths", n);
  check_table(hf_starts, "hf_starts", n);
  if (n == 0) return 0;
  // One int64 table [offsets | lengths | hf_starts | ends] on the host, checked, then one copy over.
  at::Tensor table = at::empty({4 * n}, offsets.options());
  int64_t* t = table.data_ptr<int64_t>();
  const int64_t* off = offsets.contiguous().data_ptr<int64_t>();
  const int64_t* len = lengths.contiguous().data_ptr<int64_t>();
  const int64_t* hf = hf_starts.contiguous().data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(off[i] >= 0 && len[i] >= 0 && off[i] + len[i] <= flat.numel(), "segment ", i, " [",
                      off[i], ", +", len[i], ") is outside the tensor of ", flat.numel(), " elements");
    total += len[i];
    t[i] = off[i];
    t[n + i] = len[i];
    t[2 * n + i] = hf[i];
    t[3 * n + i] = total;
  }
  if (total == 0) return 0;
  const at::Tensor out = at::zeros({1}, flat.options().dtype(at::kLong));
  weighted_checksum_segments_cuda_add(flat, table.to(flat.device()), total, out);
  return static_cast<uint64_t>(out.item<int64_t>());  // the one sync: the digest's 8 bytes
}

}  // namespace

void register_checksum_cuda(pybind11::module_& m) {
  m.def("weighted_checksum_segments_cuda", &weighted_checksum_segments_cuda, pybind11::arg("flat"),
        pybind11::arg("offsets"), pybind11::arg("lengths"), pybind11::arg("hf_starts"),
        "CUDA twin of weighted_checksum_segments (csrc/cuda/checksum.cu): the DDMA digest of a contiguous "
        "CUDA tensor over HF-affine segments (int64 CPU tables), as an int in [0, 2**64).");
  m.def("weighted_checksum_segments_cuda_add", &weighted_checksum_segments_cuda_add, pybind11::arg("flat"),
        pybind11::arg("table"), pybind11::arg("total"), pybind11::arg("out"),
        "Batched weighted_checksum_segments_cuda: ADDS the digest of flat over the segments of a device table "
        "[offsets | lengths | hf_starts | ends] (total: ends[-1]) into out's first int64 element, on the current "
        "stream, with no copy and no sync (megarl/ddma/verify.py DigestBatch).");
}

#endif  // MEGARL_WITH_CUDA
