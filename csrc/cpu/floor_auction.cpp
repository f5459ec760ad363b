// The floor auction (floor_auction.h): construction, phases, forward rounds and re-bids. The CUDA counterpart is
// cuda/floor_auction.cu.
#include "cpu/floor_auction.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace cluster_kernels {
namespace auction {

// eps_start > 0: the first eps (at least the final one) instead of the schedule's, for a warm start whose
// prices are known to be close (WorkingSet's later solves).
FloorAuction::FloorAuction(const Block& b, const int64_t* hi, AuctionState& state, int32_t* obj, const AuctionParams& ap,
             const CostRange& range, double eps_start)
    : b_(b), hi_(hi), p_(state.floor_prices), obj_(obj), ap_(ap), cols_(state.columns), stats_(state.stats),
      own_(b.n), gap_(b.n), regret_(b.n), second_(b.n, b.k), heap_(b.k), key_(b.n), kept_(b.k), seen_(b.n, 0) {
  const bool warm = static_cast<int64_t>(p_.size()) == b.k;
  if (!warm) p_.assign(b.k, 0.0);
  es_ = eps_schedule(range, p_, warm, ap);
  if (eps_start > 0.0) es_.eps = std::max(std::min(eps_start, es_.eps), es_.eps_final);
  eps_ = es_.eps;
  slack_ = free_places(b, hi);
}

int64_t FloorAuction::run() {
  start(true);
  for (;;) {
    if (settled()) break;
    while (round()) {
    }
    if (eps_ <= es_.eps_final) break;
    if (eps_ <= ap_.eps_certify * es_.span && certified()) break;
    eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
    start(false);
  }
  return rounds_;
}

// After a phase start that made no pull: every point at its exact argmin (ties count) and no cluster over its
// cap, so every cluster with a positive price is exactly full. The assignment is then optimal for these
// prices, and every later phase would move no point (none is above its best by any eps >= 0), pull nothing
// and run no round: they are skipped. Cold starts with all prices 0 and no cluster over its cap end here at
// once. Prices, counts and exact_ are global: every rank agrees.
bool FloorAuction::settled() const {
  if (!idle_) return false;
  for (int64_t j = 0; j < b_.k; ++j)
    if (counts_[j] > hi_[j]) return false;
  return true;
}

// Every point takes its cheapest cluster (only_violators: only those more than eps above it).
void FloorAuction::bid_all(bool only_violators) {
  if (!only_violators) forget_pulls();  // every point moves: nothing a reverse step kept still bounds anything
  bool bad = false;
  int64_t inexact = 0;  // points left above their exact best (within eps of it)
  const bool record = only_violators && any_kept_;
  std::vector<std::vector<int64_t>> moved;  // per thread, the points that changed cluster (when recorded)
#pragma omp parallel reduction(|| : bad) reduction(+ : inexact)
  {
#pragma omp single
    moved.resize(team_size());
    std::vector<int64_t>& mine = moved[thread_id()];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < b_.n; ++i) {
      double sc;
      if (only_violators && second_.get(i, obj_[i], &sc, [&](int64_t c) { return row(i)[c] + p_[c]; })) {
        // The cheapest other cluster is known exactly: no scan unless the point moves.
        const double own = own_[i] + p_[obj_[i]];  // own_[i] is row(i)[obj_[i]]
        if (!(own > sc + eps_)) {
          inexact += own > sc;
          continue;
        }
      }
      const Three t = cheapest_three(i);
      const int64_t best = t.best;
      const double bc = t.bc;
      if (best < 0) {
        bad = true;
        continue;
      }
      if (!only_violators || row(i)[obj_[i]] + p_[obj_[i]] > bc + eps_) {
        if (record) mine.push_back(i);
        obj_[i] = static_cast<int32_t>(best);
        own_[i] = row(i)[best];
      } else {
        inexact += row(i)[obj_[i]] + p_[obj_[i]] > bc;
      }
      second_.put(i, obj_[i], t);
    }
  }
  for (const auto& m : moved) note_moved(m.data(), m.size());
  check_bids(bad, "floor_auction");
  counts_ = global_counts(b_, obj_, b_.k, &inexact);
  exact_ = inexact == 0;
}

