// Capacity-constrained K-means on CUDA: csrc/cpu/kmeans.cpp and auction.cpp moved onto the GPU step for step.
//
// Same prepared data, same eviction auction (the floor form first, the general form with dummy units
// only when the lower bounds are not met), same eps schedule, same splitmix64 k-means++ draws, same
// empty-cluster re-seeding, convergence test and "keep the previous labels unless the new assignment
// is cheaper" guard. Read kmeans.cpp and auction.cpp first: the host code below follows them.
//
// Parallel decomposition
// * Per-point work runs on the device with grid-stride loops and int64 offsets: centring, distances
//   (a tile of points x centroids per block, staged through shared memory), argmins, regrets, gaps,
//   re-bids, sums. Nothing per point goes to the host.
// * Per-object state (counts, prices, dummy units, regret lower bounds, the over-full list) stays on
//   the host exactly as in the CPU code, and is copied to the device when a kernel needs it; K is small.
// * The members of the over-full objects that leave (the `excess` smallest (regret, index)): the
//   members are compacted in index order (cub::DeviceSelect), stably radix-sorted by regret, then
//   stably by object, so each object's members form one segment ordered by (regret, index). One
//   thread per object then reads the CPU's eviction decision off its segment (closed form of the
//   merge with dummy units, which go first on equal regret).
// * Cluster sums sort point indices by label (stable), so every (row chunk, cluster) pair owns a
//   contiguous, index-ordered run; one thread per (chunk, cluster, column) sums its run in order.
//
// Determinism: no floating-point atomics and no order that depends on scheduling. Integer atomics
// (histograms) are exact; min/max atomics give an order-independent result; CUB's radix sort and
// select are deterministic and stable. Two runs give bit-identical results.
//
// Agreement with the CPU: arithmetic that decides labels is written in the CPU's order with
// explicitly rounded intrinsics (__dadd_rn, __fma_rn, ...), so nvcc neither fuses nor splits it:
// * the centring mean and the cluster sums use the CPU's chunking (chunk_rows) and summation order;
// * distances to k > 1 centroids are an FMA chain over the features in order, as the CPU's register
//   tile compiles in its x86-64-v3 clone (every AVX2 machine): bit-identical there. For k == 1
//   (k-means++'s first row) the CPU's dot_lanes is mirrored (lane l of a warp is its accumulator
//   acc[l], the shuffle-down tree its pairwise tree, lane 0 adds the tail), but GCC compiles its
//   tail partly fused and partly not, so those distances agree to a float ulp only;
// * the auction repeats every comparison and price update of the CPU code, so on the same cost
//   matrix it returns the labels of auction_assign;
// * the objective, the k-means++ potentials and the inertia are the CPU's chunked sums (serial per
//   chunk, at most 256 chunks).
// The k-means++ draw walks a tile prefix of the weights (a fixed tree per tile) instead of the CPU's
// running sum over all points, so a draw can differ only when it falls within rounding of a boundary.
#include "cuda/kmeans.cuh"

#include "cpu/auction_objects.h"

#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

namespace cluster_kernels {
namespace cuda {
namespace {

using auction::cheapest_dummy_object;
using auction::EpsSchedule;
using auction::Objects;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kThreads = 256;  // every kernel's block size (the tree reductions assume it)
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kSumItems = 8;  // points per thread in a summation tile
constexpr int64_t kSumTile = int64_t{kThreads} * kSumItems;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr int kSharedHistMax = 8192;             // objects counted in shared memory (32 KiB)

[[noreturn]] void cuda_fail(cudaError_t err, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error: ") + call + " failed: " + cudaGetErrorString(err) + " (" +
                           file + ":" + std::to_string(line) + ")");
}

#define CK_CUDA(call)                                                             \
  do {                                                                            \
    const cudaError_t ck_err_ = (call);                                           \
    if (ck_err_ != cudaSuccess) cuda_fail(ck_err_, #call, __FILE__, __LINE__);    \
  } while (0)

#define CK_LAUNCH(name)                                                                   \
  do {                                                                                    \
    const cudaError_t ck_err_ = cudaGetLastError();                                       \
    if (ck_err_ != cudaSuccess) cuda_fail(ck_err_, "launch of " name, __FILE__, __LINE__); \
  } while (0)

unsigned blocks_for(int64_t items, int64_t per_block = kThreads, int64_t cap = kMaxBlocks) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(b, cap)));
}

int64_t tiles_for(int64_t n) { return (n + kSumTile - 1) / kSumTile; }

// Rows per reduction chunk of the CPU code (csrc/cpu/kmeans.cpp: chunk_rows).
int64_t chunk_rows(int64_t n) { return std::max<int64_t>(2048, (n + 255) / 256); }

int radix_bits(int64_t values) {
  int bits = 1;
  while ((int64_t{1} << bits) < values) ++bits;
  return bits;
}

// ------------------------------------------------------------------------------------------------
// Device memory, stream and device scope
// ------------------------------------------------------------------------------------------------

class DevMem {
 public:
  DevMem() = default;
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept { swap(o); }
  DevMem& operator=(DevMem&& o) noexcept {
    swap(o);
    return *this;
  }
  ~DevMem() { release(); }

