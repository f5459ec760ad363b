// Capacity-constrained K-means on CUDA, the Lloyd driver: csrc/cpu/kmeans.cpp moved onto the GPU step for step
// (the auction: auction.cu, the helpers every file shares: device_utils.cuh).
//
// Same prepared data, same eviction auction (the floor form first, the general form with dummy units
// only when the lower bounds are not met), same eps schedule, same splitmix64 k-means++ draws, same
// empty-cluster re-seeding, convergence test and "keep the previous labels unless the new assignment
// is cheaper" guard. Read kmeans.cpp first: the host code below follows it.
//
// Parallel decomposition
// * Per-point work runs on the device with grid-stride loops and int64 offsets: centring, distances
//   (a register-blocked GEMM: tiles of 128 points x 64 centroids per block, 4 x 8 per thread, staged through
//   shared memory), sums. Nothing per point goes to the host.
// * Cluster sums sort point indices by label (stable), so every (row chunk, cluster) pair owns a
//   contiguous, index-ordered run; one thread per (chunk, cluster, column) sums its run in order.
//
// Determinism: no floating-point atomics and no order that depends on scheduling. Integer atomics
// (histograms) are exact; CUB's radix sort is deterministic and stable. Two runs give bit-identical results.
//
// Agreement with the CPU: since the CPU's distance tiles are BLAS GEMMs, it uses rows in place when their mean is
// small next to their spread, and it sums row norms over 8 lanes, the two paths agree to rounding (labels equal
// except near-ties) rather than bit for bit; mirroring those three here is left for a session with a GPU to check
// it. What follows is the agreement with the CPU as it was (its portable loop, CLUSTER_KERNELS_BLAS=0, and always
// centred data). Arithmetic that decides labels is written in the order of the CPU's portable
// distance kernel (the in-order tile loop of kmeans.cpp, used there when no BLAS is registered) with
// explicitly rounded intrinsics (__dadd_rn, __fma_rn, ...), so nvcc neither fuses nor splits it:
// * the centring mean and the cluster sums use the CPU's chunking (chunk_rows) and summation order;
// * distances to k > 1 centroids are an FMA chain over the features in order, as the CPU's register
//   tile compiles in its x86-64-v3 clone (every AVX2 machine): bit-identical there. For k == 1
//   (k-means++'s first row) the CPU's dot_lanes is mirrored (lane l of a warp is its accumulator
//   acc[l], the shuffle-down tree its pairwise tree, lane 0 adds the tail), but GCC compiles its
//   tail partly fused and partly not, so those distances agree to a float ulp only;
// * the objective, the k-means++ potentials and the inertia are the CPU's chunked sums (serial per
//   chunk, at most 256 chunks).
// The k-means++ draw walks a tile prefix of the weights (a fixed tree per tile) instead of the CPU's
// running sum over all points, so a draw can differ only when it falls within rounding of a boundary.
#include "cuda/kmeans.cuh"

#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/auction.cuh"
#include "cuda/device_utils.cuh"

