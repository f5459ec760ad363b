// The centroid update of the CUDA Lloyd loop (centroids.cuh). The CPU counterpart is cpu/centroids.cpp.
#include "cuda/centroids.cuh"

#include <math_constants.h>

#include <stdexcept>

namespace cluster_kernels {
namespace cuda {

namespace {

__global__ void label_keys_kernel(const int* __restrict__ labels, int64_t n, unsigned* __restrict__ keys) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) keys[i] = static_cast<unsigned>(labels[i]);
}

// bounds[j * (nc + 1) + c]: first sorted position of cluster j whose point index is >= c * cs. The
// indices of a cluster's segment are increasing (stable sort), so this is a binary search.
__global__ void chunk_bounds_kernel(const int* __restrict__ sidx, const int64_t* __restrict__ seg_off,
                                    const int64_t* __restrict__ seg_cnt, int64_t k, int64_t nc, int64_t cs,
                                    int64_t* __restrict__ bounds) {
  for (int64_t g = thread_index(); g < k * (nc + 1); g += thread_stride()) {
    const int64_t j = g / (nc + 1), c = g - j * (nc + 1);
    const int64_t target = c * cs;
    int64_t lo = seg_off[j], hi = seg_off[j] + seg_cnt[j];
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (int64_t{sidx[mid]} < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[g] = lo;
  }
}

// part[(c * k + j) * d + t] = sum of x[i, t] over the points i of cluster j in chunk c, in index
// order: the CPU's per-chunk partial sums. Consecutive threads take consecutive columns.
template <typename T>
__global__ void partial_sums_kernel(const T* __restrict__ xp, int64_t d, const int* __restrict__ sidx,
                                    const int64_t* __restrict__ bounds, int64_t k, int64_t nc,
                                    double* __restrict__ part) {
  const int64_t kd = k * d;
  for (int64_t g = thread_index(); g < nc * kd; g += thread_stride()) {
    const int64_t c = g / kd, r = g - c * kd;
    const int64_t j = r / d, t = r - j * d;
    const int64_t b0 = bounds[j * (nc + 1) + c], b1 = bounds[j * (nc + 1) + c + 1];
    double s = 0.0;
    for (int64_t p = b0; p < b1; ++p) s = __dadd_rn(s, static_cast<double>(xp[int64_t{sidx[p]} * d + t]));
    part[g] = s;
  }
}

__global__ void final_sums_kernel(const double* __restrict__ part, int64_t kd, int64_t nc, double* __restrict__ sums) {
  for (int64_t g = thread_index(); g < kd; g += thread_stride()) {
    double s = 0.0;
    for (int64_t c = 0; c < nc; ++c) s = __dadd_rn(s, part[c * kd + g]);
    sums[g] = s;
  }
}

__global__ void gather_own_kernel(const double* __restrict__ D, const int* __restrict__ labels, int64_t n, int64_t k,
                                  double* __restrict__ own) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) own[i] = D[i * k + labels[i]];
}

__device__ __forceinline__ bool farther(double va, int64_t ia, double vb, int64_t ib) {
  return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ void block_argmax(double* sv, int64_t* si, double v, int64_t i, double* ov, int64_t* oi) {
  sv[threadIdx.x] = v;
  si[threadIdx.x] = i;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w && farther(sv[threadIdx.x + w], si[threadIdx.x + w], sv[threadIdx.x],
                                                     si[threadIdx.x])) {
      sv[threadIdx.x] = sv[threadIdx.x + w];
      si[threadIdx.x] = si[threadIdx.x + w];
    }
    __syncthreads();
  }
  *ov = sv[0];
  *oi = si[0];
  __syncthreads();
}

// Re-seeding an empty cluster: the first point of largest own distance (> -1, i.e. not yet taken)
// among the clusters of more than one point. (value, lowest index) is a total order, so the tree's
// shape does not matter.
__global__ void __launch_bounds__(kThreads)
    argmax_tiles_kernel(const double* __restrict__ own, const int* __restrict__ labels,
                        const int64_t* __restrict__ counts, int64_t n, int64_t ntiles, double* __restrict__ pv,
                        int64_t* __restrict__ pi) {
  __shared__ double sv[kThreads];
  __shared__ int64_t si[kThreads];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    double bv = -CUDART_INF;
    int64_t bi = n;
    for (int q = 0; q < kSumItems; ++q) {
      const int64_t i = tile * kSumTile + int64_t{q} * kThreads + threadIdx.x;
      if (i < n && counts[labels[i]] > 1) {
        const double v = own[i];
        if (v > -1.0 && farther(v, i, bv, bi)) {
          bv = v;
          bi = i;
        }
      }
    }
    double tv;
    int64_t ti;
    block_argmax(sv, si, bv, bi, &tv, &ti);
    if (threadIdx.x == 0) {
      pv[tile] = tv;
      pi[tile] = ti;
    }
  }
}

__global__ void __launch_bounds__(kThreads) argmax_final_kernel(const double* __restrict__ pv,
                                                                const int64_t* __restrict__ pi, int64_t ntiles,
                                                                int64_t n, int64_t* __restrict__ out) {
  __shared__ double sv[kThreads];
  __shared__ int64_t si[kThreads];
  double bv = -CUDART_INF;
  int64_t bi = n;
  for (int64_t b = threadIdx.x; b < ntiles; b += kThreads) {
    if (farther(pv[b], pi[b], bv, bi)) {
      bv = pv[b];
      bi = pi[b];
    }
  }
  double tv;
  int64_t ti;
  block_argmax(sv, si, bv, bi, &tv, &ti);
  if (threadIdx.x == 0) *out = (tv > -1.0 && ti < n) ? ti : -1;
}

