// The distance tiles of the CUDA K-means (distance_tiles.cuh). The CPU counterpart is cpu/distance_tiles.cpp.
#include "cuda/distance_tiles.cuh"

namespace cluster_kernels {
namespace cuda {

namespace {

// Distances D_ij = max(0, |x_i|^2 + |c_j|^2 - 2 x_i.c_j), in the two forms of the CPU's sqdist:
// k > 1 sums x_i.c_j over t in order; k == 1 (k-means++'s first row) uses dot_lanes. The CPU's
// x86-64-v3 clone (any AVX2 machine) contracts acc += a * b into FMAs, so both forms use FMAs here.
__device__ __forceinline__ double sqdist_value(double xn, double cn, double dot) {
  const double v = __dsub_rn(__dadd_rn(xn, cn), __dmul_rn(2.0, dot));
  return v > 0.0 ? v : 0.0;
}

// The distance tiles are a register-blocked GEMM: a block computes kTilePoints points x kTileCentroids centroids
// of x c^T, each thread kPointsPerThread points x kTileGroup centroids (32 register accumulators), from tiles of
// x and c staged through shared memory tile_chunk<T>() columns at a time.
constexpr int kTileGroup = 8;                                 // centroids per thread
constexpr int kPointsPerThread = 4;                           // points per thread (32 apart: one per warp lane)
constexpr int kTilePoints = 32 * kPointsPerThread;            // points per block tile
constexpr int kTileCentroids = (kThreads / 32) * kTileGroup;  // centroids per block tile (one group per warp)

template <typename T>
constexpr int tile_chunk() {  // columns staged per step: 25 KiB of shared memory for either type
  return sizeof(T) == 4 ? 32 : 16;
}

// k > 1. Warp w of the block owns centroids w * kTileGroup + [0, kTileGroup) of the tile (their shared reads
// are broadcasts), lane l its points l + 32 r (rows padded by one: no bank conflicts); per staged column a
// thread reads kPointsPerThread + kTileGroup values for kPointsPerThread * kTileGroup FMAs. Each dot product is
// still summed over t in order with one FMA per term, so every distance is the same double as a
// one-point-per-thread loop.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sqdist_tile_kernel(const T* __restrict__ x, const double* __restrict__ xnorm, int64_t n, int64_t d,
                       const T* __restrict__ c, const double* __restrict__ cnorm, int64_t k, double* __restrict__ out) {
  constexpr int C = tile_chunk<T>();
  __shared__ T xs[kTilePoints][C + 1];
  __shared__ T cs[kTileCentroids][C];
  const int lane = threadIdx.x & 31;
  const int group = threadIdx.x >> 5;
  const int64_t point_tiles = (n + kTilePoints - 1) / kTilePoints;
  const int64_t centroid_tiles = (k + kTileCentroids - 1) / kTileCentroids;
  for (int64_t tile = blockIdx.x; tile < point_tiles * centroid_tiles; tile += gridDim.x) {  // block-uniform
    const int64_t i0 = (tile / centroid_tiles) * kTilePoints;
    const int64_t j0 = (tile % centroid_tiles) * kTileCentroids;
    T acc[kPointsPerThread][kTileGroup];
#pragma unroll
    for (int r = 0; r < kPointsPerThread; ++r) {
#pragma unroll
      for (int w = 0; w < kTileGroup; ++w) acc[r][w] = T(0);
    }
    for (int64_t t0 = 0; t0 < d; t0 += C) {
      const int width = static_cast<int>(imin(C, d - t0));
      for (int e = threadIdx.x; e < kTilePoints * C; e += kThreads) {
        const int r = e / C, col = e - r * C;
        const int64_t row = i0 + r;
        xs[r][col] = (row < n && col < width) ? x[row * d + t0 + col] : T(0);
      }
      for (int e = threadIdx.x; e < kTileCentroids * C; e += kThreads) {
        const int w = e / C, col = e - w * C;
        const int64_t j = j0 + w;
        cs[w][col] = (j < k && col < width) ? c[j * d + t0 + col] : T(0);
      }
      __syncthreads();
      for (int col = 0; col < width; ++col) {
        T xv[kPointsPerThread], cv[kTileGroup];
#pragma unroll
        for (int r = 0; r < kPointsPerThread; ++r) xv[r] = xs[lane + 32 * r][col];
#pragma unroll
        for (int w = 0; w < kTileGroup; ++w) cv[w] = cs[group * kTileGroup + w][col];
#pragma unroll
        for (int r = 0; r < kPointsPerThread; ++r) {
#pragma unroll
          for (int w = 0; w < kTileGroup; ++w) acc[r][w] = fma_rn(xv[r], cv[w], acc[r][w]);
        }
      }
      __syncthreads();  // before the next chunk overwrites the tiles
    }
#pragma unroll
    for (int r = 0; r < kPointsPerThread; ++r) {
      const int64_t i = i0 + lane + 32 * r;
      if (i >= n) continue;
#pragma unroll
      for (int w = 0; w < kTileGroup; ++w) {
        const int64_t j = j0 + group * kTileGroup + w;
        if (j < k) out[i * k + j] = sqdist_value(xnorm[i], cnorm[j], static_cast<double>(acc[r][w]));
      }
    }
  }
}

// k == 1: the CPU's dot_lanes<T, L>. One warp per point; for float the 32 lanes are the CPU's 32
// accumulators, for double a half-warp is (16 lanes = 16 accumulators), the other half idles.
// Lane l sums x[t] c[t] over t = l, l + L, ... below the last multiple of L, the shuffle-down tree
// adds acc[l + w] into acc[l] for w = L/2 .. 1, and lane 0 adds the tail summed in order.
template <typename T, int L>
__global__ void __launch_bounds__(kThreads)
    sqdist_row_kernel(const T* __restrict__ x, const double* __restrict__ xnorm, int64_t n, int64_t d,
                      const T* __restrict__ c, const double* __restrict__ cnorm, double* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int l = lane % L;
  const bool active = lane < L;
  const int64_t dmain = (d / L) * L;
  const int64_t nwarps = thread_stride() / 32;
  for (int64_t i = thread_index() / 32; i < n; i += nwarps) {  // warp-uniform: all lanes shuffle
    const T* xi = x + i * d;
    T acc = T(0);
    if (active) {
      for (int64_t t = l; t < dmain; t += L) acc = fma_rn(xi[t], c[t], acc);
    }
#pragma unroll
    for (int w = L / 2; w >= 1; w /= 2) acc = add_rn(acc, __shfl_down_sync(0xffffffffu, acc, w, L));
    if (lane == 0) {
      T tail = T(0);
      for (int64_t t = dmain; t < d; ++t) tail = fma_rn(xi[t], c[t], tail);
      out[i] = sqdist_value(xnorm[i], cnorm[0], static_cast<double>(add_rn(acc, tail)));
    }
  }
}

// Exact |x_i - c_{label_i}|^2, summed over columns in order (the CPU's exact_own_distances).
template <typename T>
__global__ void exact_own_kernel(const T* __restrict__ xp, int64_t n, int64_t d, const double* __restrict__ cent,
                                 const int* __restrict__ labels, double* __restrict__ own) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const T* xi = xp + i * d;
    const double* c = cent + int64_t{labels[i]} * d;
    double s = 0.0;
    for (int64_t t = 0; t < d; ++t) {
      const double diff = __dsub_rn(static_cast<double>(xi[t]), c[t]);
      s = __dadd_rn(s, __dmul_rn(diff, diff));
    }
    own[i] = s;
  }
}

}  // namespace