namespace cluster_kernels {
namespace cuda {
namespace {

// ------------------------------------------------------------------------------------------------
// Kernels: preparation and distances
// ------------------------------------------------------------------------------------------------

// part[c * d + t] = sum of x[i, t] over the rows i of chunk c, in row order (the CPU's prepare()).
template <typename T>
__global__ void column_chunk_sums_kernel(const T* __restrict__ x, int64_t n, int64_t d, int64_t cs, int64_t nc,
                                         double* __restrict__ part) {
  for (int64_t g = thread_index(); g < nc * d; g += thread_stride()) {
    const int64_t c = g / d, t = g - c * d;
    const int64_t end = imin(n, (c + 1) * cs);
    double s = 0.0;
    for (int64_t i = c * cs; i < end; ++i) s = __dadd_rn(s, static_cast<double>(x[i * d + t]));
    part[g] = s;
  }
}

__global__ void mean_kernel(const double* __restrict__ part, int64_t nc, int64_t d, int64_t n,
                            double* __restrict__ mean) {
  for (int64_t t = thread_index(); t < d; t += thread_stride()) {
    double m = 0.0;
    for (int64_t c = 0; c < nc; ++c) m = __dadd_rn(m, part[c * d + t]);
    mean[t] = __ddiv_rn(m, static_cast<double>(n));
  }
}

// One thread per row: the row norm is a sequential sum over columns, as on the CPU.
template <typename T>
__global__ void prepare_rows_kernel(const T* __restrict__ x, const double* __restrict__ mean, int64_t n, int64_t d,
                                    bool spherical, T* __restrict__ xp, double* __restrict__ xnorm, int* zero_row) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const T* src = x + i * d;
    T* dst = xp + i * d;
    double inv = 0.0;
    if (spherical) {
      double s = 0.0;
      for (int64_t t = 0; t < d; ++t) {
        const double v = static_cast<double>(src[t]);
        s = __dadd_rn(s, __dmul_rn(v, v));
      }
      const double nrm = __dsqrt_rn(s);
      if (nrm == 0.0) atomicExch(zero_row, 1);
      inv = nrm > 0.0 ? __ddiv_rn(1.0, nrm) : 0.0;
    }
    double s2 = 0.0;
    for (int64_t t = 0; t < d; ++t) {
      const double v64 = static_cast<double>(src[t]);
      const T v = static_cast<T>(spherical ? __dmul_rn(v64, inv) : __dsub_rn(v64, mean[t]));
      dst[t] = v;
      const double vd = static_cast<double>(v);
      s2 = __dadd_rn(s2, __dmul_rn(vd, vd));
    }
    xnorm[i] = s2;
  }
}

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

// ------------------------------------------------------------------------------------------------
// Kernels: deterministic sums
// ------------------------------------------------------------------------------------------------

struct ArrayTerm {
  const double* a;
  __device__ double operator()(int64_t i) const { return a[i]; }
};

struct OwnCostTerm {  // D[i, label_i]
  const double* D;
  const int* labels;
  int64_t k;
  __device__ double operator()(int64_t i) const { return D[i * k + labels[i]]; }
};

__device__ __forceinline__ double block_tree_sum(double* sh, double v) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  const double total = sh[0];
  __syncthreads();  // sh is reused by the caller's next tile
  return total;
}

template <typename F>
__global__ void __launch_bounds__(kThreads) tile_sums_kernel(F f, int64_t n, int64_t ntiles, double* __restrict__ part) {
  __shared__ double sh[kThreads];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {  // block-uniform
    double s = 0.0;
    const int64_t base = tile * kSumTile + threadIdx.x;
    for (int q = 0; q < kSumItems; ++q) {
      const int64_t i = base + int64_t{q} * kThreads;
      if (i < n) s = __dadd_rn(s, f(i));
    }
    const double total = block_tree_sum(sh, s);
    if (threadIdx.x == 0) part[tile] = total;
  }
}

// The CPU's chunked_sum: one thread per chunk of chunk_rows(n) points (at most 256 chunks) sums
// in order, then one thread adds the chunks in order. Serial by design: the objective, the
// k-means++ potentials and the inertia come out bit-identical to the CPU's.
template <typename F>
__global__ void chunk_sums_kernel(F f, int64_t n, int64_t cs, int64_t nc, double* __restrict__ part) {
  for (int64_t c = thread_index(); c < nc; c += thread_stride()) {
    const int64_t end = imin(n, (c + 1) * cs);
    double s = 0.0;
    for (int64_t i = c * cs; i < end; ++i) s = __dadd_rn(s, f(i));
    part[c] = s;
  }
}

__global__ void sequential_sum_kernel(const double* __restrict__ part, int64_t count, double* __restrict__ out) {
  if (thread_index() != 0) return;
  double total = 0.0;
  for (int64_t c = 0; c < count; ++c) total = __dadd_rn(total, part[c]);
  *out = total;
}

// P[0] = 0, P[b + 1] = P[b] + part[b]: sequential, hence non-decreasing for non-negative terms.
__global__ void tile_prefix_kernel(const double* __restrict__ part, int64_t ntiles, double* __restrict__ P) {
  if (thread_index() != 0) return;
  double run = 0.0;
  P[0] = 0.0;
  for (int64_t b = 0; b < ntiles; ++b) {
    run = __dadd_rn(run, part[b]);
    P[b + 1] = run;
  }
}

// ------------------------------------------------------------------------------------------------
// Kernels: k-means++
// ------------------------------------------------------------------------------------------------

// std::min(closest[i], cand[i * trials + t]) of the CPU: the first argument unless the second is smaller.
__device__ __forceinline__ double min_of(double a, double b) { return b < a ? b : a; }

struct MinColumnTerm {  // min(closest[i], cand[i, t]): the potential of candidate t
  const double* closest;
  const double* cand;
  int64_t trials, t;
  __device__ double operator()(int64_t i) const { return min_of(closest[i], cand[i * trials + t]); }
};

__global__ void min_column_kernel(const double* __restrict__ closest, const double* __restrict__ cand, int64_t n,
                                  int64_t trials, int64_t t, double* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = min_of(closest[i], cand[i * trials + t]);
}

