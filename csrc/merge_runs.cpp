// DDMA copy-plan helper: merge consecutive copies that are contiguous on both sides.
//
// A copy plan is a list of (src_offset, dst_offset, length) element ranges. Planning per row
// produces many small copies; when copy i+1 starts exactly where copy i ends in BOTH the source
// and the destination buffer, the two are one copy. Fewer, larger copies mean fewer
// memcpy/send calls per weight sync. The pure-Python reference is
// megarl/ddma/runs.py:merge_contiguous_runs_ref; tests compare the two.

#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace {

void check_offsets(const at::Tensor& t, const char* name, int64_t expected_numel) {
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be a 1-D tensor, got ", t.dim(), " dimensions");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.numel() == expected_numel, name, " has ", t.numel(),
                    " entries but src_offsets has ", expected_numel, ": all three must match");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_contiguous_runs(
    const at::Tensor& src_offsets, const at::Tensor& dst_offsets, const at::Tensor& lengths) {
  const int64_t n = src_offsets.numel();
  check_offsets(src_offsets, "src_offsets", n);
  check_offsets(dst_offsets, "dst_offsets", n);
  check_offsets(lengths, "lengths", n);

  const at::Tensor src_c = src_offsets.contiguous();
  const at::Tensor dst_c = dst_offsets.contiguous();
  const at::Tensor len_c = lengths.contiguous();
  const int64_t* src = src_c.data_ptr<int64_t>();
  const int64_t* dst = dst_c.data_ptr<int64_t>();
  const int64_t* len = len_c.data_ptr<int64_t>();

  std::vector<int64_t> out_src, out_dst, out_len;
  out_src.reserve(n);
  out_dst.reserve(n);
  out_len.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(len[i] >= 0, "lengths[", i, "] = ", len[i], " is negative");
    TORCH_CHECK_VALUE(src[i] >= 0 && dst[i] >= 0, "copy ", i, " has a negative offset (src ",
                      src[i], ", dst ", dst[i], ")");
    if (len[i] == 0) continue;  // an empty copy moves nothing and must not break a run
    if (!out_len.empty() && out_src.back() + out_len.back() == src[i] &&
        out_dst.back() + out_len.back() == dst[i]) {
      out_len.back() += len[i];
    } else {
      out_src.push_back(src[i]);
      out_dst.push_back(dst[i]);
      out_len.push_back(len[i]);
    }
  }

  auto to_tensor = [](const std::vector<int64_t>& v) {
    at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
    std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
    return t;
  };
  return {to_tensor(out_src), to_tensor(out_dst), to_tensor(out_len)};
}

}  // namespace

void register_merge_runs(pybind11::module_& m) {
  m.def("merge_contiguous_runs", &merge_contiguous_runs, pybind11::arg("src_offsets"),
        pybind11::arg("dst_offsets"), pybind11::arg("lengths"),
        "Merge consecutive copies that are contiguous in both source and destination.\n"
        "Takes three equal-length 1-D int64 CPU tensors (element offsets and lengths, in plan\n"
        "order); returns (src_offsets, dst_offsets, lengths) of the merged copies. Zero-length\n"
        "copies are dropped.");
}
