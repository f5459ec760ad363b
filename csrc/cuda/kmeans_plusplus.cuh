// Greedy k-means++ on the device (kmeans_plusplus.cu). The CPU counterpart is cpu/kmeans_plusplus.h.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cuda/prepare.cuh"
#include "cuda/reductions.cuh"

namespace cluster_kernels {
namespace cuda {

template <typename T>
std::vector<double> kmeans_plusplus(Ctx& ctx, const Prepared<T>& p, int64_t n, int64_t d, int64_t k, SplitMix64& rng,
                                    Reducer& red);

}  // namespace cuda
}  // namespace cluster_kernels