// The candidates' rows and squared norms, gathered so one distance pass serves all of them.
template <typename T>
__global__ void gather_rows_kernel(const T* __restrict__ xp, const double* __restrict__ xnorm, int64_t d,
                                   const int64_t* __restrict__ rows, int64_t count, T* __restrict__ out,
                                   double* __restrict__ out_norm) {
  for (int64_t g = thread_index(); g < count * d; g += thread_stride()) {
    const int64_t r = g / d, t = g - r * d;
    out[g] = xp[rows[r] * d + t];
    if (t == 0) out_norm[r] = xnorm[rows[r]];
  }
}

// The CPU draws upper_bound(cum, r) on the running sum of the weights w. Here the running sum is
// P[b] (tile prefix) plus the in-order sum inside tile b: find the first tile whose end exceeds r,
// then walk it. If rounding leaves r beyond the walk, take the tile's last point of positive weight.
__global__ void kpp_search_kernel(const double* __restrict__ w, int64_t n, const double* __restrict__ P,
                                  int64_t ntiles, const double* __restrict__ rs, int trials, int64_t* __restrict__ out) {
  for (int t = static_cast<int>(thread_index()); t < trials; t += static_cast<int>(thread_stride())) {
    const double r = rs[t];
    int64_t lo = 0, hi = ntiles;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (P[mid + 1] > r) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    int64_t pick = n - 1;
    if (lo < ntiles) {
      const int64_t begin = lo * kSumTile, end = imin(n, begin + kSumTile);
      double run = P[lo];
      int64_t last_positive = end - 1, found = -1;
      for (int64_t i = begin; i < end; ++i) {
        const double wi = w[i];
        if (wi > 0.0) last_positive = i;
        run = __dadd_rn(run, wi);
        if (run > r) {
          found = i;
          break;
        }
      }
      pick = found >= 0 ? found : last_positive;
    }
    out[t] = imin(pick, n - 1);
  }
}


// May run in place (a == out), hence no __restrict__.
__global__ void scale_kernel(const double* a, int64_t n, double scale, double* out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = a[i] * scale;
}

// Sets *flag when a and b differ anywhere (one atomic per warp at most).
__global__ void mismatch_kernel(const int* __restrict__ a, const int* __restrict__ b, int64_t n, int* flag) {
  bool diff = false;
  for (int64_t i = thread_index(); i < n; i += thread_stride()) diff = diff || a[i] != b[i];
  if (__any_sync(0xffffffffu, diff) && (threadIdx.x & 31) == 0) atomicExch(flag, 1);
}

// ------------------------------------------------------------------------------------------------
// Kernels: centroid update
// ------------------------------------------------------------------------------------------------

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
class Reducer {
 public:
  Reducer(Ctx& ctx, int64_t n)
      : ctx_(ctx),
        part_(ctx.alloc<double>(static_cast<size_t>(std::max(tiles_for(n), (n + chunk_rows(n) - 1) / chunk_rows(n))))),
        out_(ctx.alloc<double>(1)) {}

  // Bit-identical to the CPU's chunked_sum of the same terms.
  template <typename F>
  double sum(F f, int64_t n) {
    const int64_t cs = chunk_rows(n), nc = (n + cs - 1) / cs;
    chunk_sums_kernel<F><<<blocks_for(nc, 32), 32, 0, ctx_.stream>>>(f, n, cs, nc, part_.data());
    CK_LAUNCH("chunk_sums_kernel");
    sequential_sum_kernel<<<1, 32, 0, ctx_.stream>>>(part_.data(), nc, out_.data());
    CK_LAUNCH("sequential_sum_kernel");
    return ctx_.read(out_.data());
  }

  // Tile prefix P (ntiles + 1 entries) of the terms; returns the total P[ntiles].
  template <typename F>
  double prefix(F f, int64_t n, double* P) {
    const int64_t nt = tiles_for(n);
    tile_sums_kernel<F><<<blocks_for(nt, 1), kThreads, 0, ctx_.stream>>>(f, n, nt, part_.data());
    CK_LAUNCH("tile_sums_kernel");
    tile_prefix_kernel<<<1, 32, 0, ctx_.stream>>>(part_.data(), nt, P);
    CK_LAUNCH("tile_prefix_kernel");
    return ctx_.read(P + nt);
  }

 private:
  Ctx& ctx_;
  DevArray<double> part_, out_;
};

// ------------------------------------------------------------------------------------------------
// Lloyd iterations
// ------------------------------------------------------------------------------------------------


// Centred (or unit-row) copy of x in T, its row norms, and the mean that was removed (host).
template <typename T>
struct Prepared {
  DevArray<T> x;
  DevArray<double> xnorm;
  std::vector<double> mean;
};

