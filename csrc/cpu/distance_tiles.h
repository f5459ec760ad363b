// The distance tiles of the CPU K-means (distance_tiles.cpp): D_ij = |x_i|^2 + |c_j|^2 - 2 x_i.c_j, clamped at 0,
// over tiles of prepared rows (prepare.h: centred or unit rows are formed per tile, never stored). The CUDA
// counterpart is cuda/distance_tiles.cuh.
#pragma once

#include <cstdint>

#include "cpu/blas.h"
#include "cpu/centroids.h"
#include "cpu/prepare.h"

namespace cluster_kernels {

// Rows per distance tile. Fixed (never derived from the thread count): each tile is one single-threaded GEMM
// on one OpenMP thread, so the products, hence the labels, do not depend on the number of threads.
constexpr int64_t kTileRows = 256;

// Distances of every prepared row of p (n rows) to k centroids c (k, d) row-major, into out (n, k).
template <typename T>
void sqdist(const Prepared<T>& p, int64_t n, const T* c, const double* cnorm, int64_t k, double* out,
            const Blas* blas);

// Without capacities the assignment is the argmin: per row the nearest centroid (labels, own_new), the distance to
// prev[i] (own_prev; prev may be null) and, with sums, the cluster sums of the new labels, without an n x k matrix.
template <typename T>
void nearest(const Prepared<T>& p, int64_t n, const T* c, const double* cnorm, int64_t k, const Blas* blas,
             const int64_t* prev, int64_t* labels, double* own_new, double* own_prev, ClusterSums* sums);

}  // namespace cluster_kernels
