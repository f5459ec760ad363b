// The floor auction's certificate on the device: the smallest reduced cost differences between clusters
// (AuctionGpu::reduced_slack), from which common/certificate.h finds the exact prices (FloorAuction::certified).
// The CPU counterpart is cpu/certificate.cpp.
#include <cstring>
#include <limits>

#include "common/certificate.h"
#include "cuda/auction_steps.cuh"
#include "cuda/floor_auction.cuh"

namespace cluster_kernels {
namespace cuda {

namespace {

// A 64-bit key per double that orders as the double (negative values included): an integer atomicMin then takes
// the double minimum, the same whatever the order of the updates. key_double inverts it (on the host).
__host__ __device__ __forceinline__ unsigned long long ordered_key(double v) {
  unsigned long long b;
  memcpy(&b, &v, sizeof b);
  return (b >> 63) ? ~b : (b | 0x8000000000000000ULL);
}
inline double key_double(unsigned long long key) {
  const unsigned long long b = (key >> 63) ? (key & 0x7FFFFFFFFFFFFFFFULL) : ~key;
  double v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// The floor auction's certificate (FloorAuction::certified of auction.cpp): per pair (own cluster a, other
// cluster c), the smallest reduced cost difference (D[i, c] + p[c]) - (D[i, a] + p[a]) below `reach`, as
// ordered keys (out starts at the key of +inf).
__global__ void slack_kernel(const double* __restrict__ D, int64_t n, int64_t k, const double* __restrict__ prices,
                             const int* __restrict__ obj, double reach, unsigned long long* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const double* Di = D + i * k;
    const int a = obj[i];
    const double own = __dadd_rn(Di[a], prices[a]);
    for (int64_t c = 0; c < k; ++c) {
      if (c == a) continue;
      const double g = __dsub_rn(__dadd_rn(Di[c], prices[c]), own);
      if (g < reach) atomicMin(out + a * k + c, ordered_key(g));
    }
  }
}

}  // namespace

std::vector<double> AuctionGpu::reduced_slack(double reach) {
  const size_t kk = static_cast<size_t>(k_ * k_);
  std::vector<unsigned long long> keys(kk, ordered_key(std::numeric_limits<double>::infinity()));
  ctx_.to_device(slack_.data(), keys.data(), kk);
  slack_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, prices_.data(), obj_.data(), reach,
                                                              slack_.data());
  CK_LAUNCH("slack_kernel");
  ctx_.to_host(keys.data(), slack_.data(), kk);
  ctx_.sync();
  std::vector<double> out(kk);
  for (size_t e = 0; e < kk; ++e) out[e] = key_double(keys[e]);
  return out;
}


// After a phase: whether the labels are already optimal (FloorAuction::certified of auction.cpp); the prices
// then become the exact ones.
bool FloorAuction::certified() {
  const double reach = auction::certify_reach(k_, eps_);
  a_.upload_prices(p_);
  const std::vector<double> slack = a_.reduced_slack(reach);
  std::vector<double> exact;
  if (!auction::exact_prices(k_, slack, p_, counts_, hi_, reach, exact)) return false;
  p_ = exact;
  return true;
}

}  // namespace cuda
}  // namespace cluster_kernels