template <typename T>
Prepared<T> prepare(Ctx& ctx, const T* x, int64_t n, int64_t d, bool spherical) {
  Prepared<T> p;
  p.mean.assign(d, 0.0);
  p.x = ctx.alloc<T>(static_cast<size_t>(n) * d);
  p.xnorm = ctx.alloc<double>(n);
  DevArray<double> mean_dev;
  if (!spherical) {
    const int64_t cs = chunk_rows(n);
    const int64_t nc = (n + cs - 1) / cs;
    DevArray<double> part = ctx.alloc<double>(static_cast<size_t>(nc * d));
    mean_dev = ctx.alloc<double>(d);
    column_chunk_sums_kernel<T><<<blocks_for(nc * d), kThreads, 0, ctx.stream>>>(x, n, d, cs, nc, part.data());
    CK_LAUNCH("column_chunk_sums_kernel");
    mean_kernel<<<blocks_for(d), kThreads, 0, ctx.stream>>>(part.data(), nc, d, n, mean_dev.data());
    CK_LAUNCH("mean_kernel");
    ctx.to_host(p.mean.data(), mean_dev.data(), static_cast<size_t>(d));
  }
  DevArray<int> zero_row = ctx.alloc<int>(1);
  CK_CUDA(cudaMemsetAsync(zero_row.data(), 0, sizeof(int), ctx.stream));
  prepare_rows_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(
      x, spherical ? nullptr : mean_dev.data(), n, d, spherical, p.x.data(), p.xnorm.data(), zero_row.data());
  CK_LAUNCH("prepare_rows_kernel");
  if (ctx.read(zero_row.data()) != 0)
    throw std::invalid_argument("capacity_kmeans: metric='cosine' needs non-zero rows");
  return p;
}

void normalise_rows(std::vector<double>& c, int64_t k, int64_t d) {
  for (int64_t j = 0; j < k; ++j) {
    double s = 0.0;
    for (int64_t t = 0; t < d; ++t) s += c[j * d + t] * c[j * d + t];
    const double inv = 1.0 / std::max(std::sqrt(s), 1e-30);
    for (int64_t t = 0; t < d; ++t) c[j * d + t] *= inv;
  }
}

template <typename T>
double row_sqnorm(const T* v, int64_t d) {
  double s = 0.0;
  for (int64_t t = 0; t < d; ++t) s += static_cast<double>(v[t]) * static_cast<double>(v[t]);
  return s;
}

// Centroids in T and their squared norms, on the host as the CPU's to_T, then on the device.
template <typename T>
void upload_centroids(Ctx& ctx, const std::vector<double>& c, int64_t k, int64_t d, DevArray<T>& ct_dev,
                      DevArray<double>& cn_dev) {
  std::vector<T> ct(static_cast<size_t>(k) * d);
  std::vector<double> cn(k);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < d; ++t) ct[j * d + t] = static_cast<T>(c[j * d + t]);
    cn[j] = row_sqnorm(ct.data() + j * d, d);
  }
  ctx.to_device(ct_dev.data(), ct.data(), ct.size());
  ctx.to_device(cn_dev.data(), cn.data(), cn.size());
  ctx.sync();  // ct and cn are about to go out of scope
}

template <typename T>
std::vector<double> device_row(Ctx& ctx, const Prepared<T>& p, int64_t d, int64_t row) {
  std::vector<T> v(d);
  ctx.to_host(v.data(), p.x.data() + row * d, static_cast<size_t>(d));
  ctx.sync();
  return std::vector<double>(v.begin(), v.end());
}

// Greedy k-means++ (the CPU's kmeans_plusplus): the buffers of one seeding and its two steps per centre.
template <typename T>
class PlusPlus {
 public:
  PlusPlus(Ctx& ctx, const Prepared<T>& p, int64_t n, int64_t d, int trials, Reducer& red)
      : ctx_(ctx), p_(p), n_(n), d_(d), trials_(trials), red_(red), b0_(ctx.alloc<double>(n)),
        b1_(ctx.alloc<double>(n)), cand_d_(ctx.alloc<double>(static_cast<size_t>(n) * trials)),
        cand_rows_(ctx.alloc<T>(static_cast<size_t>(trials) * d)), cand_norm_(ctx.alloc<double>(trials)),
        P_(ctx.alloc<double>(static_cast<size_t>(tiles_for(n) + 1))), rs_dev_(ctx.alloc<double>(trials)),
        cands_dev_(ctx.alloc<int64_t>(trials)), rs_(trials), cands_(trials) {}