  void allocate(size_t bytes, cudaStream_t stream, bool pools) {
    release();
    stream_ = stream;
    pools_ = pools;
    if (bytes == 0) return;
    if (pools) {
      CK_CUDA(cudaMallocAsync(&ptr_, bytes, stream));
    } else {
      CK_CUDA(cudaMalloc(&ptr_, bytes));
    }
    bytes_ = bytes;
  }
  void release() noexcept {
    if (ptr_ != nullptr) {
      // Stream-ordered: kernels queued before still see the memory. Errors cannot be reported here.
      if (pools_) {
        (void)cudaFreeAsync(ptr_, stream_);
      } else {
        (void)cudaFree(ptr_);
      }
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void swap(DevMem& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(stream_, o.stream_);
    std::swap(pools_, o.pools_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  bool pools_ = false;
};

template <typename T>
class DevArray {
 public:
  DevArray() = default;
  T* data() const { return static_cast<T*>(mem_.get()); }
  size_t size() const { return size_; }
  void swap(DevArray& o) noexcept {
    mem_.swap(o.mem_);
    std::swap(size_, o.size_);
  }

 private:
  friend struct Ctx;
  DevMem mem_;
  size_t size_ = 0;
};

// Restores the caller's current device on exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    CK_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) {
      CK_CUDA(cudaSetDevice(device));
      changed_ = true;
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (changed_) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// The caller's stream and the helpers every step uses. All work and all allocations are ordered on
// that stream, so the caller (torch's current stream) sees the outputs in order.
struct Ctx {
  cudaStream_t stream;
  bool pools = false;
  DevMem cub_tmp;

  Ctx(uintptr_t s, int device) : stream(reinterpret_cast<cudaStream_t>(s)) {
    int supported = 0;
    CK_CUDA(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    pools = supported != 0;
  }

  template <typename T>
  DevArray<T> alloc(size_t n) {
    DevArray<T> a;
    a.mem_.allocate(std::max<size_t>(n, 1) * sizeof(T), stream, pools);
    a.size_ = n;
    return a;
  }
  // CUB treats a null temporary pointer as a size query, so the buffer is never empty.
  void* cub_storage(size_t bytes) {
    bytes = std::max<size_t>(bytes, 256);
    if (bytes > cub_tmp.bytes()) cub_tmp.allocate(bytes, stream, pools);
    return cub_tmp.get();
  }
  void sync() { CK_CUDA(cudaStreamSynchronize(stream)); }
  template <typename T>
  void to_device(T* dst, const T* src, size_t n) {
    if (n) CK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  template <typename T>
  void to_host(T* dst, const T* src, size_t n) {
    if (n) CK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  }
  template <typename T>
  void copy(T* dst, const T* src, size_t n) {
    if (n) CK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }
  template <typename T>
  T read(const T* src) {
    T v;
    to_host(&v, src, 1);
    sync();
    return v;
  }
};

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t thread_index() { return int64_t{blockIdx.x} * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t thread_stride() { return int64_t{gridDim.x} * blockDim.x; }
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// -0.0 -> +0.0: every zero gets one bit pattern, so a zero's sign can never depend on the order in
// which a min over arrivals was taken.
__device__ __forceinline__ double canon(double v) { return v == 0.0 ? 0.0 : v; }

// Cheapest object for the point whose cost row is Di, other than `exclude`; the lowest index wins
// ties (the CPU's best_cluster / best_of). Object o's cost is Di[cl[o]] + prices[o].
__device__ __forceinline__ int best_object(const double* Di, const int* cl, const double* prices, int m, int exclude,
                                           double* best_cost) {
  int b = -1;
  double bc = CUDART_INF;
  for (int o = 0; o < m; ++o) {
    if (o == exclude) continue;
    const double c = __dadd_rn(Di[cl[o]], prices[o]);
    if (c < bc) {
      bc = c;
      b = o;
    }
  }
  *best_cost = bc;
  return b;
}

// Values only ever decrease, so a stale first read costs at most one extra compare-and-swap.
__device__ __forceinline__ void atomic_min_double(double* addr, double val) {
  unsigned long long* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a;
  while (val < __longlong_as_double(static_cast<long long>(old))) {
    const unsigned long long assumed = old;
    old = atomicCAS(a, assumed, static_cast<unsigned long long>(__double_as_longlong(val)));
    if (old == assumed) break;
  }
}

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

constexpr int kTileGroup = 8;  // centroids per thread in sqdist_tile_kernel (register accumulators)

template <typename T>
constexpr int tile_chunk() {  // columns staged per step: 35 KiB of shared memory for either type
  return sizeof(T) == 4 ? 32 : 16;
}

// k > 1. A block takes kThreads points (one per thread) and kTileGroup centroids at a time; the
// points' rows and the centroids are staged through shared memory tile_chunk<T>() columns at a
// time (coalesced loads, padded rows: no bank conflicts, centroid reads are broadcasts), and each
// thread accumulates its kTileGroup dot products over t in order with one FMA per term.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sqdist_tile_kernel(const T* __restrict__ x, const double* __restrict__ xnorm, int64_t n, int64_t d,
                       const T* __restrict__ c, const double* __restrict__ cnorm, int64_t k, double* __restrict__ out) {
  constexpr int C = tile_chunk<T>();
  __shared__ T xs[kThreads][C + 1];
  __shared__ T cs[kTileGroup][C];
  const int p = threadIdx.x;
  const int64_t ntiles = (n + kThreads - 1) / kThreads;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {  // block-uniform loops throughout
    const int64_t i0 = tile * kThreads;
    const int64_t i = i0 + p;
    for (int64_t j0 = 0; j0 < k; j0 += kTileGroup) {
      T acc[kTileGroup];
#pragma unroll
      for (int w = 0; w < kTileGroup; ++w) acc[w] = T(0);
      for (int64_t t0 = 0; t0 < d; t0 += C) {
        const int width = static_cast<int>(imin(C, d - t0));
        for (int e = threadIdx.x; e < kThreads * C; e += kThreads) {
          const int r = e / C, col = e - r * C;
          const int64_t row = i0 + r;
          xs[r][col] = (row < n && col < width) ? x[row * d + t0 + col] : T(0);
        }
        for (int e = threadIdx.x; e < kTileGroup * C; e += kThreads) {
          const int w = e / C, col = e - w * C;
          const int64_t j = j0 + w;
          cs[w][col] = (j < k && col < width) ? c[j * d + t0 + col] : T(0);
        }
        __syncthreads();
        for (int col = 0; col < width; ++col) {
          const T xv = xs[p][col];
#pragma unroll
          for (int w = 0; w < kTileGroup; ++w) acc[w] = fma_rn(xv, cs[w][col], acc[w]);
        }
        __syncthreads();  // before the next chunk overwrites the tiles
      }
      if (i < n) {
#pragma unroll
        for (int w = 0; w < kTileGroup; ++w) {
          if (j0 + w < k) out[i * k + j0 + w] = sqdist_value(xnorm[i], cnorm[j0 + w], static_cast<double>(acc[w]));
        }
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

// ------------------------------------------------------------------------------------------------
// Kernels: the auction
// ------------------------------------------------------------------------------------------------

__global__ void iota_kernel(int* __restrict__ a, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) a[i] = static_cast<int>(i);
}

__global__ void argmin_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                              const double* __restrict__ prices, int m, int* __restrict__ obj) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    double bc;
    obj[i] = best_object(D + i * k, cl, prices, m, -1, &bc);
  }
}

// Counts of v[p] in [0, m) (negative entries are skipped). Integer atomics: exact in any order.
__global__ void hist_kernel(const int* __restrict__ v, int64_t len, int m, bool use_shared,
                            unsigned long long* __restrict__ out) {
  extern __shared__ unsigned int sh_hist[];
  if (use_shared) {  // kernel argument: uniform over the block
    for (int o = threadIdx.x; o < m; o += blockDim.x) sh_hist[o] = 0u;
    __syncthreads();
  }
  for (int64_t p = thread_index(); p < len; p += thread_stride()) {
    const int o = v[p];
    if (o < 0 || o >= m) continue;
    if (use_shared) {
      atomicAdd(&sh_hist[o], 1u);
    } else {
      atomicAdd(&out[o], 1ull);
    }
  }
  if (use_shared) {
    __syncthreads();
    for (int o = threadIdx.x; o < m; o += blockDim.x) {
      if (sh_hist[o] != 0u) atomicAdd(&out[o], static_cast<unsigned long long>(sh_hist[o]));
    }
  }
}

// Non-negative doubles order like their bit patterns, so an integer max is the double max. A row with a NaN,
// an Inf or a |cost| above auction::kMaxCost makes amax +inf: the host then refuses the cost matrix.
__global__ void __launch_bounds__(kThreads) span_kernel(const double* __restrict__ D, int64_t n, int64_t k,
                                                        unsigned long long* __restrict__ out) {
  __shared__ double sh_span[kThreads];
  __shared__ double sh_amax[kThreads];
  double span = 0.0, amax = 0.0;
  const double max_cost = auction::kMaxCost;
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    double lo_v = CUDART_INF, hi_v = -CUDART_INF;
    bool bad = false;
    for (int64_t j = 0; j < k; ++j) {
      const double v = D[i * k + j];
      bad = bad || !(fabs(v) <= max_cost);
      lo_v = v < lo_v ? v : lo_v;
      hi_v = hi_v < v ? v : hi_v;
    }
    if (bad) {
      amax = CUDART_INF;
      continue;
    }
    const double sp = __dsub_rn(hi_v, lo_v);
    span = span < sp ? sp : span;
    const double a = fmax(fabs(lo_v), fabs(hi_v));
    amax = amax < a ? a : amax;
  }
  sh_span[threadIdx.x] = span;
  sh_amax[threadIdx.x] = amax;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) {
      sh_span[threadIdx.x] = fmax(sh_span[threadIdx.x], sh_span[threadIdx.x + w]);
      sh_amax[threadIdx.x] = fmax(sh_amax[threadIdx.x], sh_amax[threadIdx.x + w]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicMax(&out[0], static_cast<unsigned long long>(__double_as_longlong(sh_span[0])));
    atomicMax(&out[1], static_cast<unsigned long long>(__double_as_longlong(sh_amax[0])));
  }
}

// Floor auction, phase start: extra cost of moving each point to cluster j (inf for j's members).
__global__ void gap_kernel(const double* __restrict__ D, int64_t n, int64_t k, const double* __restrict__ prices,
                           const int* __restrict__ obj, int j, double* __restrict__ key) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const int o = obj[i];
    double g = CUDART_INF;
    if (o != j) g = __dsub_rn(__dadd_rn(D[i * k + j], prices[j]), __dadd_rn(D[i * k + o], prices[o]));
    key[i] = canon(g);
  }
}

// skey: gaps in (gap, index) order. Writes the r-th smallest gap and how many points move: r, or
// when the price stops at 0 the prefix that prefers j by more than eps (gap - d0 is monotone in gap).
__global__ void pull_kernel(const double* __restrict__ skey, int64_t r, double price, double eps,
                            double* __restrict__ last_out, int64_t* __restrict__ pulled_out) {
  if (thread_index() != 0) return;
  const double last = skey[r - 1];
  int64_t pulled = r;
  if (__dadd_rn(last, eps) >= price) {
    int64_t lo = 0, hi = r;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (__dsub_rn(skey[mid], price) < -eps) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    pulled = lo;
  }
  *last_out = last;
  *pulled_out = pulled;
}

__global__ void move_kernel(const int* __restrict__ sidx, int64_t count, int j, int* __restrict__ obj,
                            int* __restrict__ old) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) {
    const int i = sidx[p];
    old[p] = obj[i];
    obj[i] = j;
  }
}

// Regret (second-best cost minus own cost) of the members of the objects with slot >= 0.
__global__ void regret_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                              const double* __restrict__ prices, int m, const int* __restrict__ obj,
                              const int* __restrict__ slot, double* __restrict__ reg,
                              unsigned char* __restrict__ flag) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const int o = obj[i];
    if (slot[o] < 0) {
      flag[i] = 0;
      continue;
    }
    const double* Di = D + i * k;
    double sc;
    best_object(Di, cl, prices, m, o, &sc);
    reg[i] = canon(__dsub_rn(sc, __dadd_rn(Di[cl[o]], prices[o])));
    flag[i] = 1;
  }
}

