// DDMA same-host zero-copy transport: a receiver copies byte runs straight out of a sender
// process's memory with process_vm_readv(2). One copy, no shared-memory setup, no serialization:
// the sender publishes the addresses of its (already resident) shard tensors and the receiver
// pulls exactly the runs its plan names into its staging buffer.
//
// The kernel allows it when the reader may ptrace the sender: same uid, and under Yama
// ptrace_scope=1 only if the sender opted in with prctl(PR_SET_PTRACER) (allow_zero_copy_readers).
// Where it is not allowed the Python side falls back to point-to-point sends (gloo/NCCL).
// Python fallback for hosts without the extension: megarl/ddma/zero_copy.py (ctypes).

#include <torch/extension.h>

#include <cerrno>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kMaxIov = 1024;  // IOV_MAX on Linux; process_vm_readv rejects more

void check_runs(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.scalar_type() == at::kLong && t.device().is_cpu(), name,
                    " must be a 1-D int64 CPU tensor");
  TORCH_CHECK_VALUE(t.numel() == n, name, " has ", t.numel(), " entries, expected ", n);
}

// Copy nbytes[i] bytes from address remote[i] of process pid to local address local[i], for all i.
// Returns the bytes copied (== sum(nbytes)) or raises naming the errno and the first failing run.
int64_t read_runs(int64_t pid, const at::Tensor& remote, const at::Tensor& local,
                  const at::Tensor& nbytes) {
#if defined(__linux__)
  const int64_t n = remote.numel();
  check_runs(remote, "remote", n);
  check_runs(local, "local", n);
  check_runs(nbytes, "nbytes", n);
  const at::Tensor r = remote.contiguous(), l = local.contiguous(), b = nbytes.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* lp = l.data_ptr<int64_t>();
  const int64_t* bp = b.data_ptr<int64_t>();
  int64_t total = 0;
  pybind11::gil_scoped_release no_gil;
  std::vector<struct iovec> liov, riov;
  liov.reserve(kMaxIov);
  riov.reserve(kMaxIov);
  int64_t i = 0;
  while (i < n) {
    liov.clear();
    riov.clear();
    int64_t batch_bytes = 0;
    const int64_t first = i;
    for (; i < n && static_cast<int64_t>(liov.size()) < kMaxIov; ++i) {
      TORCH_CHECK_VALUE(bp[i] >= 0, "nbytes[", i, "] is negative");
      if (bp[i] == 0) continue;
      liov.push_back({reinterpret_cast<void*>(lp[i]), static_cast<size_t>(bp[i])});
      riov.push_back({reinterpret_cast<void*>(rp[i]), static_cast<size_t>(bp[i])});
      batch_bytes += bp[i];
    }
    // A call may return fewer bytes (it stops at an iovec boundary or a partial page); resume.
    size_t li = 0;
    int64_t done = 0;
    while (done < batch_bytes) {
      ssize_t got = process_vm_readv(static_cast<pid_t>(pid), liov.data() + li, liov.size() - li,
                                     riov.data() + li, riov.size() - li, 0);
      if (got <= 0) {
        const int err = got < 0 ? errno : EIO;
        TORCH_CHECK(false, "process_vm_readv from pid ", pid, " failed at run ", first + li, ": ",
                    std::strerror(err),
                    err == EPERM ? " (the sender must allow readers: same uid, and "
                                   "allow_zero_copy_readers() under Yama ptrace_scope=1; or use "
                                   "the p2p transport)"
                                 : "");
      }
      done += got;
      size_t left = static_cast<size_t>(got);
      while (left > 0 && li < liov.size()) {  // advance past fully-copied iovecs
        if (left >= liov[li].iov_len) {
          left -= liov[li].iov_len;
          ++li;
        } else {
          liov[li].iov_base = static_cast<char*>(liov[li].iov_base) + left;
          riov[li].iov_base = static_cast<char*>(riov[li].iov_base) + left;
          liov[li].iov_len -= left;
          riov[li].iov_len -= left;
          left = 0;
        }
      }
    }
    total += batch_bytes;
  }
  return total;
#else
  TORCH_CHECK(false, "zero-copy reads need Linux process_vm_readv; use the p2p transport");
  return 0;
#endif
}

// Let any process of this user read this process's memory (Yama ptrace_scope=1 hosts). Returns
// false where the call is not supported (no Yama: then nothing is needed).
bool allow_zero_copy_readers() {
#if defined(__linux__) && defined(PR_SET_PTRACER)
  return prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0;
#else
  return false;
#endif
}

}  // namespace

void register_ddma_transport(pybind11::module_& m) {
  m.def("read_runs", &read_runs, pybind11::arg("pid"), pybind11::arg("remote"),
        pybind11::arg("local"), pybind11::arg("nbytes"),
        "Copy byte runs straight out of process `pid`'s memory (process_vm_readv): for each i,\n"
        "nbytes[i] bytes from its address remote[i] to this process's address local[i]. Three\n"
        "equal-length 1-D int64 CPU tensors. Releases the GIL. Returns the bytes copied.");
  m.def("allow_zero_copy_readers", &allow_zero_copy_readers,
        "prctl(PR_SET_PTRACER, ANY): let same-user processes read_runs from this one.");
}