  // Distances to the first centre, row `first`.
  void start(int64_t first) {
    launch_sqdist<T>(ctx_, p_.x.data(), p_.xnorm.data(), n_, d_, p_.x.data() + first * d_, p_.xnorm.data() + first, 1,
                     closest_);
  }

  // Draws the candidates of the next centre, measures them in one pass over the data (as the CPU) and keeps the
  // one of lowest potential; returns its row.
  int64_t next(SplitMix64& rng) {
    draw(rng);
    gather_rows_kernel<T><<<blocks_for(trials_ * d_), kThreads, 0, ctx_.stream>>>(
        p_.x.data(), p_.xnorm.data(), d_, cands_dev_.data(), trials_, cand_rows_.data(), cand_norm_.data());
    CK_LAUNCH("gather_rows_kernel");
    launch_sqdist<T>(ctx_, p_.x.data(), p_.xnorm.data(), n_, d_, cand_rows_.data(), cand_norm_.data(), trials_,
                     cand_d_.data());
    double best_pot = kInf;
    int best_t = -1;
    for (int t = 0; t < trials_; ++t) {
      const double pot = red_.sum(MinColumnTerm{closest_, cand_d_.data(), trials_, t}, n_);
      if (pot < best_pot) {
        best_pot = pot;
        best_t = t;
      }
    }
    if (best_t < 0) throw std::runtime_error("capacity_kmeans: k-means++ found no candidate (internal error)");
    min_column_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(closest_, cand_d_.data(), n_, trials_, best_t,
                                                                    best_d_);
    CK_LAUNCH("min_column_kernel");
    std::swap(closest_, best_d_);
    return cands_[best_t];
  }

 private:
  Ctx& ctx_;
  const Prepared<T>& p_;
  const int64_t n_, d_;
  const int trials_;
  Reducer& red_;
  DevArray<double> b0_, b1_, cand_d_;
  DevArray<T> cand_rows_;
  DevArray<double> cand_norm_, P_, rs_dev_;
  DevArray<int64_t> cands_dev_;
  std::vector<double> rs_;
  std::vector<int64_t> cands_;
  double* closest_ = b0_.data();
  double* best_d_ = b1_.data();

  // The candidates: upper_bound of splitmix64 draws on the running sum of the closest distances.
  void draw(SplitMix64& rng) {
    const double total = red_.prefix(ArrayTerm{closest_}, n_, P_.data());
    for (int t = 0; t < trials_; ++t) rs_[t] = rng.uniform() * total;
    ctx_.to_device(rs_dev_.data(), rs_.data(), rs_.size());
    kpp_search_kernel<<<1, 32, 0, ctx_.stream>>>(closest_, n_, P_.data(), tiles_for(n_), rs_dev_.data(), trials_,
                                                 cands_dev_.data());
    CK_LAUNCH("kpp_search_kernel");
    ctx_.to_host(cands_.data(), cands_dev_.data(), cands_.size());
    ctx_.sync();
  }
};

template <typename T>
std::vector<double> kmeans_plusplus(Ctx& ctx, const Prepared<T>& p, int64_t n, int64_t d, int64_t k, SplitMix64& rng,
                                    Reducer& red) {
  const int trials = 2 + static_cast<int>(std::log(static_cast<double>(k)));
  std::vector<double> centers(static_cast<size_t>(k) * d);
  auto put = [&](int64_t j, int64_t row) {
    const std::vector<double> v = device_row(ctx, p, d, row);
    std::copy(v.begin(), v.end(), centers.begin() + j * d);
  };
  const int64_t first = std::min<int64_t>(static_cast<int64_t>(rng.uniform() * static_cast<double>(n)), n - 1);
  put(0, first);
  PlusPlus<T> pp(ctx, p, n, d, trials, red);
  pp.start(first);
  for (int64_t j = 1; j < k; ++j) put(j, pp.next(rng));
  return centers;
}

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

void check_problem(const char* op, int64_t n, int64_t d, int64_t k, const int64_t* lo, const int64_t* hi) {
  const std::string name(op);
  if (n < 1 || d < 1 || k < 1 || k > n)
    throw std::invalid_argument(name + ": need n >= 1, d >= 1 and 1 <= k <= n, got n=" + std::to_string(n) +
                                ", d=" + std::to_string(d) + ", k=" + std::to_string(k));
  if (n > INT_MAX || 2 * k > INT_MAX)
    throw std::invalid_argument(name + ": the CUDA path takes at most 2^31 - 1 points, got n=" + std::to_string(n));
  int64_t sum_lo = 0, sum_hi = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (lo[j] < 0 || lo[j] > hi[j])
      throw std::invalid_argument(name + ": need 0 <= min_size <= max_size for cluster " + std::to_string(j));
    sum_lo += lo[j];
    sum_hi += std::min(hi[j], n);
  }
  if (sum_hi < n || sum_lo > n)
    throw std::invalid_argument(name + ": infeasible capacities (need sum(min_size) <= n <= sum(max_size))");
}


