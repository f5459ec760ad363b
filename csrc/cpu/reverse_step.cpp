// The floor auction's reverse steps (floor_auction.h): an under-full cluster with a positive price lowers it just
// enough to pull in its deficit; the candidates a scan kept for the next steps. The CUDA counterpart is
// cuda/reverse_step.cu.
#include "cpu/floor_auction.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace cluster_kernels {
namespace auction {

// Column j of the costs (null when there is no column-major copy).
const double* FloorAuction::column(int64_t j) {
  if (!have_cols_ && b_.n * b_.k <= kMaxColumnCopy && b_.n > 0) {
    have_cols_ = true;
    cols_.resize(static_cast<size_t>(b_.n) * b_.k);
    constexpr int64_t kBlock = 64;
#pragma omp parallel for schedule(static)
    for (int64_t i0 = 0; i0 < b_.n; i0 += kBlock) {
      const int64_t i1 = std::min(i0 + kBlock, b_.n);
      for (int64_t c = 0; c < b_.k; ++c)
        for (int64_t i = i0; i < i1; ++i) cols_[c * b_.n + i] = row(i)[c];
    }
  }
  return have_cols_ ? cols_.data() + j * b_.n : nullptr;
}

// The price drops of this phase start's reverse steps reach the second-cost cache, in one pass over the
// rows, before anything reads it again (the rounds, the certificate, the next phase start's bid_all). Reverse
// steps are the only price drops, and they read the cache not at all; a bid_all among them rewrites every
// entry at the current prices, which the pass then leaves as it is.
void FloorAuction::flush_lowered() {
  if (lowered_.empty()) return;
  if (have_cols_) {
    second_.lowered(lowered_, [&](int64_t i, int64_t j) { return cols_[j * b_.n + i] + p_[j]; });
  } else {
    second_.lowered(lowered_, [&](int64_t i, int64_t j) { return row(i)[j] + p_[j]; });
  }
  lowered_.clear();
}

// Reverse step of the under-full cluster j: the points with the smallest extra cost (gap) come, and
// every other point stays within eps of its best.
void FloorAuction::pull(int64_t j) {
  const int64_t r = hi_[j] - counts_[j];
  const double pj = p_[j];
  const double* col = column(j);
  members_.resize(1);
  std::vector<int64_t>& cand = members_[0];
  auto gap = [&](int64_t i, double* v) {
    const int64_t o = obj_[i];
    if (o == j) return false;
    *v = ((col ? col[i] : row(i)[j]) + pj) - (own_[i] + p_[o]);
    return true;
  };
  ++stats_.pulls;
  // Only this rank's r smallest gaps can be among the r smallest of all ranks.
  if (!kept_candidates(j, r, gap, cand)) scan_candidates(j, r, gap, cand);
  const Threshold th = select_smallest(b_, gap_.data(), members_, {r});
  int64_t pulled = th.count[0];
  const double drop = th.val[0] + eps_;
  if (drop >= pj) {
    // The price stops at 0: only points that now strictly prefer j by more than eps move.
    p_[j] = 0.0;
    const double eps = eps_;
    pulled = std::partition(cand.begin(), cand.begin() + pulled, [&](int64_t i) { return gap_[i] - pj < -eps; })
             - cand.begin();
  } else {
    p_[j] -= drop;
  }
  if (!std::isfinite(p_[j])) throw std::runtime_error("floor_auction: infinite price (internal error)");
  std::vector<int64_t> left(b_.k, 0);
  for (int64_t e = 0; e < pulled; ++e) {
    ++left[obj_[cand[e]]];
    obj_[cand[e]] = static_cast<int32_t>(j);
    own_[cand[e]] = row(cand[e])[j];
  }
  note_moved(cand.data(), static_cast<size_t>(pulled));
  if (p_[j] < pj && std::find(lowered_.begin(), lowered_.end(), j) == lowered_.end())
    lowered_.push_back(j);  // the cache learns of the drop at flush_lowered
  b_.comm.sum(left);
  for (int64_t o = 0; o < b_.k; ++o) {
    counts_[o] -= left[o];
    counts_[j] += left[o];
  }
}

// Candidates for j from the scan kept for it, if they provably hold this rank's r smallest gaps (then true,
// cand and gap_ as a scan would leave them, up to order and rows beyond the r smallest).
template <class Gap>
bool FloorAuction::kept_candidates(int64_t j, int64_t r, Gap gap, std::vector<int64_t>& cand) {
  KeptPull& kp = kept_[j];
  // Past kMovedReread rows moved since, reading them costs more than a scan.
  if (!kp.valid || moved_.size() - kp.mark > static_cast<size_t>(b_.n / kMovedReread)) return false;
  double rise = 0.0;  // the largest rise of another cluster's price since the scan
  for (int64_t o = 0; o < b_.k; ++o)
    if (o != j) rise = std::max(rise, p_[o] - kp.prices[o]);
  const double bound = kp.bound + (p_[j] - kp.prices[j]) - rise - rounding_margin();
  if (!(bound > -kInf)) return false;
  cand.clear();
  ++pull_tick_;
  auto take = [&](int64_t i) {
    if (seen_[i] == pull_tick_) return;
    seen_[i] = pull_tick_;
    if (gap(i, &gap_[i])) cand.push_back(i);
  };
  for (int64_t i : kp.rows) take(i);
  for (size_t e = kp.mark; e < moved_.size(); ++e) take(moved_[e]);
  if (kp.bound < kInf) {
    // The r-th smallest gap among the candidates must lie below every other row's gap now.
    int64_t below = 0;
    for (int64_t i : cand) below += gap_[i] < bound;
    if (below < r) {
      kp.keep = std::min(2 * kp.keep, kKeptPullMost);  // the next scan keeps more
      return false;
    }
    // From here on `bound` is the bound and these prices its prices: the candidates at or above it go, like
    // the rows never kept, and the rows moved so far are read.
    kp.rows.clear();
    for (int64_t i : cand)
      if (gap_[i] < bound) kp.rows.push_back(i);
    kp.bound = bound;
    kp.prices = p_;
  } else {
    kp.rows = cand;
  }
  kp.mark = moved_.size();
  return true;
}

// Candidates for j from every row: this rank's r smallest gaps and more, kept for j's next reverse steps
// (kept_candidates).
template <class Gap>
void FloorAuction::scan_candidates(int64_t j, int64_t r, Gap gap, std::vector<int64_t>& cand) {
  ++stats_.pull_scans;
  KeptPull& kp = kept_[j];
  const int64_t keep = std::max<int64_t>(2 * r, kp.keep);
  smallest_candidates(b_.n, keep, gap_.data(), gap, cand);
  kp.bound = kInf;
  if (static_cast<int64_t>(cand.size()) >= keep) {  // else no thread pruned: cand holds every row outside j
    std::nth_element(cand.begin(), cand.begin() + (keep - 1), cand.end(), KeyLess{gap_.data()});
    kp.bound = gap_[cand[keep - 1]];
    cand.resize(keep);
  }
  kp.rows = cand;
  kp.prices = p_;
  kp.mark = moved_.size();
  kp.valid = true;
  any_kept_ = true;
}
}  // namespace auction
}  // namespace cluster_kernels
