// DDMA same-host runtime helpers.
//
// read_runs: a receiver copies byte runs straight out of a sender process's memory with
// process_vm_readv(2) (the fallback when the sender's tensors are not in shared memory).
// copy_runs: the same runs between two mapped regions of this process (the sender's shared-memory
// tensors mapped here), one memcpy per run, single thread.
// weighted_checksum_segments: the verification checksum of megarl/ddma/verify.py over segments
// whose HF indices are affine (hf_start + k), in one pass at memory speed (AVX2 where the CPU has
// it, chosen at run time; a scalar loop otherwise; both give the torch reference's sum).
// copy_checksum_runs: copy_runs and that checksum fused, one pass over the bytes (the zero_copy
// receiver landing straight into engine tensors).
//
// The kernel allows it when the reader may ptrace the sender: same uid, and under Yama
// ptrace_scope=1 only if the sender opted in with prctl(PR_SET_PTRACER) (allow_zero_copy_readers).
// Where it is not allowed the Python side falls back to point-to-point sends (gloo/NCCL).
// Python fallback for hosts without the extension: megarl/ddma/zero_copy.py (ctypes).

#include <torch/extension.h>

#include <cerrno>
#include <cstdint>
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

// memcpy(dst[i], src[i], nbytes[i]) for all i, addresses in this process. Single thread: the
// benchmark's ceiling is a single-thread memcpy, and a vLLM worker's threads belong to vLLM.
int64_t copy_runs(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& nbytes) {
  const int64_t n = src.numel();
  check_runs(src, "src", n);
  check_runs(dst, "dst", n);
  check_runs(nbytes, "nbytes", n);
  const at::Tensor s = src.contiguous(), d = dst.contiguous(), b = nbytes.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* dp = d.data_ptr<int64_t>();
  const int64_t* bp = b.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK_VALUE(bp[i] >= 0, "nbytes[", i, "] is negative");
  pybind11::gil_scoped_release no_gil;
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(reinterpret_cast<void*>(dp[i]), reinterpret_cast<const void*>(sp[i]),
                static_cast<size_t>(bp[i]));
    total += bp[i];
  }
  return total;
}

// The per-element weight w(h) = (h * 2654435761 + 97) mod 2^32 advances by a constant (mod 2^32)
// from one HF index to the next, so a segment needs one multiply to start and adds after that.
constexpr uint64_t kWMul = 2654435761ULL, kWAdd = 97ULL;

inline uint32_t weight_at(int64_t h) {
  return static_cast<uint32_t>(static_cast<uint64_t>(h) * kWMul + kWAdd);  // mod 2^32 by truncation
}