// Device buffers of the Lloyd loop of one call.
template <typename T>
struct LloydBuffers {
  DevArray<double> dist, exact;
  DevArray<T> ct;
  DevArray<double> cn, cent_dev;
  DevArray<int> labels, new_labels, mismatch;

  LloydBuffers(Ctx& ctx, int64_t n, int64_t d, int64_t k)
      : dist(ctx.alloc<double>(static_cast<size_t>(n) * k)),
        exact(ctx.alloc<double>(n)),
        ct(ctx.alloc<T>(static_cast<size_t>(k) * d)),
        cn(ctx.alloc<double>(k)),
        cent_dev(ctx.alloc<double>(static_cast<size_t>(k) * d)),
        labels(ctx.alloc<int>(n)),
        new_labels(ctx.alloc<int>(n)),
        mismatch(ctx.alloc<int>(1)) {}
};

// One restart of the Lloyd loop (the CPU's, step for step); its labels are left in LloydBuffers::labels.
struct RunResult {
  std::vector<double> history, cent;
  int n_iter = 0;
  bool converged = false;
  int64_t rounds = 0;
};

// What one call needs besides its buffers: the prepared data, the problem and the shared helpers.
template <typename T>
struct Lloyd {
  Ctx& ctx;
  const Prepared<T>& prep;
  int64_t n, d;
  const int64_t *lo, *hi;
  const KMeansParams& p;
  LloydBuffers<T>& buf;
  AuctionGpu& auction;
  Reducer& red;
  UpdateBuffers& ub;

  // Whether new_labels equal labels everywhere.
  bool same_labels() {
    CK_CUDA(cudaMemsetAsync(buf.mismatch.data(), 0, sizeof(int), ctx.stream));
    mismatch_kernel<<<blocks_for(n, kThreads, 4096), kThreads, 0, ctx.stream>>>(buf.new_labels.data(),
                                                                               buf.labels.data(), n,
                                                                               buf.mismatch.data());
    CK_LAUNCH("mismatch_kernel");
    return ctx.read(buf.mismatch.data()) == 0;
  }

  // The assignment step: new labels unless the previous ones cost less (the objective never increases).
  double assign(AuctionState& prices, bool has_labels, int64_t* rounds) {
    const int64_t k = p.k;
    *rounds += auction.assign(buf.dist.data(), lo, hi, prices, buf.new_labels.data(), AuctionParams());
    double cost = red.sum(OwnCostTerm{buf.dist.data(), buf.new_labels.data(), k}, n);
    if (has_labels) {
      const double prev = red.sum(OwnCostTerm{buf.dist.data(), buf.labels.data(), k}, n);
      if (cost > prev) {
        ctx.copy(buf.new_labels.data(), buf.labels.data(), static_cast<size_t>(n));
        cost = prev;
      }
    }
    return cost;
  }

  RunResult run(std::vector<double> cent) {
    const int64_t k = p.k;
    RunResult r;
    AuctionState prices;
    bool has_labels = false;
    for (r.n_iter = 1; r.n_iter <= p.max_iter; ++r.n_iter) {
      upload_centroids(ctx, cent, k, d, buf.ct, buf.cn);
      launch_sqdist<T>(ctx, prep.x.data(), prep.xnorm.data(), n, d, buf.ct.data(), buf.cn.data(), k,
                       buf.dist.data());
      const double cost = assign(prices, has_labels, &r.rounds);
      const bool same = has_labels && same_labels();
      const double improved = r.history.empty() ? kInf : r.history.back() - cost;
      const double ref = r.history.empty() ? cost : r.history.back();
      buf.labels.swap(buf.new_labels);
      has_labels = true;
      r.history.push_back(cost);
      update_centroids(ctx, ub, prep, n, d, k, buf.labels.data(), buf.dist.data(), p.spherical, cent);
      if (same || improved <= p.tol * std::fabs(ref)) {
        r.converged = true;
        break;
      }
    }
    if (r.n_iter > p.max_iter) r.n_iter = p.max_iter;
    r.cent = std::move(cent);
    return r;
  }

