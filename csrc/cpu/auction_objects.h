// Host-side pieces of the eviction auction shared by the CPU (kmeans.cpp) and CUDA (kmeans.cu)
// paths: the split of clusters into auction objects and the eps schedule's shape.
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

// eps schedule of one auction call: from the first eps down to eps_final; span: the cost range they are
// fractions of.
struct EpsSchedule {
  double eps, eps_final, span;
};

// The floor auction's certificate (cluster_kernels/kmeans.py, _exact_prices_ref). After a phase, with prices p
// and the current labels, slack[a * k + b] is the smallest reduced cost difference (D[i, b] + p[b]) - (D[i, a] +
// p[a]) over the points i of cluster a, kept only where it is below `reach` (certify_reach; +inf elsewhere); counts are the
// cluster sizes. The labels are optimal (exactly, not within eps) iff prices x with x >= 0, x[j] = 0 where
// counts[j] < hi[j] and every point at its exact argmin of D + x exist: difference constraints on y = x - p,
// solved by Bellman-Ford from y = 0 over the clusters and a node T for the bounds (Jacobi sweeps, so the result
// does not depend on any order). The pairs left out (slack >= reach) cannot bind when every y decreased by less
// than reach. Returns false (x untouched) when a negative cycle remains or that check fails; otherwise x are the
// exact prices.
// How far below zero the certificate looks: after a phase every point is within eps of its best, so no price
// moves by more than (k + 1) eps along a path of the K + 1 nodes; twice that leaves room for rounding.
inline double certify_reach(int64_t k, double eps) { return 2.0 * static_cast<double>(k + 1) * eps; }

inline bool exact_prices(int64_t k, const std::vector<double>& slack, const std::vector<double>& p,
                         const std::vector<int64_t>& counts, const int64_t* hi, double reach, std::vector<double>& x) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> y(k + 1, 0.0), next(k + 1);  // y[k]: the node T of the bounds (x_T = 0)
  bool converged = false;
  for (int64_t sweep = 0; sweep < k + 2 && !converged; ++sweep) {
    next = y;
    for (int64_t a = 0; a < k; ++a) {
      for (int64_t b = 0; b < k; ++b) {
        const double w = slack[a * k + b];  // y[a] - y[b] <= w: no point of a prefers b
        if (w < inf && y[b] + w < next[a]) next[a] = y[b] + w;
      }
    }
    for (int64_t j = 0; j < k; ++j) {
      if (y[j] + p[j] < next[k]) next[k] = y[j] + p[j];                          // x[j] >= 0
      if (counts[j] < hi[j] && y[k] - p[j] < next[j]) next[j] = y[k] - p[j];  // x[j] <= 0 below the cap
    }
    converged = next == y;
    y.swap(next);
  }
  if (!converged) return false;
  const double deepest = -*std::min_element(y.begin(), y.end());
  if (!(deepest < reach)) return false;
  x.resize(k);
  for (int64_t j = 0; j < k; ++j) x[j] = (p[j] + y[j]) - y[k];
  return true;
}

}  // namespace auction
}  // namespace cluster_kernels