__global__ void gather_keys_kernel(const double* __restrict__ reg, const int* __restrict__ sel, int64_t count,
                                   double* __restrict__ out) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) out[p] = reg[sel[p]];
}

__global__ void gather_slots_kernel(const int* __restrict__ obj, const int* __restrict__ slot,
                                    const int* __restrict__ sidx, int64_t count, unsigned* __restrict__ out) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) out[p] = static_cast<unsigned>(slot[obj[sidx[p]]]);
}

// One over-full object: its members occupy sorted positions [off, off + size), ordered by
// (regret, index); `excess` units leave, real members or its `ndum` dummy units (regret rho).
struct SegmentIn {
  int64_t off, size, excess, ndum;
  double rho;
  int scanned;  // 0: the members were not scanned (only dummies leave; the host decides)
};

struct SegmentOut {
  int64_t nr, nd;    // real members and dummy units that leave
  double last;       // regret of the last unit that leaves
  double rest_min;   // smallest regret among the members that stay (inf if none)
  int error;
};

// Closed form of the CPU's merge loop: "take a dummy if one is left and (no real member is left or
// rho <= the next member's regret), else the next member". With L = #members of regret < rho (a
// prefix), the reals of regret < rho leave first, then dummies, then the remaining reals.
__global__ void decide_kernel(const SegmentIn* __restrict__ in, int nseg, const double* __restrict__ reg,
                              const int* __restrict__ sidx, SegmentOut* __restrict__ out) {
  for (int s = static_cast<int>(thread_index()); s < nseg; s += static_cast<int>(thread_stride())) {
    const SegmentIn g = in[s];
    SegmentOut r{0, 0, -CUDART_INF, CUDART_INF, 0};
    if (g.scanned) {
      auto R = [&](int64_t p) { return reg[sidx[g.off + p]]; };
      if (g.ndum == 0) {
        r.nr = g.excess;
        r.last = g.excess <= g.size ? R(g.excess - 1) : CUDART_INF;
      } else {
        int64_t lo = 0, hi = g.size;
        while (lo < hi) {
          const int64_t mid = lo + (hi - lo) / 2;
          if (R(mid) < g.rho) {
            lo = mid + 1;
          } else {
            hi = mid;
          }
        }
        const int64_t L = lo;
        if (g.excess <= L) {
          r.nr = g.excess;
          r.last = R(g.excess - 1);
        } else {
          r.nd = g.ndum < g.excess - L ? g.ndum : g.excess - L;
          const int64_t rest = g.excess - L - r.nd;
          r.nr = L + rest;
          r.last = rest > 0 && r.nr <= g.size ? R(r.nr - 1) : g.rho;
        }
      }
      if (r.nr > g.size) {
        r.error = 1;  // more units leave than exist: an internal error, reported by the host
      } else {
        r.rest_min = r.nr < g.size ? R(r.nr) : CUDART_INF;
      }
    }
    out[s] = r;
  }
}

// Evicted members (the first take[s] of each segment) re-bid at the new prices. moved[p] is the new
// object (or -1) for the histogram of arrivals; arrival_min (optional) gets each arrival's regret.
__global__ void rebid_kernel(const double* __restrict__ D, int64_t k, const int* __restrict__ cl,
                             const double* __restrict__ prices, int m, const int* __restrict__ sidx,
                             const unsigned* __restrict__ sslot, int64_t count, const int64_t* __restrict__ seg_off,
                             const int64_t* __restrict__ take, int* __restrict__ obj, int* __restrict__ moved,
                             double* __restrict__ arrival_min) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) {
    const unsigned s = sslot[p];
    if (p - seg_off[s] >= take[s]) {
      moved[p] = -1;
      continue;
    }
    const int i = sidx[p];
    const double* Di = D + int64_t{i} * k;
    double bc;
    const int b = best_object(Di, cl, prices, m, -1, &bc);
    obj[i] = b;
    moved[p] = b;
    if (arrival_min != nullptr) {
      double sc;
      best_object(Di, cl, prices, m, b, &sc);
      atomic_min_double(&arrival_min[b], canon(__dsub_rn(sc, bc)));
    }
  }
}