  // The objective of the final centroids: exact |x - c|^2 per point into buf.exact, summed as the CPU does.
  double final_cost(const std::vector<double>& cent) {
    ctx.to_device(buf.cent_dev.data(), cent.data(), cent.size());
    exact_own_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(prep.x.data(), n, d, buf.cent_dev.data(),
                                                                    buf.labels.data(), buf.exact.data());
    CK_LAUNCH("exact_own_kernel");
    return red.sum(ArrayTerm{buf.exact.data()}, n);
  }
};

// Initial centroids of restart `run`: explicit ones (host copy, centred) or k-means++.
template <typename T>
std::vector<double> start_centroids(Ctx& ctx, const Prepared<T>& prep, int64_t n, int64_t d, const KMeansParams& p,
                                    const std::vector<T>& init_host, int run, Reducer& red) {
  const int64_t k = p.k;
  std::vector<double> cent;
  if (!init_host.empty()) {
    cent.resize(static_cast<size_t>(k) * d);
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(init_host[j * d + t]) - prep.mean[t];
  } else {
    SplitMix64 rng(run_seed(p.seed, static_cast<uint64_t>(run)));
    cent = kmeans_plusplus(ctx, prep, n, d, k, rng, red);
  }
  if (p.spherical) normalise_rows(cent, k, d);
  return cent;
}

// The best restart in the caller's frame: inertia and history scaled (cosine: halved), centroids uncentred.
void finish(Ctx& ctx, CudaKMeansResult& best, double best_final, const std::vector<double>& best_cent,
            const std::vector<double>& mean, int64_t n, int64_t d, int64_t k, bool spherical, double* cent_out,
            double* dist_out) {
  if (best_cent.empty()) throw std::runtime_error("capacity_kmeans: no finite objective (internal error)");
  const double scale = spherical ? 0.5 : 1.0;  // |a - b|^2 = 2 (1 - cos) for unit vectors
  best.inertia = best_final * scale;
  for (double& v : best.history) v *= scale;
  if (spherical) {
    scale_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(dist_out, n, scale, dist_out);
    CK_LAUNCH("scale_kernel");
  }
  std::vector<double> out(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) out[j * d + t] = best_cent[j * d + t] + mean[t];
  ctx.to_device(cent_out, out.data(), out.size());
  ctx.sync();
}

template <typename T>
CudaKMeansResult kmeans_impl(Ctx& ctx, const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
                             const T* init, const KMeansParams& p, int64_t* labels_out, double* cent_out,
                             double* dist_out) {
  const int64_t k = p.k;
  Prepared<T> prep = prepare(ctx, x, n, d, p.spherical);
  LloydBuffers<T> buf(ctx, n, d, k);
  AuctionGpu auction(ctx, n, k);
  Reducer red(ctx, n);
  UpdateBuffers ub(ctx, n, d, k);
  std::vector<T> init_host;
  if (init != nullptr) {
    init_host.resize(static_cast<size_t>(k) * d);
    ctx.to_host(init_host.data(), init, init_host.size());
    ctx.sync();
  }
  Lloyd<T> lloyd{ctx, prep, n, d, lo, hi, p, buf, auction, red, ub};
  CudaKMeansResult best;
  double best_final = kInf;
  std::vector<double> best_cent;
  const int runs = init != nullptr ? 1 : p.n_init;
  for (int run = 0; run < runs; ++run) {
    RunResult r = lloyd.run(start_centroids(ctx, prep, n, d, p, init_host, run, red));
    const double final_cost = lloyd.final_cost(r.cent);
    if (final_cost < best_final) {
      best_final = final_cost;
      widen(ctx, buf.labels.data(), n, labels_out);
      ctx.copy(dist_out, buf.exact.data(), static_cast<size_t>(n));
      best.history = r.history;
      best.n_iter = r.n_iter;
      best.converged = r.converged;
      best.auction_rounds = r.rounds;
      best_cent = r.cent;
    }
  }
  finish(ctx, best, best_final, best_cent, prep.mean, n, d, k, p.spherical, cent_out, dist_out);
  return best;
}