// Cluster sums of the CPU's chunks, in its order: indices sorted by label (stable), so every (chunk, cluster)
// pair owns a contiguous, index-ordered run; returns the counts and writes the sums (k, d) to the host.
template <typename T>
std::vector<int64_t> cluster_sums(Ctx& ctx, UpdateBuffers& b, const Prepared<T>& p, int64_t n, int64_t d, int64_t k,
                                  const int* labels, std::vector<double>& sums) {
  std::vector<int64_t> counts = histogram(ctx, b.hist, labels, n, static_cast<int>(k));
  label_keys_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(labels, n, b.keys.data());
  CK_LAUNCH("label_keys_kernel");
  sort_pairs<unsigned>(ctx, b.keys.data(), b.keys_sorted.data(), b.iota.data(), b.sidx.data(), n, radix_bits(k));
  std::vector<int64_t> seg_off(k);
  int64_t off = 0;
  for (int64_t j = 0; j < k; ++j) {
    seg_off[j] = off;
    off += counts[j];
  }
  ctx.to_device(b.seg_off.data(), seg_off.data(), seg_off.size());
  ctx.to_device(b.seg_cnt.data(), counts.data(), counts.size());
  chunk_bounds_kernel<<<blocks_for(k * (b.nc + 1)), kThreads, 0, ctx.stream>>>(
      b.sidx.data(), b.seg_off.data(), b.seg_cnt.data(), k, b.nc, b.cs, b.bounds.data());
  CK_LAUNCH("chunk_bounds_kernel");
  partial_sums_kernel<T><<<blocks_for(b.nc * k * d), kThreads, 0, ctx.stream>>>(p.x.data(), d, b.sidx.data(),
                                                                                 b.bounds.data(), k, b.nc,
                                                                                 b.part.data());
  CK_LAUNCH("partial_sums_kernel");
  final_sums_kernel<<<blocks_for(k * d), kThreads, 0, ctx.stream>>>(b.part.data(), k * d, b.nc, b.sums.data());
  CK_LAUNCH("final_sums_kernel");
  sums.resize(static_cast<size_t>(k) * d);
  ctx.to_host(sums.data(), b.sums.data(), sums.size());
  ctx.sync();
  return counts;
}

// Re-seeds the empty cluster j at the first point of largest own distance among the clusters of more than
// one point (own distances gathered from D on the first call: own_ready).
template <typename T>
void reseed(Ctx& ctx, UpdateBuffers& b, const Prepared<T>& p, int64_t n, int64_t d, int64_t k, const int* labels,
            const double* D, int64_t j, std::vector<int64_t>& counts, bool& own_ready, std::vector<double>& cent) {
  if (!own_ready) {
    gather_own_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(D, labels, n, k, b.own.data());
    CK_LAUNCH("gather_own_kernel");
    own_ready = true;
  }
  ctx.to_device(b.counts.data(), counts.data(), counts.size());
  const int64_t nt = tiles_for(n);
  argmax_tiles_kernel<<<blocks_for(nt, 1), kThreads, 0, ctx.stream>>>(b.own.data(), labels, b.counts.data(), n, nt,
                                                                      b.pv.data(), b.pi.data());
  CK_LAUNCH("argmax_tiles_kernel");
  argmax_final_kernel<<<1, kThreads, 0, ctx.stream>>>(b.pv.data(), b.pi.data(), nt, n, b.pick.data());
  CK_LAUNCH("argmax_final_kernel");
  const int64_t pick = ctx.read(b.pick.data());
  if (pick < 0) throw std::runtime_error("capacity_kmeans: cannot re-seed an empty cluster (internal error)");
  const std::vector<double> row = device_row(ctx, p, d, pick);
  std::copy(row.begin(), row.end(), cent.begin() + j * d);
  const int label = ctx.read(labels + pick);
  --counts[label];
  const double taken = -1.0;
  ctx.to_device(b.own.data() + pick, &taken, 1);
  ctx.sync();
}

}  // namespace

// Cluster means (the CPU's chunked double sums, same order); empty clusters re-seeded at the point
// farthest from its own centroid among clusters of size > 1, exactly as the reference does.
template <typename T>
void update_centroids(Ctx& ctx, UpdateBuffers& b, const Prepared<T>& p, int64_t n, int64_t d, int64_t k,
                      const int* labels, const double* D, bool spherical, std::vector<double>& cent) {
  std::vector<double> sums;
  std::vector<int64_t> counts = cluster_sums(ctx, b, p, n, d, k, labels, sums);
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] == 0) continue;
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = sums[j * d + t] / static_cast<double>(counts[j]);
  }
  bool own_ready = false;
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] == 0) reseed(ctx, b, p, n, d, k, labels, D, j, counts, own_ready, cent);
  }
  if (spherical) normalise_rows(cent, k, d);
}

template void update_centroids<float>(Ctx&, UpdateBuffers&, const Prepared<float>&, int64_t, int64_t, int64_t, const int*,
                                      const double*, bool, std::vector<double>&);
template void update_centroids<double>(Ctx&, UpdateBuffers&, const Prepared<double>&, int64_t, int64_t, int64_t, const int*,
                                      const double*, bool, std::vector<double>&);

}  // namespace cuda
}  // namespace cluster_kernels
