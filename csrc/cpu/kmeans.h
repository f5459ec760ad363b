// Capacity-constrained K-means, CPU (C++17 + OpenMP): the entry points. The CUDA counterpart is cuda/kmeans.cuh.
//
// The maths and the algorithm are described in cluster_kernels/kmeans_reference.py (module docstring), whose
// float64 functions this code ports (the table there maps each to its file). The Lloyd loop is lloyd.cpp; the
// auction auction.h. Everything is deterministic and independent of the number of threads: parallel loops write
// disjoint outputs, and every floating-point reduction runs over fixed-size chunks combined in a fixed order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/params.h"
#include "cpu/blas.h"

namespace cluster_kernels {

// Full Lloyd loop (lloyd.cpp). x is (n, d) row-major; init (k, d) or nullptr for k-means++.
template <typename T>
KMeansResult capacity_kmeans(const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
                             const T* init, const KMeansParams& p);

// Assignment to fixed centroids (k, d) (lloyd.cpp). Writes labels and distances (n,).
template <typename T>
void assign_with_capacity(const T* x, int64_t n, int64_t d, const T* centroids, int64_t k, const int64_t* lo,
                          const int64_t* hi, bool spherical, int n_threads, int64_t* labels, double* distances,
                          const Blas* blas = nullptr);

// Whether the extension was built with OpenMP, and its default thread count (lloyd.cpp).
bool openmp_enabled();
int openmp_max_threads();

}  // namespace cluster_kernels
