// Capacity-constrained K-means on CUDA: host entry points (plain C++, so bindings.cpp compiles with the host
// compiler). The CPU counterpart is cpu/kmeans.h. The algorithm is the one of csrc/cpu and
// cluster_kernels/kmeans_reference.py; every pointer argument named as a uintptr_t is a device pointer, and
// all work is queued on `stream` (a cudaStream_t passed as an integer) on device `device`.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/params.h"

namespace cluster_kernels {
namespace cuda {

// The checks every entry point makes (sizes, bounds, the 2^31 points the device auction indexes).
inline void check_problem(const char* op, int64_t n, int64_t d, int64_t k, const int64_t* lo, const int64_t* hi) {
  const std::string name(op);
  if (n < 1 || d < 1 || k < 1 || k > n)
    throw std::invalid_argument(name + ": need n >= 1, d >= 1 and 1 <= k <= n, got n=" + std::to_string(n) +
                                ", d=" + std::to_string(d) + ", k=" + std::to_string(k));
  if (n > INT_MAX || 2 * k > INT_MAX)
    throw std::invalid_argument(name + ": the CUDA path takes at most 2^31 - 1 points, got n=" + std::to_string(n));
  int64_t sum_lo = 0, sum_hi = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (lo[j] < 0 || lo[j] > hi[j])
      throw std::invalid_argument(name + ": need 0 <= min_size <= max_size for cluster " + std::to_string(j));
    sum_lo += lo[j];
    sum_hi += std::min(hi[j], n);
  }
  if (sum_hi < n || sum_lo > n)
    throw std::invalid_argument(name + ": infeasible capacities (need sum(min_size) <= n <= sum(max_size))");
}

// Number of CUDA devices visible to the runtime; 0 (not an error) without a driver or a GPU.
int device_count();

// x: (n, d) row-major float32 (is_double=false) or float64; init: (k, d) in x's dtype or 0 for
// k-means++. Outputs, preallocated by the caller: labels int64 (n), centroids float64 (k, d) in the
// caller's frame, distances float64 (n). lo/hi are host arrays of k bounds.
// (lloyd.cu) Returns history, n_iter, converged, inertia and auction_rounds; labels, centroids and distances go to
// the output buffers.
KMeansResult capacity_kmeans(uintptr_t x, bool is_double, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
                             uintptr_t init, const KMeansParams& p, uintptr_t labels, uintptr_t centroids,
                             uintptr_t distances, uintptr_t stream, int device);

// Assignment to fixed centroids (k, d) (x's dtype). Outputs: labels int64 (n), distances float64 (n).
void assign_with_capacity(uintptr_t x, bool is_double, int64_t n, int64_t d, uintptr_t centroids, int64_t k,
                          const int64_t* lo, const int64_t* hi, bool spherical, uintptr_t labels, uintptr_t distances,
                          uintptr_t stream, int device);

// The auction alone on a device float64 cost matrix (n, k) (auction.cu); returns the number of rounds.
int64_t auction_assign(uintptr_t dist, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi, uintptr_t labels,
                       uintptr_t stream, int device);

}  // namespace cuda
}  // namespace cluster_kernels
