// DDMA planner core: the C++ twin of megarl/ddma/plan.py:_plan_layouts (the pure-Python reference).
//
// Python (megarl/ddma/plan_native.py) flattens the trainer and generator layouts into int64 tables
// (strings interned to ids, DP/generator replicas sharing one table) and calls plan_copies once.
// This file does the heavy part: grouping source replicas per HF slice, the greedy least-loaded
// choice of sender, the per-outer-index flat runs, sorting + merging contiguous runs per
// (pair, hf_name, src_param, dst_param), and the coverage/overlap checks. Every ordering rule below
// mirrors the Python reference, because the two plans must be identical copy for copy:
//   - source ranks and destination ranks arrive sorted (index order == SrcRank/DstRank order);
//   - a sender is the holder with the smallest (load, rank index), first holder among equals;
//   - groups of one pair are emitted in first-appearance order (Python dict insertion order);
//   - runs of a group are sorted as (src_offset, dst_offset, numel) tuples, then merged.
// Errors are ValueErrors (TORCH_CHECK_VALUE) with the reference's messages.

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

// Columns of the flattened piece tables (keep in sync with megarl/ddma/plan_native.py).
enum SrcCol { S_PARAM, S_HF, S_DIM, S_HF_START, S_LENGTH, S_LOCAL_START, S_LOCAL_ROWS, S_NCOLS };
enum DstCol {
  D_PARAM, D_HF, D_DIM, D_HF_START, D_LENGTH, D_LOCAL_START, D_LOCAL_ROWS, D_OUTER, D_INNER, D_NCOLS
};

struct Holder {
  int64_t rank, param, local_start, local_rows;
};

struct SrcGroup {  // source pieces with identical HF coordinates (replicas)
  int64_t dim, hf_start, length;
  std::vector<Holder> holders;
};

using Run = std::array<int64_t, 3>;  // (src_offset, dst_offset, numel); array's < is the tuple order

struct CopyGroup {  // one (pair, hf_name, src_param, dst_param) entry of the reference's dict
  int64_t hf, sparam, dparam;
  std::vector<Run> runs;
};

struct Tables {  // a CSR view: rank -> its layout's rows of a [N, ncols] piece table
  const int64_t* pieces;
  int64_t ncols;
  const int64_t* offsets;
  const int64_t* rank_layout;
  int64_t num_ranks, num_layouts;

  const int64_t* row(int64_t i) const { return pieces + i * ncols; }
  int64_t begin(int64_t rank) const { return offsets[rank_layout[rank]]; }
  int64_t end(int64_t rank) const { return offsets[rank_layout[rank] + 1]; }
};

template <size_t N>
struct HashArray {
  size_t operator()(const std::array<int64_t, N>& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull + (h >> 29);
    return static_cast<size_t>(h);
  }
};

Tables check_tables(const at::Tensor& pieces, int64_t ncols, const at::Tensor& offsets,
                    const at::Tensor& rank_layout, const char* side) {
  for (const at::Tensor* t : {&pieces, &offsets, &rank_layout}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->device().is_cpu() && t->is_contiguous(),
                      side, " tables must be contiguous int64 CPU tensors");
  }
  TORCH_CHECK_VALUE(pieces.dim() == 2 && pieces.size(1) == ncols, side, " pieces must be [N, ", ncols,
                    "], got ", pieces.sizes());
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() >= 1, side, " layout offsets must be 1-D, non-empty");
  TORCH_CHECK_VALUE(rank_layout.dim() == 1, side, " rank layouts must be 1-D");
  Tables t{pieces.data_ptr<int64_t>(), ncols, offsets.data_ptr<int64_t>(), rank_layout.data_ptr<int64_t>(),
           rank_layout.numel(), offsets.numel() - 1};
  for (int64_t l = 0; l < t.num_layouts; ++l) {
    TORCH_CHECK_VALUE(0 <= t.offsets[l] && t.offsets[l] <= t.offsets[l + 1] && t.offsets[l + 1] <= pieces.size(0),
                      side, " layout offsets are not a valid CSR index");
  }
  for (int64_t r = 0; r < t.num_ranks; ++r) {
    TORCH_CHECK_VALUE(0 <= t.rank_layout[r] && t.rank_layout[r] < t.num_layouts, side, " rank ", r,
                      " names layout ", t.rank_layout[r], " of ", t.num_layouts);
  }
  return t;
}