// Portable path (any CPU): one segment, scalar.
template <typename T>
uint64_t segment_sum_scalar(const T* p, int64_t n, uint32_t w) {
  uint64_t sum = 0;  // wraps mod 2^64, as the torch reference does
  for (int64_t k = 0; k < n; ++k, w += static_cast<uint32_t>(kWMul)) {
    sum += static_cast<uint64_t>(p[k]) * w;
  }
  return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define MEGARL_CHECKSUM_AVX2 1
#include <immintrin.h>

// AVX2 path: 8 elements per step as 8 u32 lanes of bits and 8 u32 lanes of weights; vpmuludq gives
// the exact 32x32 -> 64-bit products of the even lanes (and, shifted, the odd ones), summed in
// 64-bit lanes mod 2^64 -- the same integer sum as the scalar loop, in another order (a sum mod 2^64
// does not depend on the order). Built for AVX2 with a target attribute and chosen at run time, so
// the extension still loads on a CPU without it.
template <typename T>
__attribute__((target("avx2"))) inline __m256i load_u32x8(const T* p) {
  if constexpr (sizeof(T) == 1) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (sizeof(T) == 2) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
}

template <typename T>
__attribute__((target("avx2"))) uint64_t segment_sum_avx2(const T* p, int64_t n, uint32_t w) {
  const uint32_t m = static_cast<uint32_t>(kWMul);
  __m256i wv = _mm256_setr_epi32(static_cast<int>(w), static_cast<int>(w + m), static_cast<int>(w + 2 * m),
                                 static_cast<int>(w + 3 * m), static_cast<int>(w + 4 * m),
                                 static_cast<int>(w + 5 * m), static_cast<int>(w + 6 * m),
                                 static_cast<int>(w + 7 * m));
  const __m256i step8 = _mm256_set1_epi32(static_cast<int>(8 * m));
  const __m256i step16 = _mm256_set1_epi32(static_cast<int>(16 * m));
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  __m256i acc2 = _mm256_setzero_si256(), acc3 = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {  // two independent chains of 8 (hides vpmuludq latency)
    const __m256i wv2 = _mm256_add_epi32(wv, step8);
    const __m256i b0 = load_u32x8(p + k), b1 = load_u32x8(p + k + 8);
    acc0 = _mm256_add_epi64(acc0, _mm256_mul_epu32(b0, wv));
    acc1 = _mm256_add_epi64(acc1, _mm256_mul_epu32(_mm256_srli_epi64(b0, 32), _mm256_srli_epi64(wv, 32)));
    acc2 = _mm256_add_epi64(acc2, _mm256_mul_epu32(b1, wv2));
    acc3 = _mm256_add_epi64(acc3, _mm256_mul_epu32(_mm256_srli_epi64(b1, 32), _mm256_srli_epi64(wv2, 32)));
    wv = _mm256_add_epi32(wv, step16);
  }
  for (; k + 8 <= n; k += 8) {
    const __m256i b0 = load_u32x8(p + k);
    acc0 = _mm256_add_epi64(acc0, _mm256_mul_epu32(b0, wv));
    acc1 = _mm256_add_epi64(acc1, _mm256_mul_epu32(_mm256_srli_epi64(b0, 32), _mm256_srli_epi64(wv, 32)));
    wv = _mm256_add_epi32(wv, step8);
  }
  const __m256i acc = _mm256_add_epi64(_mm256_add_epi64(acc0, acc1), _mm256_add_epi64(acc2, acc3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  const uint32_t w_tail = static_cast<uint32_t>(_mm256_cvtsi256_si32(wv));  // lane 0: the weight of element k
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + segment_sum_scalar(p + k, n - k, w_tail);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

template <typename T>
uint64_t checksum_typed(const T* data, const int64_t* off, const int64_t* len, const int64_t* hf,
                        int64_t n, bool vector) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
#ifdef MEGARL_CHECKSUM_AVX2
    if (vector) {
      sum += segment_sum_avx2(data + off[i], len[i], weight_at(hf[i]));
      continue;
    }
#endif
    sum += segment_sum_scalar(data + off[i], len[i], weight_at(hf[i]));
  }
  return sum;
}

// sum over segments i, k < lengths[i] of bits(flat[offsets[i] + k]) * w(hf_starts[i] + k) mod 2^64,
// w(x) = (x * 2654435761 + 97) mod 2^32; bits are the raw 1/2/4-byte patterns, zero-extended.
uint64_t weighted_checksum_segments(const at::Tensor& flat, const at::Tensor& offsets,
                                    const at::Tensor& lengths, const at::Tensor& hf_starts, bool vector) {
  TORCH_CHECK_VALUE(flat.device().is_cpu() && flat.is_contiguous(), "flat must be a contiguous CPU tensor");
  const int64_t n = offsets.numel();
  check_runs(offsets, "offsets", n);
  check_runs(lengths, "lengths", n);
  check_runs(hf_starts, "hf_starts", n);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(off[i] >= 0 && len[i] >= 0 && off[i] + len[i] <= flat.numel(), "segment ", i,
                      " [", off[i], ", +", len[i], ") is outside the tensor of ", flat.numel(), " elements");
  }
  const int64_t* hf = hf_starts.data_ptr<int64_t>();
  const void* data = flat.data_ptr();
#ifdef MEGARL_CHECKSUM_AVX2
  vector = vector && cpu_has_avx2();
#else
  vector = false;
#endif
  pybind11::gil_scoped_release no_gil;
  switch (flat.element_size()) {
    case 1: return checksum_typed(static_cast<const uint8_t*>(data), off, len, hf, n, vector);
    case 2: return checksum_typed(static_cast<const uint16_t*>(data), off, len, hf, n, vector);
    case 4: return checksum_typed(static_cast<const uint32_t*>(data), off, len, hf, n, vector);
    default: TORCH_CHECK_VALUE(false, "checksums take 1/2/4-byte dtypes, got ", flat.scalar_type());
  }
  return 0;
}


// --- copy + digest in one pass ----------------------------------------------------------------
// The zero_copy receiver's copy is ours: it reads each run once, stores it into the engine's tensor and
// folds the same bits into the digest on the way (no second pass over what landed). The digest is the
// one of weighted_checksum_segments over the destination's segments: the same sum for the same bytes.

// Scalar: memcpy, then the scalar sum of the copied bytes (any CPU).
template <typename T>
uint64_t copy_sum_scalar(const T* p, T* q, int64_t n, uint32_t w) {
  std::memcpy(q, p, static_cast<size_t>(n) * sizeof(T));
  return segment_sum_scalar(q, n, w);
}

#ifdef MEGARL_CHECKSUM_AVX2
// Adds the digest of 8 u32 lanes of bits ``b`` at weights ``wv`` to (even, odd) accumulators.
__attribute__((target("avx2"))) inline void digest8(__m256i b, __m256i wv, __m256i& even, __m256i& odd) {
  even = _mm256_add_epi64(even, _mm256_mul_epu32(b, wv));
  odd = _mm256_add_epi64(odd, _mm256_mul_epu32(_mm256_srli_epi64(b, 32), _mm256_srli_epi64(wv, 32)));
}

// Runs of at least this many bytes are stored with non-temporal (streaming) stores: they are larger than
// a core's L2, so a cached store would first read every destination line (a third pass over memory, as
// glibc's large memcpy avoids the same way); smaller runs keep ordinary stores.
constexpr int64_t kStreamBytes = 1 << 19;

template <typename T>
__attribute__((target("avx2"))) uint64_t copy_sum_avx2_body(const T* p, T* q, int64_t n, uint32_t w, bool stream);

// AVX2: 32 bytes per step, loaded once, stored to q, widened to u32 lanes (8 per digest8 call, 32/8/sizeof(T)
// calls per step) and summed with the weights, in two accumulator pairs. Tail: copy_sum_scalar. A long run
// first copies a scalar head up to q's next 32-byte boundary, then streams (the weight of element k is
// w + k * kWMul mod 2^32 wherever the split falls).
template <typename T>
__attribute__((target("avx2"))) uint64_t copy_sum_avx2(const T* p, T* q, int64_t n, uint32_t w) {
  const uintptr_t qa = reinterpret_cast<uintptr_t>(q);
  if (n * static_cast<int64_t>(sizeof(T)) < kStreamBytes || qa % sizeof(T) != 0) {
    return copy_sum_avx2_body(p, q, n, w, false);
  }
  const int64_t head = static_cast<int64_t>(((32 - qa % 32) % 32) / sizeof(T));
  const uint64_t sum = copy_sum_scalar(p, q, head, w);
  const uint32_t w_body = w + static_cast<uint32_t>(static_cast<uint64_t>(head) * kWMul);
  return sum + copy_sum_avx2_body(p + head, q + head, n - head, w_body, true);
}

template <typename T>
__attribute__((target("avx2"))) uint64_t copy_sum_avx2_body(const T* p, T* q, int64_t n, uint32_t w, bool stream) {
  constexpr int64_t kPerVec = 32 / sizeof(T);  // elements per 32-byte vector
  const uint32_t m = static_cast<uint32_t>(kWMul);
  __m256i wv = _mm256_setr_epi32(static_cast<int>(w), static_cast<int>(w + m), static_cast<int>(w + 2 * m),
                                 static_cast<int>(w + 3 * m), static_cast<int>(w + 4 * m),
                                 static_cast<int>(w + 5 * m), static_cast<int>(w + 6 * m),
                                 static_cast<int>(w + 7 * m));
  const __m256i step8 = _mm256_set1_epi32(static_cast<int>(8 * m));
  __m256i e0 = _mm256_setzero_si256(), o0 = _mm256_setzero_si256();
  __m256i e1 = _mm256_setzero_si256(), o1 = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + kPerVec <= n; k += kPerVec) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(q + k), v);  // q + k is 32-byte aligned here
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), v);
    }
    if constexpr (sizeof(T) == 4) {
      digest8(v, wv, e0, o0);
      wv = _mm256_add_epi32(wv, step8);
    } else if constexpr (sizeof(T) == 2) {
      const __m256i wv2 = _mm256_add_epi32(wv, step8);
      digest8(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), wv, e0, o0);
      digest8(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), wv2, e1, o1);
      wv = _mm256_add_epi32(wv2, step8);
    } else {
      const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
      const __m256i w1 = _mm256_add_epi32(wv, step8), w2 = _mm256_add_epi32(w1, step8);
      const __m256i w3 = _mm256_add_epi32(w2, step8);
      digest8(_mm256_cvtepu8_epi32(lo), wv, e0, o0);
      digest8(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), w1, e1, o1);
      digest8(_mm256_cvtepu8_epi32(hi), w2, e0, o0);
      digest8(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), w3, e1, o1);
      wv = _mm256_add_epi32(w3, step8);
    }
  }
  if (stream) _mm_sfence();  // streamed stores are visible before the caller reads q or acknowledges
  const __m256i acc = _mm256_add_epi64(_mm256_add_epi64(e0, o0), _mm256_add_epi64(e1, o1));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  const uint32_t w_tail = static_cast<uint32_t>(_mm256_cvtsi256_si32(wv));  // lane 0: the weight of element k
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + copy_sum_scalar(p + k, q + k, n - k, w_tail);
}
#endif