// Phase start after the first (both auctions): units that violate the new eps move to their
// cheapest object; the others already sit within eps of it and keep the previous phase's work.
__global__ void phase_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                             const double* __restrict__ prices, int m, double eps, int* __restrict__ obj) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const double* Di = D + i * k;
    double bc;
    const int b = best_object(Di, cl, prices, m, -1, &bc);
    const int o = obj[i];
    if (__dadd_rn(Di[cl[o]], prices[o]) > __dadd_rn(bc, eps)) obj[i] = b;
  }
}

__global__ void map_kernel(const int* __restrict__ obj, const int* __restrict__ cl, int64_t n, int* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = cl[obj[i]];
}

__global__ void widen_kernel(const int* __restrict__ a, int64_t n, int64_t* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = a[i];
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

// ------------------------------------------------------------------------------------------------
// Host helpers
// ------------------------------------------------------------------------------------------------

template <typename T>
void launch_sqdist(Ctx& ctx, const T* x, const double* xn, int64_t n, int64_t d, const T* c, const double* cn,
                   int64_t k, double* out) {
  if (k == 1) {
    constexpr int L = sizeof(T) == 4 ? 32 : 16;  // the CPU's lanes<T>()
    sqdist_row_kernel<T, L><<<blocks_for(n, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(x, xn, n, d, c, cn, out);
    CK_LAUNCH("sqdist_row_kernel");
  } else {
    sqdist_tile_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(x, xn, n, d, c, cn, k, out);
    CK_LAUNCH("sqdist_tile_kernel");
  }
}

// Histogram of v[0, len) over [0, m) into host int64 counts.
std::vector<int64_t> histogram(Ctx& ctx, DevArray<unsigned long long>& buf, const int* v, int64_t len, int m) {
  CK_CUDA(cudaMemsetAsync(buf.data(), 0, sizeof(unsigned long long) * static_cast<size_t>(m), ctx.stream));
  if (len > 0) {
    const bool use_shared = m <= kSharedHistMax;
    const size_t shmem = use_shared ? sizeof(unsigned) * static_cast<size_t>(m) : 0;
    hist_kernel<<<blocks_for(len, kThreads, 1024), kThreads, shmem, ctx.stream>>>(v, len, m, use_shared, buf.data());
    CK_LAUNCH("hist_kernel");
  }
  std::vector<unsigned long long> h(m);
  ctx.to_host(h.data(), buf.data(), static_cast<size_t>(m));
  ctx.sync();
  return std::vector<int64_t>(h.begin(), h.end());
}

// Deterministic sums over n points (n fixed per instance: the partitions depend on n only).
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

template <typename KeyT>
void sort_pairs(Ctx& ctx, const KeyT* kin, KeyT* kout, const int* vin, int* vout, int64_t count, int end_bit) {
  if (count <= 0) return;
  size_t bytes = 0;
  const int num = static_cast<int>(count);
  CK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, bytes, kin, kout, vin, vout, num, 0, end_bit, ctx.stream));
  void* tmp = ctx.cub_storage(bytes);
  CK_CUDA(cub::DeviceRadixSort::SortPairs(tmp, bytes, kin, kout, vin, vout, num, 0, end_bit, ctx.stream));
}

// ------------------------------------------------------------------------------------------------
// The eviction auction (mirrors FloorAuction, DummyAuction and auction_assign of auction.cpp)
// ------------------------------------------------------------------------------------------------



class AuctionGpu {
 public:
  AuctionGpu(Ctx& ctx, int64_t n, int64_t k)
      : ctx_(ctx),
        n_(n),
        k_(k),
        mcap_(static_cast<size_t>(2 * k)),
        obj_(ctx.alloc<int>(n)),
        iota_(ctx.alloc<int>(n)),
        sel_idx_(ctx.alloc<int>(n)),
        sidx1_(ctx.alloc<int>(n)),
        sidx2_(ctx.alloc<int>(n)),
        moved_(ctx.alloc<int>(n)),
        reg_(ctx.alloc<double>(n)),
        sel_key_(ctx.alloc<double>(n)),
        skey_(ctx.alloc<double>(n)),
        flag_(ctx.alloc<unsigned char>(n)),
        sslot_(ctx.alloc<unsigned>(n)),
        sslot2_(ctx.alloc<unsigned>(n)),
        cl_id_(ctx.alloc<int>(k)),
        cl_obj_(ctx.alloc<int>(mcap_)),
        slot_(ctx.alloc<int>(mcap_)),
        prices_(ctx.alloc<double>(mcap_)),
        arr_min_(ctx.alloc<double>(mcap_)),
        hist_(ctx.alloc<unsigned long long>(mcap_)),
        span_(ctx.alloc<unsigned long long>(2)),
        seg_in_(ctx.alloc<SegmentIn>(mcap_)),
        seg_out_(ctx.alloc<SegmentOut>(mcap_)),
        seg_off_(ctx.alloc<int64_t>(mcap_)),
        take_(ctx.alloc<int64_t>(mcap_)),
        nsel_(ctx.alloc<int64_t>(1)),
        pull_last_(ctx.alloc<double>(1)),
        pull_cnt_(ctx.alloc<int64_t>(1)) {
    iota_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(iota_.data(), n);
    CK_LAUNCH("iota_kernel");
    std::vector<int> id(k);
    std::iota(id.begin(), id.end(), 0);
    ctx.to_device(cl_id_.data(), id.data(), id.size());
    ctx.sync();  // `id` dies here
  }

  // auction_assign of auction.cpp on the device cost matrix D (n, k); labels: device int32 (n).
  int64_t assign(const double* D, const int64_t* lo, const int64_t* hi, AuctionState& state, int* labels,
                 const AuctionParams& ap) {
    D_ = D;
    span_known_ = false;
    if (ap.force_general) {
      state.used_general = true;
      return dummy_auction(lo, hi, state.general_prices, labels, ap);
    }
    const int64_t rounds = floor_auction(hi, state.floor_prices, ap);
    const std::vector<int64_t> sizes = histogram(ctx_, hist_, obj_.data(), n_, static_cast<int>(k_));
    bool lower_ok = true;
    for (int64_t j = 0; j < k_; ++j) lower_ok = lower_ok && sizes[j] >= lo[j];
    if (lower_ok) {
      // Optimal without the lower bounds and it meets them: optimal with them too.
      ctx_.copy(labels, obj_.data(), static_cast<size_t>(n_));
      state.used_general = false;
      return rounds;
    }
    state.used_general = true;
    return rounds + dummy_auction(lo, hi, state.general_prices, labels, ap);
  }

