// Capacity-constrained K-means on CUDA, the Lloyd loop: csrc/cpu/lloyd.cpp moved onto the GPU step for step (the
// auction: auction.cu; the frame, distance tiles, sums, k-means++ and centroid update: the files of the same names
// as on the CPU; the helpers every file shares: device_utils.cuh). The CPU counterpart is cpu/lloyd.cpp.
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
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/auction.cuh"
#include "cuda/centroids.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/distance_tiles.cuh"
#include "cuda/kmeans.cuh"
#include "cuda/kmeans_plusplus.cuh"
#include "cuda/prepare.cuh"
#include "cuda/reductions.cuh"

namespace cluster_kernels {
namespace cuda {

namespace {

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
struct LloydRun {
  std::vector<double> history, cent;
  int n_iter = 0;
  bool converged = false;
  int64_t rounds = 0;
};

// What one call needs besides its buffers: the prepared data, the problem and the shared helpers.
template <typename T>
struct LloydStep {
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

  LloydRun run(std::vector<double> cent) {
    const int64_t k = p.k;
    LloydRun r;
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
    launch_exact_own<T>(ctx, prep.x.data(), n, d, buf.cent_dev.data(), buf.labels.data(), buf.exact.data());
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
void finish(Ctx& ctx, KMeansResult& best, double best_final, const std::vector<double>& best_cent,
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
KMeansResult kmeans_impl(Ctx& ctx, const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
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
  LloydStep<T> lloyd{ctx, prep, n, d, lo, hi, p, buf, auction, red, ub};
  KMeansResult best;
  double best_final = kInf;
  std::vector<double> best_cent;
  const int runs = init != nullptr ? 1 : p.n_init;
  for (int run = 0; run < runs; ++run) {
    LloydRun r = lloyd.run(start_centroids(ctx, prep, n, d, p, init_host, run, red));
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
  launch_exact_own<T>(ctx, prep.x.data(), n, d, cent_dev.data(), labels.data(), own.data());
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

KMeansResult capacity_kmeans(uintptr_t x, bool is_double, int64_t n, int64_t d, const int64_t* lo,
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

void assign_with_capacity(uintptr_t x, bool is_double, int64_t n, int64_t d, uintptr_t centroids, int64_t k,
                          const int64_t* lo, const int64_t* hi, bool spherical, uintptr_t labels, uintptr_t distances,
                          uintptr_t stream, int device) {
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


}  // namespace cuda
}  // namespace cluster_kernels
