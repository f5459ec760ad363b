// No CUDA counterpart: the device recomputes every second cost in its regret and re-bid kernels.
// The second-cost cache of the CPU auctions (floor_auction.h, dummy_auction.h): a unit's cheapest other option,
// kept across price changes while it provably stays exact.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/auction_steps.h"

namespace cluster_kernels {
namespace auction {

// Per unit, the cheapest cost over the options other than its own (the "second cost" of a regret), with the
// option giving it (arg), the unit's option then and the tick it was taken at, plus a lower bound of the costs
// of the options other than those two (at first the third cheapest cost). Prices change by ticks. An entry is
// exact while the unit keeps its option, arg keeps its price and no price has dropped anywhere (a rise
// elsewhere cannot lower the minimum; a drop could). When only arg's price changed, arg's new cost still is the
// minimum if it lies below the bound, which holds while no price drops: one cost instead of a scan. The value
// given is then the very double a fresh scan gives (the same sums, the same minimum, the lowest index on equal
// costs), so the cache saves O(m) scans without changing any result.
class SecondCache {
 public:
  SecondCache(int64_t n, int64_t m)
      : sc_(n), sc3_(n), arg_(n, -1), own_(n, -1), stamp_(n, 0), changed_(m, 0) {}

  // Option o's price goes from before to after (serial code only).
  void price(int64_t o, double before, double after) {
    if (after == before) return;
    changed_[o] = ++tick_;
    if (after < before) dropped_ = tick_;
  }
  // Unit i, in option own, with the three cheapest options t (at the current prices).
  void put(int64_t i, int64_t own, const Three& t) {
    if (t.best == own) {
      sc_[i] = t.sc;
      arg_[i] = static_cast<int32_t>(t.second);
      sc3_[i] = t.tc;
    } else {
      sc_[i] = t.bc;
      arg_[i] = static_cast<int32_t>(t.best);
      sc3_[i] = t.second == own ? t.tc : t.sc;
    }
    own_[i] = static_cast<int32_t>(own);
    stamp_[i] = tick_;
  }
  // The options `js` (distinct) had their prices lowered since the last call, and nothing read the cache in
  // between (serial code; cost(i, j): unit i's cost for option j at j's new price). The entries take those new
  // costs into account and stay usable: one pass for a whole batch of drops (a phase start's reverse steps)
  // instead of losing every entry. An exact entry whose arg is in `js` keeps arg as the cheapest of the others
  // (a drop only lowers it), so the fresh costs of `js` decide; an entry that was not exact only lowers its bound.
  template <class Cost>
  void lowered(const std::vector<int64_t>& js, Cost cost) {
    if (js.empty()) return;
    const int64_t t = ++tick_;
    const int64_t n = static_cast<int64_t>(sc_.size());
    const int64_t nj = static_cast<int64_t>(js.size());
    std::vector<char> dropped(changed_.size(), 0);
    for (int64_t j : js) dropped[j] = 1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t own = own_[i], a = arg_[i];
      if (own < 0 || stamp_[i] < dropped_) continue;  // no entry, or one a drop elsewhere has voided
      const bool exact = a < 0 || changed_[a] <= stamp_[i];
      int64_t arg = a;
      double best = exact ? (a >= 0 && dropped[a] ? cost(i, a) : sc_[i]) : kInf;
      double bound = sc3_[i];
      for (int64_t e = 0; e < nj; ++e) {
        const int64_t j = js[e];
        if (j == own || j == a) continue;
        const double v = cost(i, j);
        if (exact && (v < best || (v == best && j < arg))) {  // the lowest index among equal costs, as a scan
          bound = std::min(bound, best);
          best = v;
          arg = j;
        } else {
          bound = std::min(bound, v);
        }
      }
      sc3_[i] = bound;
      if (!exact) continue;
      sc_[i] = best;
      arg_[i] = static_cast<int32_t>(arg);
      stamp_[i] = t;
    }
    for (int64_t j : js) changed_[j] = t;
  }
  // Unit i's cached second cost while in option own, if it is known (cost(o): option o's cost at its price now).
  template <class Cost>
  bool get(int64_t i, int64_t own, double* sc, Cost cost) {
    if (own_[i] != own || stamp_[i] < dropped_) return false;
    const int64_t a = arg_[i];
    if (a >= 0 && changed_[a] > stamp_[i]) {
      const double v = cost(a);  // only arg's price changed: its cost now, the others are at least sc3_
      if (!(v < sc3_[i])) return false;
      sc_[i] = v;
      stamp_[i] = tick_;
    }
    *sc = sc_[i];
    return true;
  }
  // Unit i's exact cheapest cost(o) over the m options other than `own`: the cached value, or a scan (then cached).
  template <class Cost>
  double value(int64_t i, int64_t own, int64_t m, Cost cost) {
    double sc;
    if (!get(i, own, &sc, cost)) {
      put(i, own, best_three(m, cost));
      sc = sc_[i];
    }
    return sc;
  }

 private:
  std::vector<double> sc_, sc3_;
  std::vector<int32_t> arg_, own_;
  std::vector<int64_t> stamp_, changed_;
  int64_t tick_ = 0, dropped_ = 0;
};

}  // namespace auction
}  // namespace cluster_kernels
