// The eviction auction on the GPU: csrc/cpu/auction.cpp moved onto the device step for step, with the same two
// classes, FloorAuction (upper bounds only; floor_auction.cuh) and DummyAuction (the general problem with dummy
// units; dummy_auction.cuh), which runs only when the lower bounds are not met by the floor solution; and the
// entry point auction_assign of kmeans.cuh. The CPU counterpart is cpu/auction.cpp.
#include "cuda/auction.cuh"

#include <vector>

#include "cuda/dummy_auction.cuh"
#include "cuda/floor_auction.cuh"
#include "cuda/kmeans.cuh"

namespace cluster_kernels {
namespace cuda {

int64_t AuctionGpu::assign(const double* D, const int64_t* lo, const int64_t* hi, AuctionState& state, int* labels,
                           const AuctionParams& ap) {
  D_ = D;
  span_known_ = false;
  if (ap.force_general) {
    state.used_general = true;
    return DummyAuction(*this, lo, hi, state.general_prices, ap).run(labels);
  }
  const int64_t rounds = FloorAuction(*this, hi, state.floor_prices, ap).run();
  const std::vector<int64_t> sizes = object_counts();
  bool lower_ok = true;
  for (int64_t j = 0; j < k_; ++j) lower_ok = lower_ok && sizes[j] >= lo[j];
  if (lower_ok) {
    // Optimal without the lower bounds and it meets them: optimal with them too.
    ctx_.copy(labels, obj_.data(), static_cast<size_t>(n_));
    state.used_general = false;
    return rounds;
  }
  state.used_general = true;
  return rounds + DummyAuction(*this, lo, hi, state.general_prices, ap).run(labels);
}


int64_t auction_assign(uintptr_t dist, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi, uintptr_t labels,
                       uintptr_t stream, int device) {
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