template <typename T>
void copy_checksum_typed(const int64_t* sp, const int64_t* dp, const int64_t* np, const int64_t* hf,
                         const int64_t* gp, int64_t n, bool vector, uint64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const T* p = reinterpret_cast<const T*>(sp[i]);
    T* q = reinterpret_cast<T*>(dp[i]);
#ifdef MEGARL_CHECKSUM_AVX2
    if (vector) {
      out[gp[i]] += copy_sum_avx2(p, q, np[i], weight_at(hf[i]));
      continue;
    }
#endif
    out[gp[i]] += copy_sum_scalar(p, q, np[i], weight_at(hf[i]));
  }
}

// For every run i: copy numel[i] elements of elem_size bytes from address src[i] to dst[i] (this
// process's addresses, non-overlapping) and add sum_k bits(src[i][k]) * w(hf_starts[i] + k) mod 2^64
// to digest group groups[i]. Returns the n_groups digests (int64 holding the uint64 bits): each is
// weighted_checksum_segments of the copied bytes over the same segments.
at::Tensor copy_checksum_runs(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& numel,
                              const at::Tensor& hf_starts, const at::Tensor& groups, int64_t n_groups,
                              int64_t elem_size, bool vector) {
  const int64_t n = src.numel();
  check_runs(src, "src", n);
  check_runs(dst, "dst", n);
  check_runs(numel, "numel", n);
  check_runs(hf_starts, "hf_starts", n);
  check_runs(groups, "groups", n);
  TORCH_CHECK_VALUE(elem_size == 1 || elem_size == 2 || elem_size == 4, "copy_checksum_runs takes 1/2/4-byte "
                    "elements, got ", elem_size);
  TORCH_CHECK_VALUE(n_groups >= 0, "n_groups must be >= 0");
  const at::Tensor s = src.contiguous(), d = dst.contiguous(), c = numel.contiguous();
  const at::Tensor h = hf_starts.contiguous(), g = groups.contiguous();
  const int64_t *sp = s.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>(), *np = c.data_ptr<int64_t>();
  const int64_t *hp = h.data_ptr<int64_t>(), *gp = g.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(np[i] >= 0, "numel[", i, "] is negative");
    TORCH_CHECK_VALUE(gp[i] >= 0 && gp[i] < n_groups, "groups[", i, "] = ", gp[i], " is not in [0, ", n_groups, ")");
  }
  at::Tensor out = at::zeros({n_groups}, at::kLong);
  uint64_t* op = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
