// The floor auction's certificate, shared by the CPU (cpu/certificate.cpp) and CUDA (cuda/certificate.cu) floor
// auctions: from the smallest reduced cost differences between clusters, the exact prices that prove the labels
// optimal, when they exist.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace cluster_kernels {
namespace auction {

// The floor auction's certificate (cluster_kernels/kmeans_reference.py, _exact_prices_ref). After a phase, with prices p
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
