// The floor auction's reverse steps on the device: the gaps of every point to an under-full cluster, in order,
// and the move of the points it pulls in (AuctionGpu::pull_candidates, move_to; FloorAuction::pull). The CPU
// counterpart is cpu/reverse_step.cpp.
#include <math_constants.h>

#include "cuda/auction_steps.cuh"
#include "cuda/floor_auction.cuh"

namespace cluster_kernels {
namespace cuda {

namespace {

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

}  // namespace

void AuctionGpu::pull_candidates(int j, int64_t r, double price, double eps, double* last, int64_t* pulled) {
  gap_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, prices_.data(), obj_.data(), j,
                                                           sel_key_.data());
  CK_LAUNCH("gap_kernel");
  sort_pairs<double>(ctx_, sel_key_.data(), skey_.data(), iota_.data(), sidx1_.data(), n_, 64);
  pull_kernel<<<1, 32, 0, ctx_.stream>>>(skey_.data(), r, price, eps, pull_last_.data(), pull_cnt_.data());
  CK_LAUNCH("pull_kernel");
  ctx_.to_host(last, pull_last_.data(), 1);
  ctx_.to_host(pulled, pull_cnt_.data(), 1);
  ctx_.sync();
}

std::vector<int64_t> AuctionGpu::move_to(int j, int64_t pulled) {
  move_kernel<<<blocks_for(pulled), kThreads, 0, ctx_.stream>>>(sidx1_.data(), pulled, j, obj_.data(),
                                                                 moved_.data());
  CK_LAUNCH("move_kernel");
  return histogram(ctx_, hist_, moved_.data(), pulled, m_);
}


// Reverse step of the under-full cluster j.
void FloorAuction::pull(int64_t j) {
  const int64_t r = hi_[j] - counts_[j];
  a_.upload_prices(p_);
  double last = 0.0;
  int64_t pulled = 0;
  a_.pull_candidates(static_cast<int>(j), r, p_[j], eps_, &last, &pulled);
  const double drop = last + eps_;
  if (drop >= p_[j]) {
    p_[j] = 0.0;  // only the points that prefer j by more than eps moved
  } else {
    p_[j] -= drop;
  }
  if (pulled > 0) {
    const std::vector<int64_t> left = a_.move_to(static_cast<int>(j), pulled);
    for (int64_t o = 0; o < k_; ++o) counts_[o] -= left[o];
    counts_[j] += pulled;
  }
}

}  // namespace cuda
}  // namespace cluster_kernels
