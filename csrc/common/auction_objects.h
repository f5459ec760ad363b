// Host-side pieces of the eviction auction shared by the CPU (csrc/cpu) and CUDA (csrc/cuda) auctions: the split of
// clusters into auction objects, the dummy units' first placement and the eps schedule's shape.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace cluster_kernels {
namespace auction {

// Largest |cost| (and |warm-start price|) an auction accepts. Prices stay within a few cost spans of the costs,
// so cost + price never overflows below it; beyond it (or at a NaN / Inf) an argmin could find no finite
// candidate, and the index taken from such a comparison (-1) would address memory outside the counts.
constexpr double kMaxCost = DBL_MAX / 64.0;

// Each cluster becomes a mandatory object (lo slots, real points only) and an optional object
// (hi - lo slots, real points or zero-cost dummy units).
struct Objects {
  std::vector<int64_t> cluster, cap;
  std::vector<char> dummy_ok;
  Objects(const int64_t* lo, const int64_t* hi, int64_t k) {
    for (int64_t j = 0; j < k; ++j) {
      if (lo[j] > 0) add(j, lo[j], false);
      if (hi[j] > lo[j]) add(j, hi[j] - lo[j], true);
    }
  }
  void add(int64_t j, int64_t c, bool d) {
    cluster.push_back(j);
    cap.push_back(c);
    dummy_ok.push_back(d ? 1 : 0);
  }
  int64_t size() const { return static_cast<int64_t>(cluster.size()); }
};

// Places the caps leave free over all rows (all ranks): sum(hi) - n_total (0 under exact balance).
inline int64_t free_places(int64_t n_total, const int64_t* hi, int64_t k) {
  int64_t free = -n_total;
  for (int64_t j = 0; j < k; ++j) free += hi[j];
  return free;
}

// The cheapest object that may hold dummies, other than `exclude` (lowest index on ties); -1 if none.
inline int64_t cheapest_dummy_object(const std::vector<double>& prices, const Objects& ob, int64_t exclude) {
  int64_t best = -1;
  double bp = std::numeric_limits<double>::infinity();
  for (int64_t o = 0; o < ob.size(); ++o) {
    if (ob.dummy_ok[o] && o != exclude && prices[o] < bp) {
      best = o;
      bp = prices[o];
    }
  }
  return best;
}

// Initial dummy units: sum(hi) - n of them fill the free room of the dummy-capable objects in order
// of ascending price (stable); any left over go to the cheapest such object.
inline std::vector<int64_t> place_dummies(const std::vector<double>& prices, const Objects& ob,
                                          const std::vector<int64_t>& real, int64_t n_dummy) {
  const int64_t m = ob.size();
  std::vector<int64_t> dummies(m, 0), order(m);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return prices[a] < prices[b]; });
  int64_t left = n_dummy;
  for (int64_t o : order) {
    if (!ob.dummy_ok[o] || left == 0) continue;
    const int64_t put = std::min(std::max<int64_t>(ob.cap[o] - real[o], 0), left);
    dummies[o] = put;
    left -= put;
  }
  if (left > 0) dummies[cheapest_dummy_object(prices, ob, -1)] += left;
  return dummies;
}

// At a phase start (eps just shrunk): the dummy units of every object priced more than eps above the cheapest
// dummy-capable object move to that one, so no dummy unit sits more than eps above its best.
inline void gather_dummies(const std::vector<double>& prices, const Objects& ob, double eps,
                           std::vector<int64_t>& dummies) {
  const int64_t cheapest = cheapest_dummy_object(prices, ob, -1);
  for (int64_t o = 0; o < ob.size(); ++o) {
    if (o != cheapest && dummies[o] > 0 && prices[o] > prices[cheapest] + eps) {
      dummies[cheapest] += dummies[o];
      dummies[o] = 0;
    }
  }
}

// eps schedule of one auction call: from the first eps down to eps_final; span: the cost range they are
// fractions of.
struct EpsSchedule {
  double eps, eps_final, span;
};

}  // namespace auction
}  // namespace cluster_kernels
