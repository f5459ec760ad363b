// The CUDA K-means' deterministic sums (the CPU's chunked sums, bit for bit, and tile prefixes); reductions.cu has
// the serial finishing kernels. The CPU counterpart is cpu/reductions.h.
#pragma once

#include <cstdint>

#include "cuda/device_utils.cuh"

namespace cluster_kernels {
namespace cuda {

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

// *out = part[0] + ... + part[count - 1], in order (one thread).
void sequential_sum(Ctx& ctx, const double* part, int64_t count, double* out);
// P[0] = 0, P[b + 1] = P[b] + part[b] (one thread).
void tile_prefix(Ctx& ctx, const double* part, int64_t ntiles, double* P);

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
    sequential_sum(ctx_, part_.data(), nc, out_.data());
    return ctx_.read(out_.data());
  }

  // Tile prefix P (ntiles + 1 entries) of the terms; returns the total P[ntiles].
  template <typename F>
  double prefix(F f, int64_t n, double* P) {
    const int64_t nt = tiles_for(n);
    tile_sums_kernel<F><<<blocks_for(nt, 1), kThreads, 0, ctx_.stream>>>(f, n, nt, part_.data());
    CK_LAUNCH("tile_sums_kernel");
    tile_prefix(ctx_, part_.data(), nt, P);
    return ctx_.read(P + nt);
  }

 private:
  Ctx& ctx_;
  DevArray<double> part_, out_;
};

}  // namespace cuda
}  // namespace cluster_kernels