 private:
  EpsSchedule eps_schedule(const std::vector<double>& prices, bool warm, const AuctionParams& ap) {
    if (!span_known_) {  // depends on D only: shared by the floor and the general auction
      CK_CUDA(cudaMemsetAsync(span_.data(), 0, 2 * sizeof(unsigned long long), ctx_.stream));
      span_kernel<<<blocks_for(n_, kThreads, 4096), kThreads, 0, ctx_.stream>>>(D_, n_, k_, span_.data());
      CK_LAUNCH("span_kernel");
      unsigned long long bits[2];
      ctx_.to_host(bits, span_.data(), 2);
      ctx_.sync();
      std::memcpy(&span_raw_, &bits[0], sizeof(double));
      std::memcpy(&amax_, &bits[1], sizeof(double));
      span_known_ = true;
    }
    if (!(amax_ <= auction::kMaxCost))
      throw std::invalid_argument("auction_assign: the cost matrix has a NaN, an Inf or a |cost| above 2.8e306; "
                                  "every cost must be finite and in that range");
    double span = span_raw_;
    if (!(span > 0.0)) span = 1.0;
    double pmax = 0.0;
    for (double p : prices) pmax = std::max(pmax, std::fabs(p));
    // Below a few ulps of the costs, eps increments would vanish and the auction would never end.
    const double eps_final = std::max(ap.eps_final * span, 64.0 * DBL_EPSILON * (amax_ + pmax + span));
    return {std::max((warm ? ap.eps_warm : ap.eps_start) * span, eps_final), eps_final};
  }

  void upload_prices(const std::vector<double>& prices) { ctx_.to_device(prices_.data(), prices.data(), prices.size()); }

