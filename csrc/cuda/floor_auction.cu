// The floor auction on the device (floor_auction.cuh). The CPU counterpart is cpu/floor_auction.cpp.
#include "cuda/floor_auction.cuh"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace cluster_kernels {
namespace cuda {

FloorAuction::FloorAuction(AuctionGpu& a, const int64_t* hi, std::vector<double>& prices, const AuctionParams& ap)
    : a_(a), hi_(hi), p_(prices), ap_(ap), k_(a.k()), slot_(a.k()) {
  a_.use_clusters();
  const bool warm = static_cast<int64_t>(p_.size()) == k_;
  if (!warm) p_.assign(k_, 0.0);
  es_ = a_.eps_schedule(p_, warm, ap);
  eps_ = es_.eps;
  slack_ = free_places(a.n(), hi, k_);
}

int64_t FloorAuction::run() {
  start(true);
  if (at_free_argmin()) return rounds_;
  for (;;) {
    while (round()) {
    }
    if (eps_ <= es_.eps_final) break;
    if (eps_ <= ap_.eps_certify * es_.span && certified()) break;
    eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
    start(false);
  }
  return rounds_;
}

// Every price 0 and no cluster over its cap after the first phase start: the exact argmin, optimal; the later
// phases would change nothing (as FloorAuction::at_free_argmin of auction.cpp).
bool FloorAuction::at_free_argmin() const {
  for (int64_t j = 0; j < k_; ++j)
    if (p_[j] != 0.0 || counts_[j] > hi_[j]) return false;
  return true;
}

void FloorAuction::argmin_recount() {
  a_.upload_prices(p_);
  a_.argmin_all();
  counts_ = a_.object_counts();
}

// Phase start (see auction.cpp): the exact argmin in the first phase, later only the points that violate
// the new eps move; then reverse steps for under-full clusters with a positive price, one cluster at a
// time in index order.
void FloorAuction::start(bool first) {
  if (first) {
    argmin_recount();
  } else {
    a_.upload_prices(p_);
    a_.phase(eps_);
    counts_ = a_.object_counts();
  }
  if (slack_ <= 0) return;
  for (int64_t pass = 0;; ++pass) {
    bool changed = false;
    for (int64_t j = 0; j < k_; ++j) {
      if (counts_[j] >= hi_[j] || p_[j] <= 0.0) continue;
      changed = true;
      if (pass >= 4 * k_) {  // safety net: plain zeroing always terminates
        p_[j] = 0.0;
        continue;
      }
      pull(j);
    }
    if (!changed) return;
    if (pass >= 4 * k_) argmin_recount();
  }
}

// One forward round: the `excess` smallest (regret, index) of every over-full cluster leave, its price
// rises past the last of them, and the evicted re-bid. False when none is over-full.
bool FloorAuction::round() {
  std::vector<int64_t> over;
  for (int64_t j = 0; j < k_; ++j) {
    slot_[j] = -1;
    if (counts_[j] > hi_[j]) {
      slot_[j] = static_cast<int>(over.size());
      over.push_back(j);
    }
  }
  if (over.empty()) return false;
  if (++rounds_ > ap_.max_rounds) throw std::runtime_error("floor_auction: no termination (internal error)");
  const size_t nover = over.size();
  std::vector<SegmentIn> seg(nover);
  int64_t off = 0;
  for (size_t s = 0; s < nover; ++s) {
    const int64_t j = over[s];
    seg[s] = SegmentIn{off, counts_[j], counts_[j] - hi_[j], 0, kInf, 1};
    off += counts_[j];
  }
  a_.upload_prices(p_);
  const int64_t members = a_.select(slot_, seg, res_);
  std::vector<int64_t> take(nover);
  for (size_t s = 0; s < nover; ++s) {
    const int64_t j = over[s];
    p_[j] = p_[j] + res_[s].last + eps_;
    take[s] = seg[s].excess;
    counts_[j] = hi_[j];
  }
  // Evicted points re-bid at the new prices, so no point sits more than eps from its best.
  a_.upload_prices(p_);
  const std::vector<int64_t> arrivals = a_.rebid(seg, take, members, nullptr);
  for (int64_t o = 0; o < k_; ++o) counts_[o] += arrivals[o];
  return true;
}

}  // namespace cuda
}  // namespace cluster_kernels
