// The steps both auctions take on this rank's block of cost rows (auction_steps.h): object counts, the cost
// range and eps schedule, and the selection of the smallest keys over all ranks.
#include "cpu/auction_steps.h"

#include <cfloat>
#include <cmath>
#include <cstdio>

namespace cluster_kernels {
namespace auction {

// Units per object. Every label is bounds-checked: a label comes from floating-point comparisons, and one out
// of [0, m) would otherwise write outside `local`.
std::vector<int64_t> count_objects(const int32_t* obj, int64_t n, int64_t m) {
  std::vector<int64_t> counts(m, 0);
  bool bad = false;
#pragma omp parallel reduction(|| : bad)
  {
    std::vector<int64_t> local(m, 0);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) {
      const int64_t o = obj[i];
      if (o < 0 || o >= m) {
        bad = true;
        continue;
      }
      ++local[o];
    }
#pragma omp critical
    for (int64_t o = 0; o < m; ++o) counts[o] += local[o];  // integers: order does not matter
  }
  if (bad) throw std::runtime_error("auction_assign: a label outside [0, k) (internal error)");
  return counts;
}

// Units of each object over all ranks; with `tally`, that per-rank count is summed over the ranks too, in the same
// collective.
std::vector<int64_t> global_counts(const Block& b, const int32_t* obj, int64_t m, int64_t* tally) {
  std::vector<int64_t> counts = count_objects(obj, b.n, m);
  if (tally) counts.push_back(*tally);
  b.comm.sum(counts);
  if (tally) {
    *tally = counts.back();
    counts.pop_back();
  }
  return counts;
}

// Every rank's view (span, amax, bad: -(first bad global row) or -inf) made global. It is also the check of the
// costs: the same all-reduce tells every rank alike whether some rank holds a bad cost, and then every rank
// refuses the problem.
CostRange agree_range(const Block& b, double span, double amax, double bad) {
  std::vector<double> global{span, amax, bad};
  b.comm.max(global);
  if (global[2] > -kInf) {
    char msg[200];
    std::snprintf(msg, sizeof msg,
                  "auction_assign: cost row %lld has a NaN, an Inf or a |cost| above %.3g; every cost must be finite "
                  "and in that range",
                  static_cast<long long>(-global[2]), kMaxCost);
    throw std::invalid_argument(msg);
  }
  return {global[0] > 0.0 ? global[0] : 1.0, global[1]};
}

// The cost range of the block's rows (one pass), checked.
CostRange cost_range(const Block& b) {
  double span = 0.0, amax = 0.0, bad = -kInf;
#pragma omp parallel for schedule(static) reduction(max : span, amax, bad)
  for (int64_t i = 0; i < b.n; ++i) {
    const double* Di = b.row(i);
    RowRange r;
    for (int64_t j = 0; j < b.k; ++j) r.add(Di[j]);
    r.fold(b.gid(i), &span, &amax, &bad);
  }
  return agree_range(b, span, amax, bad);
}

// First and final eps from the cost range (as the reference's _eps_schedule).
EpsSchedule eps_schedule(const CostRange& range, const std::vector<double>& prices, bool warm,
                         const AuctionParams& ap) {
  double pmax = 0.0;
  for (double p : prices) {
    if (!(std::fabs(p) <= kMaxCost))
      throw std::invalid_argument("auction_assign: a warm-start price is NaN, Inf or too large");
    pmax = std::max(pmax, std::fabs(p));
  }
  const double span = range.span;
  // Below a few ulps of the costs, eps increments would vanish and the auction would never end.
  const double eps_final = std::max(ap.eps_final * span, 64.0 * DBL_EPSILON * (range.amax + pmax + span));
  return {std::max((warm ? ap.eps_warm : ap.eps_start) * span, eps_final), eps_final, span};
}

// Hands the local candidates of the wanted groups (the first count[g] members) to comm.select, then keeps
// in front the local ones at or below the global thresholds.
static void exchange(const Block& b, const double* val, std::vector<std::vector<int64_t>>& members,
              const std::vector<int64_t>& t, Threshold& th) {
  std::vector<int64_t> grp, gid, want, wanted;
  std::vector<double> v;
  for (int64_t g = 0; g < static_cast<int64_t>(members.size()); ++g) {
    if (t[g] <= 0) continue;
    const int64_t w = static_cast<int64_t>(want.size());
    want.push_back(t[g]);
    wanted.push_back(g);
    for (int64_t e = 0; e < th.count[g]; ++e) {
      grp.push_back(w);
      v.push_back(val[members[g][e]]);
      gid.push_back(b.gid(members[g][e]));
    }
  }
  if (want.empty()) return;  // the same on every rank: t is global
  std::vector<double> tv;
  std::vector<int64_t> tg;
  b.comm.select(grp, v, gid, want, tv, tg);
  for (int64_t w = 0; w < static_cast<int64_t>(wanted.size()); ++w) {
    const int64_t g = wanted[w];
    th.val[g] = tv[w];
    th.gid[g] = tg[w];
    auto& mem = members[g];
    auto below = [&](int64_t i) { return key_le(val[i], b.gid(i), tv[w], tg[w]); };
    th.count[g] = std::partition(mem.begin(), mem.begin() + th.count[g], below) - mem.begin();
  }
}

// Per group g, the t[g]-th smallest key (val[i], gid(i)) over the members of every rank (t[g] = 0: none
// wanted; count 0). members[g] is reordered so that its first count[g] entries are the local keys at or
// below the threshold: the t[g] smallest when one process holds them all.
Threshold select_smallest(const Block& b, const double* val, std::vector<std::vector<int64_t>>& members,
                          const std::vector<int64_t>& t) {
  const int64_t groups = static_cast<int64_t>(members.size());
  Threshold th{std::vector<double>(groups, kInf), std::vector<int64_t>(groups, kNoRow),
               std::vector<int64_t>(groups, 0)};
  const bool local = !b.comm.distributed();
  const KeyLess less{val};
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t g = 0; g < groups; ++g) {
    auto& mem = members[g];
    const int64_t size = static_cast<int64_t>(mem.size());
    if (t[g] <= 0) continue;
    // This rank's t[g] smallest first: the only ones that can be the answer.
    if (size >= t[g]) std::nth_element(mem.begin(), mem.begin() + (t[g] - 1), mem.end(), less);
    th.count[g] = std::min(size, t[g]);
    if (local && size >= t[g]) {
      th.val[g] = val[mem[t[g] - 1]];
      th.gid[g] = b.gid(mem[t[g] - 1]);
    }
  }
  if (!local) exchange(b, val, members, t, th);
  return th;
}

}  // namespace auction
}  // namespace cluster_kernels