#ifdef MEGARL_CHECKSUM_AVX2
  vector = vector && cpu_has_avx2();
#else
  vector = false;
#endif
  {
    pybind11::gil_scoped_release no_gil;
    switch (elem_size) {
      case 1: copy_checksum_typed<uint8_t>(sp, dp, np, hp, gp, n, vector, op); break;
      case 2: copy_checksum_typed<uint16_t>(sp, dp, np, hp, gp, n, vector, op); break;
      default: copy_checksum_typed<uint32_t>(sp, dp, np, hp, gp, n, vector, op); break;
    }
  }
  return out;
}

}  // namespace

void register_ddma_transport(pybind11::module_& m) {
  m.def("read_runs", &read_runs, pybind11::arg("pid"), pybind11::arg("remote"),
        pybind11::arg("local"), pybind11::arg("nbytes"),
        "Copy byte runs straight out of process `pid`'s memory (process_vm_readv): for each i,\n"
        "nbytes[i] bytes from its address remote[i] to this process's address local[i]. Three\n"
        "equal-length 1-D int64 CPU tensors. Releases the GIL. Returns the bytes copied.");
  m.def("copy_runs", &copy_runs, pybind11::arg("src"), pybind11::arg("dst"), pybind11::arg("nbytes"),
        "memcpy(dst[i], src[i], nbytes[i]) for every i (addresses in this process; single thread,\n"
        "GIL released). Returns the bytes copied.");
  m.def("weighted_checksum_segments", &weighted_checksum_segments, pybind11::arg("flat"),
        pybind11::arg("offsets"), pybind11::arg("lengths"), pybind11::arg("hf_starts"),
        pybind11::arg("vector") = true,
        "DDMA verification checksum (megarl/ddma/verify.py) over segments with affine HF indices.\n"
        "vector=True takes the AVX2 kernel where the CPU has it (the same sum); False the scalar loop.");
  m.def("copy_checksum_runs", &copy_checksum_runs, pybind11::arg("src"), pybind11::arg("dst"),
        pybind11::arg("numel"), pybind11::arg("hf_starts"), pybind11::arg("groups"), pybind11::arg("n_groups"),
        pybind11::arg("elem_size"), pybind11::arg("vector") = true,
        "Copy runs and digest them in one pass: for each i, numel[i] elements of elem_size bytes from\n"
        "address src[i] to dst[i], adding their weighted_checksum_segments digest (HF start hf_starts[i])\n"
        "to group groups[i]. Returns n_groups int64 digests (uint64 bits). GIL released, one thread.");
  m.def("checksum_has_avx2", []() {
#ifdef MEGARL_CHECKSUM_AVX2
    return cpu_has_avx2();
#else
    return false;
#endif
  }, "Whether weighted_checksum_segments(vector=True) runs the AVX2 kernel on this CPU.");
  m.def("allow_zero_copy_readers", &allow_zero_copy_readers,
        "prctl(PR_SET_PTRACER, ANY): let same-user processes read_runs from this one.");
}
