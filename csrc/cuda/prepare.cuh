// The frame of the CUDA Lloyd iterations (prepare.cu): the prepared rows, their norms, the centroids in the
// distance tiles' type. The CPU counterpart is cpu/prepare.h.
#pragma once

#include <cstdint>
#include <vector>

#include "common/rows.h"
#include "cuda/device_utils.cuh"

namespace cluster_kernels {
namespace cuda {

// Centred (or unit-row) copy of x in T, its row norms, and the mean that was removed (host). Unlike the CPU's
// frame (cpu/prepare.h, rows formed per tile) it is a stored n x d copy; forming the rows inside the distance
// tiles here too is left for a session with a GPU to check it.
template <typename T>
struct Prepared {
  DevArray<T> x;
  DevArray<double> xnorm;
  std::vector<double> mean;
};

template <typename T>
Prepared<T> prepare(Ctx& ctx, const T* x, int64_t n, int64_t d, bool spherical);

// normalise_rows (host): common/rows.h, the CPU's one.

// Centroids in T and their squared norms, on the host as the CPU's to_T, then on the device.
template <typename T>
void upload_centroids(Ctx& ctx, const std::vector<double>& c, int64_t k, int64_t d, DevArray<T>& ct_dev,
                      DevArray<double>& cn_dev);

// Prepared row `row`, in float64 on the host.
template <typename T>
std::vector<double> device_row(Ctx& ctx, const Prepared<T>& p, int64_t d, int64_t row);

}  // namespace cuda
}  // namespace cluster_kernels