template <typename T>
void launch_sqdist(Ctx& ctx, const T* x, const double* xn, int64_t n, int64_t d, const T* c, const double* cn,
                   int64_t k, double* out) {
  if (k == 1) {
    constexpr int L = sizeof(T) == 4 ? 32 : 16;  // the CPU's lanes<T>()
    sqdist_row_kernel<T, L><<<blocks_for(n, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(x, xn, n, d, c, cn, out);
    CK_LAUNCH("sqdist_row_kernel");
  } else {
    const int64_t tiles = (n + kTilePoints - 1) / kTilePoints * ((k + kTileCentroids - 1) / kTileCentroids);
    sqdist_tile_kernel<T><<<blocks_for(tiles, 1), kThreads, 0, ctx.stream>>>(x, xn, n, d, c, cn, k, out);
    CK_LAUNCH("sqdist_tile_kernel");
  }
}

template <typename T>
void launch_exact_own(Ctx& ctx, const T* x, int64_t n, int64_t d, const double* cent, const int* labels,
                      double* own) {
  exact_own_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(x, n, d, cent, labels, own);
  CK_LAUNCH("exact_own_kernel");
}

template void launch_sqdist<float>(Ctx&, const float*, const double*, int64_t, int64_t, const float*, const double*,
                                  int64_t, double*);
template void launch_sqdist<double>(Ctx&, const double*, const double*, int64_t, int64_t, const double*, const double*,
                                  int64_t, double*);
template void launch_exact_own<float>(Ctx&, const float*, int64_t, int64_t, const double*, const int*, double*);
template void launch_exact_own<double>(Ctx&, const double*, int64_t, int64_t, const double*, const int*, double*);

}  // namespace cuda
}  // namespace cluster_kernels
