// The steps both auctions (floor_auction.h, dummy_auction.h) and the working set (working_set.h) take on this
// rank's block of cost rows: the block itself, selections of the smallest keys over all ranks, object counts, the
// three cheapest options of a row, and the cost range that sets eps. The CUDA counterpart is cuda/auction_steps.cuh.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/auction_objects.h"
#include "common/params.h"
#include "cpu/auction.h"

namespace cluster_kernels {
namespace auction {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kNoRow = std::numeric_limits<int64_t>::max();

// Raised after a parallel loop that found a point with no finite cost: never expected once the costs are
// checked (eps_schedule), so an internal error rather than a memory error.
inline void check_bids(bool bad, const char* where) {
  if (bad) throw std::runtime_error(std::string(where) + ": a point has no finite cost (internal error)");
}

// This rank's part of the problem: its cost rows and how to reach the others. A block of a working set
// (WorkingSet) holds some of the rows of D only: its row i is row rows[i] of D (rows ascending, so that local
// and global row orders agree); the other blocks hold every row of D.
struct Block {
  const double* D;
  int64_t n, k;
  Collective& comm;
  int64_t offset, n_total;
  const int64_t* rows = nullptr;

  const double* row(int64_t i) const { return D + (rows ? rows[i] : i) * k; }
  // Row i's global row: the key of the selections, the same on every rank and for every thread count.
  int64_t gid(int64_t i) const { return offset + (rows ? rows[i] : i); }
};

// Places the caps leave free over all ranks: sum(hi) - n_total (common/auction_objects.h).
inline int64_t free_places(const Block& b, const int64_t* hi) { return free_places(b.n_total, hi, b.k); }

// Keys (value, global row) in lexicographic order; rows are unique, so keys are distinct.
inline bool key_le(double v, int64_t g, double tv, int64_t tg) { return v < tv || (v == tv && g <= tg); }

// Rows a, c of this rank in the order of their keys (val[row], row).
struct KeyLess {
  const double* val;
  bool operator()(int64_t a, int64_t c) const { return val[a] < val[c] || (val[a] == val[c] && a < c); }
};

// This thread's index and the team's size (0 and 1 outside a parallel region or without OpenMP).
inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}
inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// The rows i in [0, n) with value(i, &v) true, reduced to a set that holds this rank's t smallest keys
// (v, row) among them (all of them when fewer); val[i] = v for each. One parallel pass: every thread keeps
// only what can still be among the t smallest of its own block, then the blocks are joined in order.
// Keys are distinct, so the t smallest are the same set whatever the thread count.
template <class Value>
void smallest_candidates(int64_t n, int64_t t, double* val, Value value, std::vector<int64_t>& out) {
  out.clear();
  if (t <= 0) return;
  const size_t cap = static_cast<size_t>(std::max<int64_t>(2 * t, 4096));
  std::vector<std::vector<int64_t>> part;
#pragma omp parallel
  {
#pragma omp single
    part.resize(team_size());
    std::vector<int64_t>& loc = part[thread_id()];
    double tv = kInf;  // the key (tv, tg) of the t-th smallest kept after the last pruning
    int64_t tg = kNoRow;
    const KeyLess less{val};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      double v;
      if (!value(i, &v) || !(v < tv || (v == tv && i < tg))) continue;
      val[i] = v;
      loc.push_back(i);
      if (loc.size() >= cap) {
        std::nth_element(loc.begin(), loc.begin() + (t - 1), loc.end(), less);
        loc.resize(t);
        tg = loc.back();  // the t-th smallest after nth_element
        tv = val[tg];
      }
    }
  }
  for (const auto& loc : part) out.insert(out.end(), loc.begin(), loc.end());
}

