// The general auction on the device (dummy_auction.cuh). The CPU counterpart is cpu/dummy_auction.cpp.
#include "cuda/dummy_auction.cuh"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace cluster_kernels {
namespace cuda {

DummyAuction::DummyAuction(AuctionGpu& a, const int64_t* lo, const int64_t* hi, std::vector<double>& prices,
             const AuctionParams& ap)
    : a_(a), ob_(lo, hi, a.k()), m_(ob_.size()), p_(prices), ap_(ap), slot_(m_, -1), lb_(m_, -kInf) {
  a_.use_objects(ob_);
  const bool warm = static_cast<int64_t>(p_.size()) == m_;
  if (!warm) p_.assign(m_, 0.0);
  es_ = a_.eps_schedule(p_, warm, ap);
  eps_ = es_.eps;
  // Cold and warm start alike: every unit takes its cheapest object.
  a_.upload_prices(p_);
  a_.argmin_all();
  real_ = a_.object_counts();
  int64_t n_dummy = -a.n();
  for (int64_t j = 0; j < a.k(); ++j) n_dummy += hi[j];
  dummies_ = auction::place_dummies(p_, ob_, real_, n_dummy);
}

// Writes cluster labels (int32) to `labels`.
int64_t DummyAuction::run(int* labels) {
  for (;;) {
    while (round()) {
    }
    if (eps_ <= es_.eps_final) break;
    next_phase();
  }
  a_.write_labels(labels);
  return rounds_;
}

// The objects above capacity; slot_[o] = s for those whose real members must be scanned.
std::vector<DummyAuction::Over> DummyAuction::over_objects(bool* any_scan) {
  std::vector<Over> over;
  for (int64_t o = 0; o < m_; ++o)
    if (real_[o] + dummies_[o] > ob_.cap[o]) over.push_back(Over{o, real_[o] + dummies_[o] - ob_.cap[o], kInf});
  *any_scan = false;
  std::fill(slot_.begin(), slot_.end(), -1);
  for (size_t s = 0; s < over.size(); ++s) {
    Over& v = over[s];
    const int64_t dst_dummy = cheapest_dummy_object(p_, ob_, v.o);
    v.rho = (dummies_[v.o] > 0 && dst_dummy >= 0) ? p_[dst_dummy] - p_[v.o] : kInf;
    if (!(v.excess <= dummies_[v.o] && v.rho <= lb_[v.o])) {
      slot_[v.o] = static_cast<int>(s);
      *any_scan = true;
    }
  }
  return over;
}

// The segments of the sorted members handed to the device: scanned objects contribute their real members.
std::vector<SegmentIn> DummyAuction::segments(const std::vector<Over>& over) const {
  std::vector<SegmentIn> seg(over.size());
  int64_t off = 0;
  for (size_t s = 0; s < over.size(); ++s) {
    const Over& v = over[s];
    const bool scanned = slot_[v.o] >= 0;
    const int64_t size = scanned ? real_[v.o] : 0;
    seg[s] = SegmentIn{off, size, v.excess, dummies_[v.o], v.rho, scanned ? 1 : 0};
    off += size;
  }
  return seg;
}

// How many real units and dummies leave each object, its new price and regret bound.
void DummyAuction::decide(std::vector<Over>& over) const {
  for (size_t s = 0; s < over.size(); ++s) {
    Over& v = over[s];
    double last, rest_min = lb_[v.o];
    if (slot_[v.o] < 0) {  // only dummies leave: rho <= every real member's regret
      v.n_dum = v.excess;
      last = v.rho;
    } else {
      v.n_real = res_[s].nr;
      v.n_dum = res_[s].nd;
      last = res_[s].last;
      rest_min = res_[s].rest_min;
    }
    const double delta = last + eps_;
    v.price = p_[v.o] + delta;
    v.lb = rest_min - delta;
  }
}

// One forward round over the objects above capacity; false when none is.
bool DummyAuction::round() {
  bool any_scan = false;
  std::vector<Over> over = over_objects(&any_scan);
  if (over.empty()) return false;
  if (++rounds_ > ap_.max_rounds) throw std::runtime_error("auction_assign: no termination (internal error)");
  const std::vector<SegmentIn> seg = segments(over);
  int64_t members = 0;
  if (any_scan) {
    a_.upload_prices(p_);
    members = a_.select(slot_, seg, res_);
  }
  decide(over);
  for (const Over& v : over) {
    if (!std::isfinite(v.price)) throw std::runtime_error("auction_assign: infinite price (internal error)");
    p_[v.o] = v.price;
    lb_[v.o] = v.lb;
    real_[v.o] -= v.n_real;
    dummies_[v.o] -= v.n_dum;
  }
  rebid(over, seg, members);
  int64_t dummy_total = 0;
  for (const Over& v : over) dummy_total += v.n_dum;
  if (dummy_total > 0) dummies_[cheapest_dummy_object(p_, ob_, -1)] += dummy_total;
  return true;
}

// Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best; arrivals lower
// the bound of their new object to their regret.
void DummyAuction::rebid(const std::vector<Over>& over, const std::vector<SegmentIn>& seg, int64_t members) {
  std::vector<int64_t> n_real(over.size());
  int64_t n_moved = 0;
  for (size_t s = 0; s < over.size(); ++s) n_moved += (n_real[s] = over[s].n_real);
  if (n_moved == 0) return;
  a_.upload_prices(p_);
  const std::vector<int64_t> arrivals = a_.rebid(seg, n_real, members, &arrival_min_);
  for (int64_t o = 0; o < m_; ++o) {
    real_[o] += arrivals[o];
    if (arrivals[o] > 0) lb_[o] = std::min(lb_[o], arrival_min_[o]);
  }
}

// Next phase: shrink eps and move every unit that violates it to its cheapest object.
void DummyAuction::next_phase() {
  eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
  a_.upload_prices(p_);
  a_.phase(eps_);
  real_ = a_.object_counts();
  std::fill(lb_.begin(), lb_.end(), -kInf);
  gather_dummies(p_, ob_, eps_, dummies_);
}

}  // namespace cuda
}  // namespace cluster_kernels