// Phase start: the first phase from the exact argmin, later ones move only the points that violate the
// new eps (everyone else already sits within it, which keeps most of the previous phase's work). A
// cluster left below its cap with a positive price then lowers its price just enough to pull in its
// deficit (reverse steps); a price that would go below 0 stops at 0, where being under-full is allowed.
// Zeroing the price outright instead would throw away what earlier phases learnt.
void FloorAuction::start(bool first) {
  built_.assign(b_.k, 0);
  for (auto& h : heap_) h.clear();
  bid_all(!first);
  idle_ = exact_;
  if (slack_ <= 0) return;
  for (int64_t pass = 0;; ++pass) {
    bool changed = false;
    for (int64_t j = 0; j < b_.k; ++j) {
      if (counts_[j] >= hi_[j] || p_[j] <= 0.0) continue;
      changed = true;
      idle_ = false;
      if (pass >= 4 * b_.k) {  // safety net: plain zeroing always terminates
        set_price(j, 0.0);
        continue;
      }
      pull(j);
    }
    if (!changed) break;
    if (pass >= 4 * b_.k) bid_all(false);
  }
  flush_lowered();
}

// One forward round: every over-full cluster evicts its `excess` members with the smallest (regret,
// row) and raises its price past the last of them; evicted points re-bid. False when none is over-full.
bool FloorAuction::round() {
  std::vector<int64_t> over, slot(b_.k, -1);
  for (int64_t j = 0; j < b_.k; ++j) {
    if (counts_[j] > hi_[j]) {
      slot[j] = static_cast<int64_t>(over.size());
      over.push_back(j);
    }
  }
  if (over.empty()) return false;
  if (++rounds_ > ap_.max_rounds) throw std::runtime_error("floor_auction: no termination (internal error)");
  const int64_t nover = static_cast<int64_t>(over.size());
  build_heaps(over);
  std::vector<int64_t> excess(nover);
  for (int64_t s = 0; s < nover; ++s) excess[s] = counts_[over[s]] - hi_[over[s]];
  const double margin = rounding_margin();
  members_.resize(nover);
#pragma omp parallel for schedule(dynamic, 1) if (nover > 1)
  for (int64_t s = 0; s < nover; ++s) candidates(over[s], excess[s], margin, members_[s]);
  const Threshold th = select_smallest(b_, regret_.data(), members_, excess);
  std::vector<int64_t> moved;
  for (int64_t s = 0; s < nover; ++s) {
    set_price(over[s], p_[over[s]] + th.val[s] + eps_);
    if (!std::isfinite(p_[over[s]])) throw std::runtime_error("floor_auction: infinite price (internal error)");
    counts_[over[s]] = hi_[over[s]];
    moved.insert(moved.end(), members_[s].begin(), members_[s].begin() + th.count[s]);
    auto& h = heap_[over[s]];
    for (size_t e = th.count[s]; e < members_[s].size(); ++e) {  // the candidates that stay
      h.push_back({key_[members_[s][e]], members_[s][e]});
      std::push_heap(h.begin(), h.end(), entry_after);
    }
  }
  rebid(moved);
  return true;
}

// Evicted points re-bid at the new prices, so no point sits more than eps from its best.
void FloorAuction::rebid(const std::vector<int64_t>& moved) {
  const int64_t nm = static_cast<int64_t>(moved.size());
  bool bad = false;
#pragma omp parallel for schedule(static) if (nm > 4096) reduction(|| : bad)
  for (int64_t e = 0; e < nm; ++e) {
    if (e + static_cast<int64_t>(kPrefetchAhead) < nm) prefetch_row(moved[e + kPrefetchAhead]);
    const Three t = cheapest_three(moved[e]);
    bad = bad || t.best < 0;
    obj_[moved[e]] = static_cast<int32_t>(t.best < 0 ? 0 : t.best);
    own_[moved[e]] = row(moved[e])[obj_[moved[e]]];
    second_.put(moved[e], obj_[moved[e]], t);
  }
  check_bids(bad, "floor_auction");
  note_moved(moved.data(), moved.size());
  std::vector<int64_t> came(b_.k, 0);
  for (int64_t e = 0; e < nm; ++e) {
    const int64_t i = moved[e], j = obj_[i];
    ++came[j];
    if (!built_[j]) continue;
    heap_[j].push_back({second_cost(i, j) - own_[i], i});
    std::push_heap(heap_[j].begin(), heap_[j].end(), entry_after);
  }
  b_.comm.sum(came);
  for (int64_t j = 0; j < b_.k; ++j) counts_[j] += came[j];
}
}  // namespace auction
}  // namespace cluster_kernels