// members[s] = the rows i in [0, n) with slot(i) == s (s in [0, groups); -1: none), in one parallel pass; the
// order within a group depends on the thread count, so callers use each group as a set.
template <class Slot>
void group_rows(int64_t n, int64_t groups, Slot slot, std::vector<std::vector<int64_t>>& members) {
  members.resize(groups);
  for (auto& m : members) m.clear();
  std::vector<std::vector<std::vector<int64_t>>> part;
#pragma omp parallel
  {
#pragma omp single
    part.assign(team_size(), std::vector<std::vector<int64_t>>(groups));
    auto& loc = part[thread_id()];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = slot(i);
      if (s >= 0) loc[s].push_back(i);
    }
  }
  for (const auto& loc : part)
    for (int64_t s = 0; s < groups; ++s) members[s].insert(members[s].end(), loc[s].begin(), loc[s].end());
}

// The three cheapest options of a point: cost(o) for o in [0, m), in order (the lowest index first on equal
// costs; -1 and +inf where m is smaller). best and bc are what a best-of scan gives; second and sc the cheapest
// other than best.
struct Three {
  int64_t best = -1, second = -1, third = -1;
  double bc = kInf, sc = kInf, tc = kInf;
};
template <class Cost>
inline Three best_three(int64_t m, Cost cost) {
  Three t;
  for (int64_t o = 0; o < m; ++o) {
    const double c = cost(o);
    if (c < t.sc) {
      t.tc = t.sc;
      t.third = t.second;
      if (c < t.bc) {
        t.sc = t.bc;
        t.second = t.best;
        t.bc = c;
        t.best = o;
      } else {
        t.sc = c;
        t.second = o;
      }
    } else if (c < t.tc) {
      t.tc = c;
      t.third = o;
    }
  }
  return t;
}

// A row's smallest and largest cost so far, and whether every cost so far is usable (not NaN, not infinite, at
// most kMaxCost in magnitude). Fed one cost at a time, so that a pass doing other work per cost reads the row once.
struct RowRange {
  double lo = kInf, hi = -kInf;
  bool ok = true;
  void add(double v) {
    ok = ok && std::fabs(v) <= kMaxCost;  // false for NaN too
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  // The row (global row gid) into a pass's running span, largest |cost| and first bad row (-gid, a max); false
  // when the row is bad.
  bool fold(int64_t gid, double* span, double* amax, double* bad) const {
    if (!ok) {
      *bad = std::max(*bad, -static_cast<double>(gid));
      return false;
    }
    *span = std::max(*span, hi - lo);
    *amax = std::max(*amax, std::max(std::fabs(lo), std::fabs(hi)));
    return true;
  }
};

// The largest per-point cost range (span, 1 when every row is constant) and the largest |cost|, over all ranks.
struct CostRange {
  double span = 1.0, amax = 0.0;
};

// Per group g, the t[g]-th smallest key and how many local keys lie at or below it.
struct Threshold {
  std::vector<double> val;
  std::vector<int64_t> gid, count;
};

// Units of each object on this rank (count_objects) and over all ranks (global_counts; with `tally`, that per-rank
// count is summed over the ranks too, in the same collective).
std::vector<int64_t> count_objects(const int32_t* obj, int64_t n, int64_t m);
std::vector<int64_t> global_counts(const Block& b, const int32_t* obj, int64_t m, int64_t* tally = nullptr);

// The cost range: from every rank's view (agree_range, also the check of the costs), or from one pass over the
// block's rows (cost_range); and the eps schedule it sets (as the reference's _eps_schedule).
CostRange agree_range(const Block& b, double span, double amax, double bad);
CostRange cost_range(const Block& b);
EpsSchedule eps_schedule(const CostRange& range, const std::vector<double>& prices, bool warm,
                         const AuctionParams& ap);

// Per group g, the t[g]-th smallest key (val[i], gid(i)) over the members of every rank (auction_steps.cpp).
Threshold select_smallest(const Block& b, const double* val, std::vector<std::vector<int64_t>>& members,
                          const std::vector<int64_t>& t);

}  // namespace auction
}  // namespace cluster_kernels