template <typename T>
void assign_impl(Ctx& ctx, const T* x, int64_t n, int64_t d, const T* centroids, int64_t k, const int64_t* lo,
                 const int64_t* hi, bool spherical, int64_t* labels_out, double* dist_out) {
  Prepared<T> prep = prepare(ctx, x, n, d, spherical);
  std::vector<T> c_host(static_cast<size_t>(k) * d);
  ctx.to_host(c_host.data(), centroids, c_host.size());
  ctx.sync();
  std::vector<double> cent(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(c_host[j * d + t]) - prep.mean[t];
  if (spherical) normalise_rows(cent, k, d);
  DevArray<T> ct = ctx.alloc<T>(static_cast<size_t>(k) * d);
  DevArray<double> cn = ctx.alloc<double>(k);
  upload_centroids(ctx, cent, k, d, ct, cn);
  DevArray<double> dist = ctx.alloc<double>(static_cast<size_t>(n) * k);
  launch_sqdist<T>(ctx, prep.x.data(), prep.xnorm.data(), n, d, ct.data(), cn.data(), k, dist.data());
  DevArray<int> labels = ctx.alloc<int>(n);
  {
    AuctionGpu auction(ctx, n, k);
    AuctionState prices;
    auction.assign(dist.data(), lo, hi, prices, labels.data(), AuctionParams());
  }
  widen(ctx, labels.data(), n, labels_out);
  DevArray<double> cent_dev = ctx.alloc<double>(cent.size());
  ctx.to_device(cent_dev.data(), cent.data(), cent.size());
  DevArray<double> own = ctx.alloc<double>(n);
  exact_own_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(prep.x.data(), n, d, cent_dev.data(), labels.data(),
                                                                  own.data());
  CK_LAUNCH("exact_own_kernel");
  scale_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(own.data(), n, spherical ? 0.5 : 1.0, dist_out);
  CK_LAUNCH("scale_kernel");
  ctx.sync();
}

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return count;
}

CudaKMeansResult capacity_kmeans_cuda(uintptr_t x, bool is_double, int64_t n, int64_t d, const int64_t* lo,
                                      const int64_t* hi, uintptr_t init, const KMeansParams& p, uintptr_t labels,
                                      uintptr_t centroids, uintptr_t distances, uintptr_t stream, int device) {
  check_problem("capacity_kmeans", n, d, p.k, lo, hi);
  if (p.max_iter < 1) throw std::invalid_argument("capacity_kmeans: max_iter must be >= 1");
  if (init == 0 && p.n_init < 1) throw std::invalid_argument("capacity_kmeans: n_init must be >= 1");
  if (x == 0 || labels == 0 || centroids == 0 || distances == 0)
    throw std::invalid_argument("capacity_kmeans: null device pointer");
  DeviceScope scope(device);
  Ctx ctx(stream, device);
  int64_t* lab = reinterpret_cast<int64_t*>(labels);
  double* cen = reinterpret_cast<double*>(centroids);
  double* dst = reinterpret_cast<double*>(distances);
  if (is_double) {
    return kmeans_impl<double>(ctx, reinterpret_cast<const double*>(x), n, d, lo, hi,
                               reinterpret_cast<const double*>(init), p, lab, cen, dst);
  }
  return kmeans_impl<float>(ctx, reinterpret_cast<const float*>(x), n, d, lo, hi, reinterpret_cast<const float*>(init),
                            p, lab, cen, dst);
}

void assign_with_capacity_cuda(uintptr_t x, bool is_double, int64_t n, int64_t d, uintptr_t centroids, int64_t k,
                               const int64_t* lo, const int64_t* hi, bool spherical, uintptr_t labels,
                               uintptr_t distances, uintptr_t stream, int device) {
  check_problem("assign_with_capacity", n, d, k, lo, hi);
  if (x == 0 || centroids == 0 || labels == 0 || distances == 0)
    throw std::invalid_argument("assign_with_capacity: null device pointer");
  DeviceScope scope(device);
  Ctx ctx(stream, device);
  int64_t* lab = reinterpret_cast<int64_t*>(labels);
  double* dst = reinterpret_cast<double*>(distances);
  if (is_double) {
    assign_impl<double>(ctx, reinterpret_cast<const double*>(x), n, d, reinterpret_cast<const double*>(centroids), k,
                        lo, hi, spherical, lab, dst);
  } else {
    assign_impl<float>(ctx, reinterpret_cast<const float*>(x), n, d, reinterpret_cast<const float*>(centroids), k, lo,
                       hi, spherical, lab, dst);
  }
}

int64_t auction_assign_cuda(uintptr_t dist, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                            uintptr_t labels, uintptr_t stream, int device) {
  check_problem("auction_assign", n, 1, k, lo, hi);
  if (dist == 0 || labels == 0) throw std::invalid_argument("auction_assign: null device pointer");
  DeviceScope scope(device);
  Ctx ctx(stream, device);
  DevArray<int> lab = ctx.alloc<int>(n);
  int64_t rounds = 0;
  {
    AuctionGpu auction(ctx, n, k);
    AuctionState state;
    rounds = auction.assign(reinterpret_cast<const double*>(dist), lo, hi, state, lab.data(), AuctionParams());
  }
  widen(ctx, lab.data(), n, reinterpret_cast<int64_t*>(labels));
  ctx.sync();
  return rounds;
}

}  // namespace cuda
}  // namespace cluster_kernels
