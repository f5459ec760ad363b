// The distance tiles of the CUDA K-means (distance_tiles.cu). The CPU counterpart is cpu/distance_tiles.h.
#pragma once

#include <cstdint>

#include "cuda/device_utils.cuh"

namespace cluster_kernels {
namespace cuda {

// D_ij = max(0, |x_i|^2 + |c_j|^2 - 2 x_i.c_j) of the n rows x to the k centroids c, into out (n, k).
template <typename T>
void launch_sqdist(Ctx& ctx, const T* x, const double* xn, int64_t n, int64_t d, const T* c, const double* cn,
                   int64_t k, double* out);

// Exact |x_i - c_{label_i}|^2 (cent: float64 (k, d)), summed over the columns in order, into own (n).
template <typename T>
void launch_exact_own(Ctx& ctx, const T* x, int64_t n, int64_t d, const double* cent, const int* labels,
                      double* own);

}  // namespace cuda
}  // namespace cluster_kernels
