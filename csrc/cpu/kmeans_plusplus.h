// Greedy k-means++ (2 + ln k local trials, splitmix64 draws) on the prepared rows: the k first centroids, in the
// prepared frame (kmeans_plusplus.cpp). The CUDA counterpart is cuda/kmeans_plusplus.cuh.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/blas.h"
#include "cpu/prepare.h"

namespace cluster_kernels {

template <typename T>
std::vector<double> kmeans_plusplus(const Prepared<T>& p, int64_t n, int64_t k, SplitMix64& rng, const Blas* blas);

}  // namespace cluster_kernels