  // Cheapest object of every point at the current device prices.
  void argmin_all() {
    argmin_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, cl_, prices_.data(), m_, obj_.data());
    CK_LAUNCH("argmin_kernel");
  }

  // Members of the objects with slot[o] >= 0 (slot[o] = s, o = over[s]) sorted by (s, regret,
  // index) into sorted_idx_/sorted_slot_, and the eviction decision of every scanned segment.
  // The device prices must be the current ones. Returns the number of members sorted.
  int64_t select(const std::vector<int>& slot, const std::vector<SegmentIn>& seg, std::vector<SegmentOut>& res) {
    const int nover = static_cast<int>(seg.size());
    ctx_.to_device(slot_.data(), slot.data(), slot.size());
    regret_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, cl_, prices_.data(), m_, obj_.data(),
                                                                 slot_.data(), reg_.data(), flag_.data());
    CK_LAUNCH("regret_kernel");
    int64_t members = 0;
    for (const SegmentIn& g : seg) members += g.size;
    sorted_idx_ = sidx1_.data();
    sorted_slot_ = sslot_.data();
    if (members > 0) {
      size_t bytes = 0;
      CK_CUDA(cub::DeviceSelect::Flagged(nullptr, bytes, iota_.data(), flag_.data(), sel_idx_.data(), nsel_.data(),
                                         n_, ctx_.stream));
      void* tmp = ctx_.cub_storage(bytes);
      CK_CUDA(cub::DeviceSelect::Flagged(tmp, bytes, iota_.data(), flag_.data(), sel_idx_.data(), nsel_.data(), n_,
                                         ctx_.stream));
      gather_keys_kernel<<<blocks_for(members), kThreads, 0, ctx_.stream>>>(reg_.data(), sel_idx_.data(), members,
                                                                            sel_key_.data());
      CK_LAUNCH("gather_keys_kernel");
      // Stable: equal regrets keep index order. Then stable by object: (object, regret, index).
      sort_pairs<double>(ctx_, sel_key_.data(), skey_.data(), sel_idx_.data(), sidx1_.data(), members, 64);
      gather_slots_kernel<<<blocks_for(members), kThreads, 0, ctx_.stream>>>(obj_.data(), slot_.data(),
                                                                             sidx1_.data(), members, sslot_.data());
      CK_LAUNCH("gather_slots_kernel");
      if (nover > 1) {
        sort_pairs<unsigned>(ctx_, sslot_.data(), sslot2_.data(), sidx1_.data(), sidx2_.data(), members,
                             radix_bits(nover));
        sorted_idx_ = sidx2_.data();
        sorted_slot_ = sslot2_.data();
      }
    } else {
      CK_CUDA(cudaMemsetAsync(nsel_.data(), 0, sizeof(int64_t), ctx_.stream));
    }
    ctx_.to_device(seg_in_.data(), seg.data(), seg.size());
    decide_kernel<<<blocks_for(nover, 128), 128, 0, ctx_.stream>>>(seg_in_.data(), nover, reg_.data(), sorted_idx_,
                                                                    seg_out_.data());
    CK_LAUNCH("decide_kernel");
    res.resize(seg.size());
    ctx_.to_host(res.data(), seg_out_.data(), res.size());
    int64_t nsel = 0;
    ctx_.to_host(&nsel, nsel_.data(), 1);
    ctx_.sync();
    if (nsel != members) throw std::runtime_error("auction (CUDA): member count mismatch (internal error)");
    for (const SegmentOut& r : res) {
      if (r.error) throw std::runtime_error("auction (CUDA): eviction past the members (internal error)");
    }
    return members;
  }

  // The first take[s] members of every segment re-bid at the device prices (already the new ones).
  // Returns the arrivals per object; arrival_min gets the smallest arrival regret per object.
  std::vector<int64_t> rebid(const std::vector<SegmentIn>& seg, const std::vector<int64_t>& take, int64_t members,
                             std::vector<double>* arrival_min) {
    std::vector<int64_t> off(seg.size());
    for (size_t s = 0; s < seg.size(); ++s) off[s] = seg[s].off;
    ctx_.to_device(seg_off_.data(), off.data(), off.size());
    ctx_.to_device(take_.data(), take.data(), take.size());
    if (arrival_min != nullptr) {
      const std::vector<double> inf(static_cast<size_t>(m_), kInf);
      ctx_.to_device(arr_min_.data(), inf.data(), inf.size());
    }
    rebid_kernel<<<blocks_for(members), kThreads, 0, ctx_.stream>>>(
        D_, k_, cl_, prices_.data(), m_, sorted_idx_, sorted_slot_, members, seg_off_.data(), take_.data(),
        obj_.data(), moved_.data(), arrival_min != nullptr ? arr_min_.data() : nullptr);
    CK_LAUNCH("rebid_kernel");
    std::vector<int64_t> arrivals = histogram(ctx_, hist_, moved_.data(), members, m_);
    if (arrival_min != nullptr) {
      arrival_min->resize(static_cast<size_t>(m_));
      ctx_.to_host(arrival_min->data(), arr_min_.data(), arrival_min->size());
      ctx_.sync();
    }
    return arrivals;
  }

  // FloorAuction of auction.cpp; the result is left in obj_ (cluster per point).
  int64_t floor_auction(const int64_t* hi, std::vector<double>& prices, const AuctionParams& ap) {
    const int64_t n = n_, k = k_;
    cl_ = cl_id_.data();
    m_ = static_cast<int>(k);
    const bool warm = static_cast<int64_t>(prices.size()) == k;
    if (!warm) prices.assign(k, 0.0);
    const EpsSchedule es = eps_schedule(prices, warm, ap);
    double eps = es.eps;
    int64_t slack = -n;
    for (int64_t j = 0; j < k; ++j) slack += hi[j];
    std::vector<int64_t> counts(k);
    auto argmin_recount = [&]() {
      upload_prices(prices);
      argmin_all();
      counts = histogram(ctx_, hist_, obj_.data(), n, m_);
    };
    // Phase start (see auction.cpp): the exact argmin in the first phase, later only the points that
    // violate the new eps move; then reverse steps for under-full clusters with a positive price,
    // one cluster at a time in index order.
    auto start = [&](bool first) {
      if (first) {
        argmin_recount();
      } else {
        upload_prices(prices);
        phase_kernel<<<blocks_for(n), kThreads, 0, ctx_.stream>>>(D_, n, k, cl_, prices_.data(), m_, eps, obj_.data());
        CK_LAUNCH("phase_kernel");
        counts = histogram(ctx_, hist_, obj_.data(), n, m_);
      }
      if (slack <= 0) return;
      for (int64_t pass = 0;; ++pass) {
        bool changed = false;
        for (int64_t j = 0; j < k; ++j) {
          if (counts[j] >= hi[j] || prices[j] <= 0.0) continue;
          changed = true;
          if (pass >= 4 * k) {  // safety net: plain zeroing always terminates
            prices[j] = 0.0;
            continue;
          }
          const int64_t r = hi[j] - counts[j];
          upload_prices(prices);
          gap_kernel<<<blocks_for(n), kThreads, 0, ctx_.stream>>>(D_, n, k, prices_.data(), obj_.data(),
                                                                   static_cast<int>(j), sel_key_.data());
          CK_LAUNCH("gap_kernel");
          sort_pairs<double>(ctx_, sel_key_.data(), skey_.data(), iota_.data(), sidx1_.data(), n, 64);
          pull_kernel<<<1, 32, 0, ctx_.stream>>>(skey_.data(), r, prices[j], eps, pull_last_.data(),
                                                 pull_cnt_.data());
          CK_LAUNCH("pull_kernel");
          double last = 0.0;
          int64_t pulled = 0;
          ctx_.to_host(&last, pull_last_.data(), 1);
          ctx_.to_host(&pulled, pull_cnt_.data(), 1);
          ctx_.sync();
          const double drop = last + eps;
          if (drop >= prices[j]) {
            prices[j] = 0.0;  // only the points that prefer j by more than eps moved
          } else {
            prices[j] -= drop;
          }
          if (pulled > 0) {
            move_kernel<<<blocks_for(pulled), kThreads, 0, ctx_.stream>>>(sidx1_.data(), pulled, static_cast<int>(j),
                                                                         obj_.data(), moved_.data());
            CK_LAUNCH("move_kernel");
            const std::vector<int64_t> left = histogram(ctx_, hist_, moved_.data(), pulled, m_);
            for (int64_t o = 0; o < k; ++o) counts[o] -= left[o];
            counts[j] += pulled;
          }
        }
        if (!changed) return;
        if (pass >= 4 * k) argmin_recount();
      }
    };
    start(true);
    std::vector<int> slot(k);
    std::vector<SegmentOut> res;
    int64_t rounds = 0;
    for (;;) {
      for (;;) {
        std::vector<int64_t> over;
        for (int64_t j = 0; j < k; ++j) {
          slot[j] = -1;
          if (counts[j] > hi[j]) {
            slot[j] = static_cast<int>(over.size());
            over.push_back(j);
          }
        }
        if (over.empty()) break;
        if (++rounds > ap.max_rounds) throw std::runtime_error("floor_auction: no termination (internal error)");
        const size_t nover = over.size();
        std::vector<SegmentIn> seg(nover);
        int64_t off = 0;
        for (size_t s = 0; s < nover; ++s) {
          const int64_t j = over[s];
          seg[s] = SegmentIn{off, counts[j], counts[j] - hi[j], 0, kInf, 1};
          off += counts[j];
        }
        upload_prices(prices);
        const int64_t members = select(slot, seg, res);
        // The `excess` smallest (regret, index) leave; the price rises past the last of them.
        std::vector<int64_t> take(nover);
        for (size_t s = 0; s < nover; ++s) {
          const int64_t j = over[s];
          prices[j] = prices[j] + res[s].last + eps;
          take[s] = seg[s].excess;
          counts[j] = hi[j];
        }
        // Evicted points re-bid at the new prices, so no point sits more than eps from its best.
        upload_prices(prices);
        const std::vector<int64_t> arrivals = rebid(seg, take, members, nullptr);
        for (int64_t o = 0; o < k; ++o) counts[o] += arrivals[o];
      }
      if (eps <= es.eps_final) break;
      eps = std::max(eps / ap.eps_shrink, es.eps_final);
      start(false);
    }
    return rounds;
  }

  // DummyAuction of auction.cpp; writes cluster labels (int32) to `labels`.
  int64_t dummy_auction(const int64_t* lo, const int64_t* hi, std::vector<double>& prices, int* labels,
                        const AuctionParams& ap) {
    const int64_t n = n_, k = k_;
    const Objects ob(lo, hi, k);
    const int64_t m = ob.size();
    m_ = static_cast<int>(m);
    {
      std::vector<int> cl(ob.cluster.begin(), ob.cluster.end());
      ctx_.to_device(cl_obj_.data(), cl.data(), cl.size());
      ctx_.sync();  // `cl` dies here
      cl_ = cl_obj_.data();
    }
    const bool warm = static_cast<int64_t>(prices.size()) == m;
    if (!warm) prices.assign(m, 0.0);
    const EpsSchedule es = eps_schedule(prices, warm, ap);
    const double eps_final = es.eps_final;
    double eps = es.eps;

    upload_prices(prices);
    argmin_all();
    std::vector<int64_t> real = histogram(ctx_, hist_, obj_.data(), n, m_);
    int64_t n_dummy = -n;
    for (int64_t j = 0; j < k; ++j) n_dummy += hi[j];
    std::vector<int64_t> dummies = auction::place_dummies(prices, ob, real, n_dummy);

    std::vector<int> slot(m, -1);
    // lb[o]: lower bound on the smallest regret among o's real members (see auction.cpp).
    std::vector<double> lb(m, -kInf);
    std::vector<SegmentOut> res;
    std::vector<double> arrival_min;
    int64_t rounds = 0;

    for (;;) {
      for (;;) {  // auction rounds at this eps
        std::vector<int64_t> over;
        for (int64_t o = 0; o < m; ++o)
          if (real[o] + dummies[o] > ob.cap[o]) over.push_back(o);
        if (over.empty()) break;
        if (++rounds > ap.max_rounds) throw std::runtime_error("auction_assign: no termination (internal error)");
        const size_t nover = over.size();

        std::vector<int64_t> excess(nover), dst_dummy(nover);
        std::vector<double> rho(nover);
        bool any_scan = false;
        std::fill(slot.begin(), slot.end(), -1);
        for (size_t s = 0; s < nover; ++s) {
          const int64_t o = over[s];
          excess[s] = real[o] + dummies[o] - ob.cap[o];
          dst_dummy[s] = cheapest_dummy_object(prices, ob, o);
          rho[s] = (dummies[o] > 0 && dst_dummy[s] >= 0) ? prices[dst_dummy[s]] - prices[o] : kInf;
          if (!(excess[s] <= dummies[o] && rho[s] <= lb[o])) {
            slot[o] = static_cast<int>(s);
            any_scan = true;
          }
        }
        std::vector<SegmentIn> seg(nover);
        int64_t off = 0;
        for (size_t s = 0; s < nover; ++s) {
          const int64_t o = over[s];
          const bool scanned = slot[o] >= 0;
          const int64_t size = scanned ? real[o] : 0;
          seg[s] = SegmentIn{off, size, excess[s], dummies[o], rho[s], scanned ? 1 : 0};
          off += size;
        }
        int64_t members = 0;
        if (any_scan) {
          upload_prices(prices);
          members = select(slot, seg, res);
        }

        std::vector<double> new_price(nover), new_lb(nover);
        std::vector<int64_t> n_real(nover, 0), n_dum(nover, 0);
        for (size_t s = 0; s < nover; ++s) {
          const int64_t o = over[s];
          double last, rest_min = lb[o];
          if (slot[o] < 0) {  // only dummies leave: rho <= every real member's regret
            n_dum[s] = excess[s];
            last = rho[s];
          } else {
            n_real[s] = res[s].nr;
            n_dum[s] = res[s].nd;
            last = res[s].last;
            rest_min = res[s].rest_min;
          }
          const double delta = last + eps;
          new_price[s] = prices[o] + delta;
          new_lb[s] = rest_min - delta;
        }
        for (size_t s = 0; s < nover; ++s) {
          const int64_t o = over[s];
          if (!std::isfinite(new_price[s])) throw std::runtime_error("auction_assign: infinite price (internal error)");
          prices[o] = new_price[s];
          lb[o] = new_lb[s];
          real[o] -= n_real[s];
          dummies[o] -= n_dum[s];
        }
        // Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best.
        int64_t n_moved = 0;
        for (size_t s = 0; s < nover; ++s) n_moved += n_real[s];
        if (n_moved > 0) {
          upload_prices(prices);
          const std::vector<int64_t> arrivals = rebid(seg, n_real, members, &arrival_min);
          for (int64_t o = 0; o < m; ++o) {
            real[o] += arrivals[o];
            if (arrivals[o] > 0) lb[o] = std::min(lb[o], arrival_min[o]);
          }
        }
        int64_t dummy_total = 0;
        for (size_t s = 0; s < nover; ++s) dummy_total += n_dum[s];
        if (dummy_total > 0) dummies[cheapest_dummy_object(prices, ob, -1)] += dummy_total;
      }
      if (eps <= eps_final) break;
      // Next phase: shrink eps and move every unit that violates it to its cheapest object.
      eps = std::max(eps / ap.eps_shrink, eps_final);
      upload_prices(prices);
      phase_kernel<<<blocks_for(n), kThreads, 0, ctx_.stream>>>(D_, n, k, cl_, prices_.data(), m_, eps, obj_.data());
      CK_LAUNCH("phase_kernel");
      real = histogram(ctx_, hist_, obj_.data(), n, m_);
      std::fill(lb.begin(), lb.end(), -kInf);
      const int64_t cheapest = cheapest_dummy_object(prices, ob, -1);
      for (int64_t o = 0; o < m; ++o) {
        if (o != cheapest && dummies[o] > 0 && prices[o] > prices[cheapest] + eps) {
          dummies[cheapest] += dummies[o];
          dummies[o] = 0;
        }
      }
    }
    map_kernel<<<blocks_for(n), kThreads, 0, ctx_.stream>>>(obj_.data(), cl_, n, labels);
    CK_LAUNCH("map_kernel");
    return rounds;
  }

  Ctx& ctx_;
  int64_t n_, k_;
  size_t mcap_;
  DevArray<int> obj_, iota_, sel_idx_, sidx1_, sidx2_, moved_;
  DevArray<double> reg_, sel_key_, skey_;
  DevArray<unsigned char> flag_;
  DevArray<unsigned> sslot_, sslot2_;
  DevArray<int> cl_id_, cl_obj_, slot_;
  DevArray<double> prices_, arr_min_;
  DevArray<unsigned long long> hist_, span_;
  DevArray<SegmentIn> seg_in_;
  DevArray<SegmentOut> seg_out_;
  DevArray<int64_t> seg_off_, take_, nsel_;
  DevArray<double> pull_last_;
  DevArray<int64_t> pull_cnt_;

  const double* D_ = nullptr;  // the cost matrix of the current assign()
  const int* cl_ = nullptr;    // cluster of each object of the current auction
  int m_ = 0;                  // objects of the current auction
  const int* sorted_idx_ = nullptr;
  const unsigned* sorted_slot_ = nullptr;
  bool span_known_ = false;
  double span_raw_ = 0.0, amax_ = 0.0;
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
  DevArray<double> b0 = ctx.alloc<double>(n), b1 = ctx.alloc<double>(n);
  DevArray<double> cand_d = ctx.alloc<double>(static_cast<size_t>(n) * trials);
  DevArray<T> cand_rows = ctx.alloc<T>(static_cast<size_t>(trials) * d);
  DevArray<double> cand_norm = ctx.alloc<double>(trials);
  DevArray<double> P = ctx.alloc<double>(static_cast<size_t>(tiles_for(n) + 1));
  DevArray<double> rs_dev = ctx.alloc<double>(trials);
  DevArray<int64_t> cands_dev = ctx.alloc<int64_t>(trials);
  double* closest = b0.data();
  double* best_d = b1.data();
  launch_sqdist<T>(ctx, p.x.data(), p.xnorm.data(), n, d, p.x.data() + first * d, p.xnorm.data() + first, 1, closest);
  std::vector<double> rs(trials);
  std::vector<int64_t> cands(trials);
  for (int64_t j = 1; j < k; ++j) {
    const double total = red.prefix(ArrayTerm{closest}, n, P.data());
    for (int t = 0; t < trials; ++t) rs[t] = rng.uniform() * total;
    ctx.to_device(rs_dev.data(), rs.data(), rs.size());
    kpp_search_kernel<<<1, 32, 0, ctx.stream>>>(closest, n, P.data(), tiles_for(n), rs_dev.data(), trials,
                                                cands_dev.data());
    CK_LAUNCH("kpp_search_kernel");
    ctx.to_host(cands.data(), cands_dev.data(), cands.size());
    ctx.sync();
    // All candidates in one pass over the data, then their potentials (as the CPU).
    gather_rows_kernel<T><<<blocks_for(trials * d), kThreads, 0, ctx.stream>>>(
        p.x.data(), p.xnorm.data(), d, cands_dev.data(), trials, cand_rows.data(), cand_norm.data());
    CK_LAUNCH("gather_rows_kernel");
    launch_sqdist<T>(ctx, p.x.data(), p.xnorm.data(), n, d, cand_rows.data(), cand_norm.data(), trials,
                     cand_d.data());
    double best_pot = kInf;
    int best_t = -1;
    for (int t = 0; t < trials; ++t) {
      const double pot = red.sum(MinColumnTerm{closest, cand_d.data(), trials, t}, n);
      if (pot < best_pot) {
        best_pot = pot;
        best_t = t;
      }
    }
    if (best_t < 0) throw std::runtime_error("capacity_kmeans: k-means++ found no candidate (internal error)");
    min_column_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(closest, cand_d.data(), n, trials, best_t, best_d);
    CK_LAUNCH("min_column_kernel");
    put(j, cands[best_t]);
    std::swap(closest, best_d);
  }
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
    iota_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(iota.data(), n);
    CK_LAUNCH("iota_kernel");
  }
};

