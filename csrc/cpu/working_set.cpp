// No CUDA counterpart: the device auction solves every row on each call.
// The working set of warm floor auctions (working_set.h).
#include "cpu/working_set.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "cpu/floor_auction.h"

namespace cluster_kernels {
namespace auction {

WorkingSet::WorkingSet(const Block& b, const int64_t* hi, AuctionState& state, int32_t* obj, const AuctionParams& ap)
    : b_(b), hi_(hi), state_(state), obj_(obj), ap_(ap), p0_(state.floor_prices), best_(b.n), second_(b.n),
      gap_(b.n), gap3_(b.n), in_(b.n, 0) {
}

// Whether a call runs on a working set: the parameter on, warm prices, a problem large enough, caps with slack,
// and no pause. A call in a pause counts it down; a cold call starts one (the first Lloyd step moves the centroids
// far, so the call after it solves whole).
bool WorkingSet::applies(const Block& b, const int64_t* hi, AuctionState& state, const AuctionParams& ap) {
  if (static_cast<int64_t>(state.floor_prices.size()) != b.k) {
    state.working = {0, 1, 1};
    return false;
  }
  if (!ap.working_set || b.rows != nullptr || b.k < 3 || b.n_total < kWorkingSetMin) return false;
  if (kWorkingSetSlack * free_places(b, hi) < b.n_total) return false;
  if (state.working.skip == 0) return true;
  --state.working.skip;
  return false;
}

// Labels into obj (every row of the block) and prices into the state, as FloorAuction::run; the rounds.
int64_t WorkingSet::run() {
  margins();
  first_set();
  ++state_.stats.working_calls;
  int64_t rounds = 0, joined = 0;
  for (int64_t solves = 0;; ++solves) {
    const std::vector<int64_t> caps = set_caps();
    rows_.clear();
    for (int64_t i = 0; i < b_.n; ++i)
      if (in_[i]) rows_.push_back(i);
    std::vector<int64_t> size{static_cast<int64_t>(rows_.size())};
    b_.comm.sum(size);
    if (kWorkingSetMost * size[0] > b_.n_total) return rounds + whole();
    double eps = 0.0;  // the schedule's
    if (solves > 0) {
      // Many rows joined: the set's prices were far from the whole problem's, start again from p0. A few: the
      // prices are close, and a smaller first eps keeps most of what the last solve found.
      if (kWorkingSetRestart * joined > size[0]) state_.floor_prices = p0_;
      else eps = ap_.eps_warm * range_.span / kWorkingSetCloseEps;
    }
    const Block set{b_.D, static_cast<int64_t>(rows_.size()), b_.k, b_.comm, b_.offset, size[0], rows_.data()};
    std::vector<int32_t> set_obj(rows_.size());
    rounds += FloorAuction(set, caps.data(), state_, set_obj.data(), ap_, range_, eps).run();
    ++state_.stats.working_solves;
    joined = join_violators();
    if (joined > 0) continue;
    state_.working = {size[0], 0, 0};
    state_.stats.working_rows += size[0];
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < b_.n; ++i) obj_[i] = best_[i];
    for (size_t e = 0; e < rows_.size(); ++e) obj_[rows_[e]] = set_obj[e];
    return rounds;
  }
}

// The whole problem, from p0 (a working set's prices can lie far from the whole problem's), and a pause of the
// working set: 1, 2, 4, ... calls for each such call in a row.
int64_t WorkingSet::whole() {
  ++state_.stats.working_whole;
  AuctionState::Working& w = state_.working;
  w.rows = 0;
  w.pause = std::max<int64_t>(1, 2 * w.pause);
  w.skip = w.pause;
  state_.floor_prices = p0_;
  return FloorAuction(b_, hi_, state_, obj_, ap_, range_).run();
}

// One pass over the rows: each one's three cheapest clusters at p0_, and the cost range (the check of the costs).
void WorkingSet::margins() {
  double span = 0.0, amax = 0.0, bad = -kInf;
  const int64_t k = b_.k;
#pragma omp parallel for schedule(static) reduction(max : span, amax, bad)
  for (int64_t i = 0; i < b_.n; ++i) {
    const double* Di = b_.row(i);
    RowRange r;
    const Three t = best_three(k, [&](int64_t j) {
      r.add(Di[j]);
      return Di[j] + p0_[j];
    });
    if (!r.fold(b_.gid(i), &span, &amax, &bad)) continue;
    best_[i] = static_cast<int32_t>(t.best);
    second_[i] = static_cast<int32_t>(t.second);
    gap_[i] = t.sc - t.bc;
    gap3_[i] = t.tc - t.bc;
  }
  range_ = agree_range(b_, span, amax, bad);
}

// The rows with the smallest margins (all ranks), as many as the previous call's final set and some more.
void WorkingSet::first_set() {
  const int64_t least = b_.n_total / kWorkingSetFirst;
  const auto grown = static_cast<int64_t>(kWorkingSetGrow * static_cast<double>(state_.working.rows));
  const int64_t want = std::min(b_.n_total, std::max(least, grown));
  std::vector<std::vector<int64_t>> cand(1);
  smallest_candidates(b_.n, want, gap_.data(), [&](int64_t i, double* v) { return *v = gap_[i], true; }, cand[0]);
  const Threshold th = select_smallest(b_, gap_.data(), cand, {want});
  for (int64_t e = 0; e < th.count[0]; ++e) in_[cand[0][e]] = 1;
}

// The caps of the working set: hi less the rows each cluster holds. A cluster that would hold more than its
// cap first gives its held rows with the smallest margins to the working set.
std::vector<int64_t> WorkingSet::set_caps() {
  std::vector<int64_t> count(b_.k, 0);
  for (int64_t i = 0; i < b_.n; ++i) count[best_[i]] += !in_[i];
  b_.comm.sum(count);
  std::vector<int64_t> over(b_.k, 0);
  bool any = false;
  for (int64_t j = 0; j < b_.k; ++j) {
    over[j] = std::max<int64_t>(0, count[j] - hi_[j]);
    any = any || over[j] > 0;
  }
  if (any) {  // the same on every rank: the counts are global
    std::vector<std::vector<int64_t>> held;
    group_rows(b_.n, b_.k, [&](int64_t i) { return in_[i] || over[best_[i]] == 0 ? int64_t{-1} : best_[i]; }, held);
    const Threshold th = select_smallest(b_, gap_.data(), held, over);
    for (int64_t j = 0; j < b_.k; ++j) {
      for (int64_t e = 0; e < th.count[j]; ++e) in_[held[j][e]] = 1;
      count[j] -= over[j];
    }
  }
  std::vector<int64_t> caps(b_.k);
  for (int64_t j = 0; j < b_.k; ++j) caps[j] = hi_[j] - count[j];
  return caps;
}

// The held rows that are not at a cheapest cluster at the prices now join the working set; how many (all
// ranks). A row's clusters other than its two cheapest at p0 stay at or above its own while its third margin
// exceeds the rise of its own price less the largest drop of another (plus rounding): only the others read
// their row.
int64_t WorkingSet::join_violators() {
  const std::vector<double>& p = state_.floor_prices;
  const int64_t k = b_.k;
  std::vector<double> dp(k);
  double least = kInf, pmax = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    dp[j] = p[j] - p0_[j];
    least = std::min(least, dp[j]);
    pmax = std::max(pmax, std::max(std::fabs(p[j]), std::fabs(p0_[j])));
  }
  const double margin = 16.0 * DBL_EPSILON * (range_.amax + pmax);
  int64_t joined = 0;
#pragma omp parallel for schedule(static) reduction(+ : joined)
  for (int64_t i = 0; i < b_.n; ++i) {
    if (in_[i]) continue;
    const int64_t a = best_[i], s = second_[i];
    const double* Di = b_.row(i);
    const double own = Di[a] + p[a];
    double other = Di[s] + p[s];
    if (other >= own && !(gap3_[i] >= dp[a] - least + margin)) {
      for (int64_t j = 0; j < k; ++j)
        if (j != a) other = std::min(other, Di[j] + p[j]);
    }
    if (other < own) {
      in_[i] = 1;
      ++joined;
    }
  }
  std::vector<int64_t> total{joined};
  b_.comm.sum(total);
  return total[0];
}
}  // namespace auction
}  // namespace cluster_kernels