// _index_sources: per HF name, its replica groups sorted by hf_start (stable, like Python's sorted).
std::vector<std::vector<SrcGroup>> index_sources(const Tables& src, const std::vector<std::string>& names) {
  const int64_t num_names = static_cast<int64_t>(names.size());
  std::vector<std::vector<SrcGroup>> index(names.size());
  std::vector<int64_t> hf_order;  // first appearance: the order Python's dict checks overlaps in
  std::unordered_map<std::array<int64_t, 4>, size_t, HashArray<4>> where;  // (hf, dim, start, length) -> slot
  for (int64_t rank = 0; rank < src.num_ranks; ++rank) {
    for (int64_t i = src.begin(rank); i < src.end(rank); ++i) {
      const int64_t* p = src.row(i);
      const int64_t hf = p[S_HF];
      TORCH_CHECK_VALUE(0 <= hf && hf < num_names && 0 <= p[S_PARAM] && p[S_PARAM] < num_names,
                        "source piece names an unknown string id");
      auto [it, inserted] = where.try_emplace({hf, p[S_DIM], p[S_HF_START], p[S_LENGTH]}, index[hf].size());
      if (inserted) {
        if (index[hf].empty()) hf_order.push_back(hf);
        index[hf].push_back({p[S_DIM], p[S_HF_START], p[S_LENGTH], {}});
      }
      index[hf][it->second].holders.push_back({rank, p[S_PARAM], p[S_LOCAL_START], p[S_LOCAL_ROWS]});
    }
  }
  for (int64_t hf : hf_order) {
    auto& groups = index[hf];
    std::stable_sort(groups.begin(), groups.end(),
                     [](const SrcGroup& a, const SrcGroup& b) { return a.hf_start < b.hf_start; });
    for (size_t k = 0; k + 1 < groups.size(); ++k) {
      const SrcGroup &a = groups[k], &b = groups[k + 1];
      TORCH_CHECK_VALUE(a.dim == b.dim && a.hf_start + a.length <= b.hf_start, "source pieces of ", names[hf],
                        " overlap without being replicas: dim ", a.dim, " [", a.hf_start, ", +", a.length,
                        ") and dim ", b.dim, " [", b.hf_start, ", +", b.length, ")");
    }
  }
  return index;
}

// _runs: flat runs of rows [start, start+n) along the split dim of a tensor viewed as (outer, row, inner).
void append_runs(std::vector<Run>& out, int64_t outer, int64_t inner, int64_t src_row, int64_t src_start,
                 int64_t dst_row, int64_t dst_start, int64_t n) {
  if (outer == 1 || (n == src_row && n == dst_row)) {
    out.push_back({src_start * inner, dst_start * inner, outer * n * inner});
    return;
  }
  for (int64_t o = 0; o < outer; ++o) {
    out.push_back({o * src_row * inner + src_start * inner, o * dst_row * inner + dst_start * inner, n * inner});
  }
}

// Sort + merge_contiguous_runs_ref of one group, appended to the flat [C, 6] copy rows.
void emit_group(CopyGroup& g, std::vector<int64_t>& copies) {
  std::sort(g.runs.begin(), g.runs.end());
  bool open = false;  // a merged run is pending at the end of `copies`
  for (const Run& r : g.runs) {
    const int64_t s = r[0], d = r[1], n = r[2];
    TORCH_CHECK_VALUE(n >= 0, "a copy run has negative length ", n);
    TORCH_CHECK_VALUE(s >= 0 && d >= 0, "a copy run has a negative offset (src ", s, ", dst ", d, ")");
    if (n == 0) continue;  // the reference drops empty runs without breaking the current one
    int64_t* last = open ? &copies[copies.size() - 6] : nullptr;
    if (last && last[2] + last[5] == s && last[4] + last[5] == d) {
      last[5] += n;
    } else {
      copies.insert(copies.end(), {g.hf, g.sparam, s, g.dparam, d, n});
      open = true;
    }
  }
}