// Cluster means (the CPU's chunked double sums, same order); empty clusters re-seeded at the point
// farthest from its own centroid among clusters of size > 1, exactly as the reference does.
template <typename T>
void update_centroids(Ctx& ctx, UpdateBuffers& b, const Prepared<T>& p, int64_t n, int64_t d, int64_t k,
                      const int* labels, const double* D, bool spherical, std::vector<double>& cent) {
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
  std::vector<double> sums(static_cast<size_t>(k) * d);
  ctx.to_host(sums.data(), b.sums.data(), sums.size());
  ctx.sync();
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] == 0) continue;
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = sums[j * d + t] / static_cast<double>(counts[j]);
  }
  bool own_ready = false;
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] != 0) continue;
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

template <typename T>
CudaKMeansResult kmeans_impl(Ctx& ctx, const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
                             const T* init, const KMeansParams& p, int64_t* labels_out, double* cent_out,
                             double* dist_out) {
  const int64_t k = p.k;
  Prepared<T> prep = prepare(ctx, x, n, d, p.spherical);
  DevArray<double> dist = ctx.alloc<double>(static_cast<size_t>(n) * k);
  DevArray<double> exact = ctx.alloc<double>(n);
  DevArray<T> ct = ctx.alloc<T>(static_cast<size_t>(k) * d);
  DevArray<double> cn = ctx.alloc<double>(k);
  DevArray<double> cent_dev = ctx.alloc<double>(static_cast<size_t>(k) * d);
  DevArray<int> labels = ctx.alloc<int>(n), new_labels = ctx.alloc<int>(n);
  DevArray<int> mismatch = ctx.alloc<int>(1);
  AuctionGpu auction(ctx, n, k);
  Reducer red(ctx, n);
  UpdateBuffers ub(ctx, n, d, k);
  std::vector<T> init_host;
  if (init != nullptr) {
    init_host.resize(static_cast<size_t>(k) * d);
    ctx.to_host(init_host.data(), init, init_host.size());
    ctx.sync();
  }

  CudaKMeansResult best;
  double best_final = kInf;
  std::vector<double> best_cent;
  const int runs = init != nullptr ? 1 : p.n_init;
  for (int run = 0; run < runs; ++run) {
    std::vector<double> cent;
    if (init != nullptr) {
      cent.resize(static_cast<size_t>(k) * d);
      for (int64_t j = 0; j < k; ++j)
        for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(init_host[j * d + t]) - prep.mean[t];
    } else {
      SplitMix64 rng(run_seed(p.seed, static_cast<uint64_t>(run)));
      cent = kmeans_plusplus(ctx, prep, n, d, k, rng, red);
    }
    if (p.spherical) normalise_rows(cent, k, d);

    AuctionState prices;
    bool has_labels = false;
    std::vector<double> history;
    bool converged = false;
    int it = 0;
    int64_t rounds = 0;
    for (it = 1; it <= p.max_iter; ++it) {
      upload_centroids(ctx, cent, k, d, ct, cn);
      launch_sqdist<T>(ctx, prep.x.data(), prep.xnorm.data(), n, d, ct.data(), cn.data(), k, dist.data());
      rounds += auction.assign(dist.data(), lo, hi, prices, new_labels.data(), AuctionParams());
      double cost = red.sum(OwnCostTerm{dist.data(), new_labels.data(), k}, n);
      if (has_labels) {
        const double prev = red.sum(OwnCostTerm{dist.data(), labels.data(), k}, n);
        if (cost > prev) {
          ctx.copy(new_labels.data(), labels.data(), static_cast<size_t>(n));
          cost = prev;
        }
      }
      bool same = false;
      if (has_labels) {
        CK_CUDA(cudaMemsetAsync(mismatch.data(), 0, sizeof(int), ctx.stream));
        mismatch_kernel<<<blocks_for(n, kThreads, 4096), kThreads, 0, ctx.stream>>>(new_labels.data(), labels.data(),
                                                                                   n, mismatch.data());
        CK_LAUNCH("mismatch_kernel");
        same = ctx.read(mismatch.data()) == 0;
      }
      const double improved = history.empty() ? kInf : history.back() - cost;
      const double ref = history.empty() ? cost : history.back();
      labels.swap(new_labels);
      has_labels = true;
      history.push_back(cost);
      update_centroids(ctx, ub, prep, n, d, k, labels.data(), dist.data(), p.spherical, cent);
      if (same || improved <= p.tol * std::fabs(ref)) {
        converged = true;
        break;
      }
    }
    if (it > p.max_iter) it = p.max_iter;
    ctx.to_device(cent_dev.data(), cent.data(), cent.size());
    exact_own_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(prep.x.data(), n, d, cent_dev.data(),
                                                                    labels.data(), exact.data());
    CK_LAUNCH("exact_own_kernel");
    const double final_cost = red.sum(ArrayTerm{exact.data()}, n);
    if (final_cost < best_final) {
      best_final = final_cost;
      widen_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(labels.data(), n, labels_out);
      CK_LAUNCH("widen_kernel");
      ctx.copy(dist_out, exact.data(), static_cast<size_t>(n));
      best.history = history;
      best.n_iter = it;
      best.converged = converged;
      best.auction_rounds = rounds;
      best_cent = cent;
    }
  }
  if (best_cent.empty()) throw std::runtime_error("capacity_kmeans: no finite objective (internal error)");
  const double scale = p.spherical ? 0.5 : 1.0;  // |a - b|^2 = 2 (1 - cos) for unit vectors
  best.inertia = best_final * scale;
  for (double& v : best.history) v *= scale;
  if (p.spherical) {
    scale_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(dist_out, n, scale, dist_out);
    CK_LAUNCH("scale_kernel");
  }
  std::vector<double> out(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) out[j * d + t] = best_cent[j * d + t] + prep.mean[t];
  ctx.to_device(cent_out, out.data(), out.size());
  ctx.sync();
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
  widen_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(labels.data(), n, labels_out);
  CK_LAUNCH("widen_kernel");
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
  widen_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(lab.data(), n, reinterpret_cast<int64_t*>(labels));
  CK_LAUNCH("widen_kernel");
  ctx.sync();
  return rounds;
}

}  // namespace cuda
}  // namespace cluster_kernels
