// The centroid update of the CUDA Lloyd loop (centroids.cu). The CPU counterpart is cpu/centroids.h.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/device_utils.cuh"
#include "cuda/prepare.cuh"

namespace cluster_kernels {
namespace cuda {

// Buffers of the centroid update, sized once per call.
struct UpdateBuffers {
  int64_t cs, nc;
  DevArray<unsigned> keys, keys_sorted;
  DevArray<int> iota, sidx;
  DevArray<int64_t> seg_off, seg_cnt, bounds, counts, pick, pi;
  DevArray<double> part, sums, own, pv;
  DevArray<unsigned long long> hist;

  UpdateBuffers(Ctx& ctx, int64_t n, int64_t d, int64_t k) : cs(chunk_rows(n)), nc((n + cs - 1) / cs) {
    keys = ctx.alloc<unsigned>(n);
    keys_sorted = ctx.alloc<unsigned>(n);
    iota = ctx.alloc<int>(n);
    sidx = ctx.alloc<int>(n);
    seg_off = ctx.alloc<int64_t>(k);
    seg_cnt = ctx.alloc<int64_t>(k);
    bounds = ctx.alloc<int64_t>(static_cast<size_t>(k * (nc + 1)));
    counts = ctx.alloc<int64_t>(k);
    pick = ctx.alloc<int64_t>(1);
    pi = ctx.alloc<int64_t>(static_cast<size_t>(tiles_for(n)));
    part = ctx.alloc<double>(static_cast<size_t>(nc * k * d));
    sums = ctx.alloc<double>(static_cast<size_t>(k * d));
    own = ctx.alloc<double>(n);
    pv = ctx.alloc<double>(static_cast<size_t>(tiles_for(n)));
    hist = ctx.alloc<unsigned long long>(k);
    fill_iota(ctx, iota.data(), n);
  }
};

// Cluster means (the CPU's chunked double sums, same order) into cent; empty clusters re-seeded as the CPU does.
template <typename T>
void update_centroids(Ctx& ctx, UpdateBuffers& b, const Prepared<T>& p, int64_t n, int64_t d, int64_t k,
                      const int* labels, const double* D, bool spherical, std::vector<double>& cent);

}  // namespace cuda
}  // namespace cluster_kernels
