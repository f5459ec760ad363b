// The serial finishing kernels of the CUDA sums (reductions.cuh). The CPU counterpart is cpu/reductions.h.
#include "cuda/reductions.cuh"

namespace cluster_kernels {
namespace cuda {

namespace {

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

}  // namespace

void sequential_sum(Ctx& ctx, const double* part, int64_t count, double* out) {
  sequential_sum_kernel<<<1, 32, 0, ctx.stream>>>(part, count, out);
  CK_LAUNCH("sequential_sum_kernel");
}

void tile_prefix(Ctx& ctx, const double* part, int64_t ntiles, double* P) {
  tile_prefix_kernel<<<1, 32, 0, ctx.stream>>>(part, ntiles, P);
  CK_LAUNCH("tile_prefix_kernel");
}

}  // namespace cuda
}  // namespace cluster_kernels
