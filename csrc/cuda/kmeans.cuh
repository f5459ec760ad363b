// Capacity-constrained K-means on CUDA: host entry points (plain C++ declarations, so bindings.cpp
// compiles with the host compiler). The algorithm is the one of csrc/cpu/kmeans.cpp and
// cluster_kernels/kmeans.py; every pointer argument named as a uintptr_t is a device pointer, and
// all work is queued on `stream` (a cudaStream_t passed as an integer) on device `device`.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/kmeans.h"

namespace cluster_kernels {
namespace cuda {

struct CudaKMeansResult {
  std::vector<double> history;  // objective after each assignment step (cosine: halved)
  int n_iter = 0;
  bool converged = false;
  double inertia = 0.0;
  int64_t auction_rounds = 0;
};

// Number of CUDA devices visible to the runtime; 0 (not an error) without a driver or a GPU.
int device_count();

// x: (n, d) row-major float32 (is_double=false) or float64; init: (k, d) in x's dtype or 0 for
// k-means++. Outputs, preallocated by the caller: labels int64 (n), centroids float64 (k, d) in the
// caller's frame, distances float64 (n). lo/hi are host arrays of k bounds.
CudaKMeansResult capacity_kmeans_cuda(uintptr_t x, bool is_double, int64_t n, int64_t d, const int64_t* lo,
                                      const int64_t* hi, uintptr_t init, const KMeansParams& p, uintptr_t labels,
                                      uintptr_t centroids, uintptr_t distances, uintptr_t stream, int device);

// Assignment to fixed centroids (k, d) (x's dtype). Outputs: labels int64 (n), distances float64 (n).
void assign_with_capacity_cuda(uintptr_t x, bool is_double, int64_t n, int64_t d, uintptr_t centroids, int64_t k,
                               const int64_t* lo, const int64_t* hi, bool spherical, uintptr_t labels,
                               uintptr_t distances, uintptr_t stream, int device);

// The auction alone on a device float64 cost matrix (n, k); returns the number of rounds.
int64_t auction_assign_cuda(uintptr_t dist, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                            uintptr_t labels, uintptr_t stream, int device);

}  // namespace cuda
}  // namespace cluster_kernels