at::Tensor to_tensor(const std::vector<int64_t>& values, int64_t cols) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size()) / cols, cols}, at::kLong);
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  return cols == 1 ? t.view(-1) : t;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_copies(const std::vector<std::string>& names,
                                               const std::vector<std::string>& dst_rank_names,
                                               const at::Tensor& src_pieces, const at::Tensor& src_offsets,
                                               const at::Tensor& src_rank_layout, const at::Tensor& dst_pieces,
                                               const at::Tensor& dst_offsets, const at::Tensor& dst_rank_layout) {
  const Tables src = check_tables(src_pieces, S_NCOLS, src_offsets, src_rank_layout, "source");
  const Tables dst = check_tables(dst_pieces, D_NCOLS, dst_offsets, dst_rank_layout, "destination");
  TORCH_CHECK_VALUE(static_cast<int64_t>(dst_rank_names.size()) == dst.num_ranks,
                    "need one name per destination rank");
  const int64_t num_names = static_cast<int64_t>(names.size());
  const auto index = index_sources(src, names);

  // Per-hf_name group starts, for the bisect.
  std::vector<std::vector<int64_t>> starts(index.size());
  for (size_t hf = 0; hf < index.size(); ++hf) {
    for (const SrcGroup& g : index[hf]) starts[hf].push_back(g.hf_start);
  }

  std::vector<int64_t> load(src.num_ranks, 0);
  std::vector<CopyGroup> groups;
  std::vector<std::vector<size_t>> pair_groups;  // pair slot -> its groups, first appearance first
  std::vector<int64_t> pair_keys;                // pair slot -> src_rank * num_dst + dst_rank
  // A destination rank's pieces are all planned before the next rank's, so the lookups of pairs and
  // groups only need that rank's entries: small tables, reset per destination rank.
  std::vector<int64_t> pair_slot(src.num_ranks, -1);  // src rank -> pair slot (this dst rank)
  std::vector<int64_t> touched;                        // src ranks set in pair_slot
  std::unordered_map<std::array<int64_t, 4>, size_t, HashArray<4>> group_slot;  // (src, hf, sparam, dparam)

  for (int64_t drank = 0; drank < dst.num_ranks; ++drank) {
    for (int64_t r : touched) pair_slot[r] = -1;
    touched.clear();
    group_slot.clear();
    for (int64_t i = dst.begin(drank); i < dst.end(drank); ++i) {
      const int64_t* p = dst.row(i);
      const int64_t hf = p[D_HF], dparam = p[D_PARAM], dim = p[D_DIM];
      TORCH_CHECK_VALUE(0 <= hf && hf < num_names && 0 <= dparam && dparam < num_names,
                        "destination piece names an unknown string id");
      TORCH_CHECK_VALUE(!index[hf].empty(), "no trainer rank holds ", names[hf], " (needed by ",
                        dst_rank_names[drank], " ", names[dparam], ")");
      const std::vector<SrcGroup>& hf_groups = index[hf];
      const std::vector<int64_t>& hf_starts = starts[hf];
      const int64_t lo = p[D_HF_START], hi = p[D_HF_START] + p[D_LENGTH];
      int64_t covered = 0;
      size_t k = std::upper_bound(hf_starts.begin(), hf_starts.end(), lo) - hf_starts.begin();
      k = k > 0 ? k - 1 : 0;
      for (; k < hf_groups.size() && hf_groups[k].hf_start < hi; ++k) {
        const SrcGroup& g = hf_groups[k];
        const int64_t a = std::max(lo, g.hf_start), b = std::min(hi, g.hf_start + g.length);
        if (a >= b) continue;
        TORCH_CHECK_VALUE(g.dim == dim, names[hf], ": source split on dim ", g.dim, ", destination on dim ", dim,
                          "; mixed-dim planning is not implemented");
        covered += b - a;
        const Holder* best = &g.holders.front();  // least loaded, then lowest rank, then first listed
        for (const Holder& h : g.holders) {
          if (load[h.rank] < load[best->rank] || (load[h.rank] == load[best->rank] && h.rank < best->rank)) {
            best = &h;
          }
        }
        load[best->rank] += (b - a) * p[D_OUTER] * p[D_INNER];

        if (pair_slot[best->rank] < 0) {
          pair_slot[best->rank] = static_cast<int64_t>(pair_keys.size());
          touched.push_back(best->rank);
          pair_keys.push_back(best->rank * dst.num_ranks + drank);
          pair_groups.emplace_back();
        }
        auto [git, new_group] = group_slot.try_emplace({best->rank, hf, best->param, dparam}, groups.size());
        if (new_group) {
          groups.push_back({hf, best->param, dparam, {}});
          pair_groups[pair_slot[best->rank]].push_back(git->second);
        }
        append_runs(groups[git->second].runs, p[D_OUTER], p[D_INNER], best->local_rows,
                    best->local_start + a - g.hf_start, p[D_LOCAL_ROWS], p[D_LOCAL_START] + a - lo, b - a);
      }
      TORCH_CHECK_VALUE(covered == p[D_LENGTH], dst_rank_names[drank], " ", names[dparam], ": ", names[hf],
                        " rows [", lo, ", ", hi, ") are covered ", covered, "/", p[D_LENGTH],
                        " by the trainer's pieces");
    }
  }

  // Pairs in (SrcRank, DstRank) order; each row: (src rank, dst rank, end of its copies).
  std::vector<size_t> order(pair_keys.size());
  for (size_t s = 0; s < order.size(); ++s) order[s] = s;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return pair_keys[x] < pair_keys[y]; });
  at::Tensor pairs = at::empty({static_cast<int64_t>(order.size()), 3}, at::kLong);
  int64_t* pair_rows = pairs.data_ptr<int64_t>();
  // Copies repeat across replicas (same params, same offsets, other ranks): return each distinct
  // copy once plus, per plan position, its index, so Python builds only the distinct Copy objects.
  std::vector<int64_t> merged, unique, copy_index;
  std::unordered_map<std::array<int64_t, 6>, int64_t, HashArray<6>> unique_slot;
  for (size_t j = 0; j < order.size(); ++j) {
    for (size_t gid : pair_groups[order[j]]) {
      merged.clear();
      emit_group(groups[gid], merged);
      std::vector<Run>().swap(groups[gid].runs);  // free as we go: runs can outnumber copies by far
      for (size_t c = 0; c < merged.size(); c += 6) {
        std::array<int64_t, 6> row;
        std::copy(merged.begin() + c, merged.begin() + c + 6, row.begin());
        auto [it, inserted] = unique_slot.try_emplace(row, static_cast<int64_t>(unique.size() / 6));
        if (inserted) unique.insert(unique.end(), row.begin(), row.end());
        copy_index.push_back(it->second);
      }
    }
    pair_rows[3 * j] = pair_keys[order[j]] / dst.num_ranks;
    pair_rows[3 * j + 1] = pair_keys[order[j]] % dst.num_ranks;
    pair_rows[3 * j + 2] = static_cast<int64_t>(copy_index.size());
  }
  return {pairs, to_tensor(unique, 6), to_tensor(copy_index, 1)};
}

}  // namespace

void register_plan(pybind11::module_& m) {
  m.def("plan_copies", &plan_copies, pybind11::arg("names"), pybind11::arg("dst_rank_names"),
        pybind11::arg("src_pieces"), pybind11::arg("src_offsets"), pybind11::arg("src_rank_layout"),
        pybind11::arg("dst_pieces"), pybind11::arg("dst_offsets"), pybind11::arg("dst_rank_layout"),
        "DDMA copy plan over flattened layouts (see megarl/ddma/plan_native.py for the table format).\n"
        "Returns int64 (pairs [P, 3]: src rank, dst rank, end of the pair's copies in copy_index;\n"
        "unique [U, 6]: distinct copies (hf, src_param, src_offset, dst_param, dst_offset, numel);\n"
        "copy_index [C]: row of `unique` for every copy, in plan order).");
}
