// The general auction (dummy_auction.h). The CUDA counterpart is cuda/dummy_auction.cu.
#include "cpu/dummy_auction.h"

#include <algorithm>
#include <cmath>

namespace cluster_kernels {
namespace auction {

DummyAuction::DummyAuction(const Block& b, const int64_t* lo, const int64_t* hi, std::vector<double>& prices,
             const AuctionParams& ap, const CostRange& range)
    : b_(b), ob_(lo, hi, b.k), m_(ob_.size()), p_(prices), ap_(ap), obj_(b.n), own_(b.n), regret_(b.n),
      second_(b.n, m_) {
  const bool warm = static_cast<int64_t>(p_.size()) == m_;
  if (!warm) p_.assign(m_, 0.0);
  es_ = eps_schedule(range, p_, warm, ap);
  eps_ = es_.eps;
  // Cold and warm start alike: every unit takes its cheapest object.
  bool bad = false;
#pragma omp parallel for schedule(static) reduction(|| : bad)
  for (int64_t i = 0; i < b.n; ++i) {
    const Three t = cheapest_three(i);
    bad = bad || t.best < 0;
    obj_[i] = static_cast<int32_t>(t.best < 0 ? 0 : t.best);
    set_own(i);
    second_.put(i, obj_[i], t);
  }
  check_bids(bad, "auction_assign");
  real_ = global_counts(b, obj_.data(), m_);
  int64_t n_dummy = -b.n_total;
  for (int64_t j = 0; j < b.k; ++j) n_dummy += hi[j];
  dummies_ = auction::place_dummies(p_, ob_, real_, n_dummy);
  lb_.assign(m_, -kInf);
  exact_ = dummies_exact();
}

int64_t DummyAuction::run(int64_t* labels) {
  for (;;) {
    if (settled()) break;
    while (round()) {
    }
    if (eps_ <= es_.eps_final) break;
    next_phase();
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < b_.n; ++i) labels[i] = ob_.cluster[obj_[i]];
  return rounds_;
}

// Whether every dummy sits in an object priced exactly as the cheapest dummy-capable one.
bool DummyAuction::dummies_exact() const {
  const int64_t cheapest = cheapest_dummy_object(p_, ob_, -1);
  for (int64_t o = 0; o < m_; ++o)
    if (dummies_[o] > 0 && p_[o] > p_[cheapest]) return false;
  return true;
}

// At a phase start: every unit at its exact cheapest object (ties count) and no object over capacity. The
// assignment is then optimal for these prices and every later phase would move no unit and run no round:
// they are skipped (as FloorAuction::settled). exact_ and the counts are global: every rank agrees.
bool DummyAuction::settled() const {
  if (!exact_) return false;
  for (int64_t o = 0; o < m_; ++o)
    if (real_[o] + dummies_[o] > ob_.cap[o]) return false;
  return true;
}

std::vector<DummyAuction::Over> DummyAuction::over_objects() {
  std::vector<Over> over;
  for (int64_t o = 0; o < m_; ++o) {
    if (real_[o] + dummies_[o] <= ob_.cap[o]) continue;
    const int64_t excess = real_[o] + dummies_[o] - ob_.cap[o];
    const int64_t dst = cheapest_dummy_object(p_, ob_, o);
    const double rho = (dummies_[o] > 0 && dst >= 0) ? p_[dst] - p_[o] : kInf;
    over.push_back({o, excess, rho, !(excess <= dummies_[o] && rho <= lb_[o])});
  }
  return over;
}

// Regrets of the real members of the scanned objects, and those members per object.
void DummyAuction::scan(const std::vector<Over>& over) {
  std::vector<int64_t> slot(m_, -1);
  bool any = false;
  for (int64_t s = 0; s < static_cast<int64_t>(over.size()); ++s) {
    if (!over[s].scan) continue;
    slot[over[s].o] = s;
    any = true;
  }
  members_.resize(over.size());
  for (auto& m : members_) m.clear();
  if (!any) return;
  group_rows(b_.n, static_cast<int64_t>(over.size()), [&](int64_t i) {
    const int64_t o = obj_[i];
    if (slot[o] < 0) return int64_t{-1};
    const double sc = second_.value(i, o, m_, [&](int64_t q) { return cost(i, q); });
    regret_[i] = sc - (own_[i] + p_[o]);  // cost(i, o) without reading the scattered row
    return slot[o];
  }, members_);
}

// How many real units and dummies leave each object, and the last one's regret. The units leave in
// the order of the reference: reals with regret < rho, then the dummies (first on equal regret), then
// the other reals, each group by (regret, row).
void DummyAuction::split_evictions(std::vector<Over>& over) {
  const int64_t nover = static_cast<int64_t>(over.size());
  std::vector<int64_t> below(nover, 0);
  bool need = false;
  for (int64_t s = 0; s < nover; ++s) {
    if (!over[s].scan || dummies_[over[s].o] == 0) continue;
    need = true;
    for (int64_t i : members_[s]) below[s] += regret_[i] < over[s].rho;
  }
  if (need) b_.comm.sum(below);
  std::vector<int64_t> want(nover, 0);
  for (int64_t s = 0; s < nover; ++s) {
    Over& v = over[s];
    const int64_t d = dummies_[v.o];
    if (!v.scan) {
      v.n_dum = v.excess;  // only dummies leave: rho <= every real member's regret
      v.last = v.rho;
      continue;
    }
    v.n_real = d == 0 || v.excess <= below[s] ? v.excess : std::max(v.excess - d, below[s]);
    v.n_dum = v.excess - v.n_real;
    want[s] = v.n_real;
  }
  const Threshold th = select_smallest(b_, regret_.data(), members_, want);
  for (int64_t s = 0; s < nover; ++s) {
    Over& v = over[s];
    if (!v.scan) continue;
    v.last = v.n_dum > 0 && v.n_real <= below[s] ? v.rho : th.val[s];
    const auto& mem = members_[s];
    for (auto it = mem.begin() + th.count[s]; it != mem.end(); ++it) v.rest = std::min(v.rest, regret_[*it]);
    members_[s].resize(th.count[s]);  // the local reals that leave
  }
}

// One forward round over the objects above capacity; false when none is.
bool DummyAuction::round() {
  std::vector<Over> over = over_objects();
  if (over.empty()) return false;
  if (++rounds_ > ap_.max_rounds) throw std::runtime_error("auction_assign: no termination (internal error)");
  scan(over);
  split_evictions(over);
  std::vector<double> lb = lb_;  // the bounds after this round, this rank's view
  std::vector<int64_t> moved;
  int64_t dummy_total = 0;
  for (const Over& v : over) {
    const double delta = v.last + eps_;
    const double price = p_[v.o] + delta;
    if (!std::isfinite(price)) throw std::runtime_error("auction_assign: infinite price (internal error)");
    second_.price(v.o, p_[v.o], price);
    p_[v.o] = price;
    lb[v.o] = (v.scan ? v.rest : lb_[v.o]) - delta;
    real_[v.o] -= v.n_real;
    dummies_[v.o] -= v.n_dum;
    dummy_total += v.n_dum;
  }
  for (size_t s = 0; s < over.size(); ++s) moved.insert(moved.end(), members_[s].begin(), members_[s].end());
  rebid(moved, lb);
  if (dummy_total > 0) dummies_[cheapest_dummy_object(p_, ob_, -1)] += dummy_total;
  return true;
}

// Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best; arrivals
// lower the bound of their new object to their regret. lb: the bounds before the arrivals.
void DummyAuction::rebid(const std::vector<int64_t>& moved, std::vector<double>& lb) {
  const int64_t nm = static_cast<int64_t>(moved.size());
  std::vector<double> arrival(nm);
  bool bad = false;
#pragma omp parallel for schedule(static) if (nm > 4096) reduction(|| : bad)
  for (int64_t e = 0; e < nm; ++e) {
    const int64_t i = moved[e];
    const Three t = cheapest_three(i);
    bad = bad || t.best < 0;
    obj_[i] = static_cast<int32_t>(t.best < 0 ? 0 : t.best);
    set_own(i);
    arrival[e] = t.sc - t.bc;
    second_.put(i, obj_[i], t);
  }
  check_bids(bad, "auction_assign");
  std::vector<int64_t> came(m_, 0);
  for (int64_t e = 0; e < nm; ++e) {
    const int64_t o = obj_[moved[e]];
    ++came[o];
    lb[o] = std::min(lb[o], arrival[e]);
  }
  if (b_.comm.distributed()) {
    b_.comm.sum(came);
    for (double& v : lb) v = -v;  // a min as a max
    b_.comm.max(lb);
    for (double& v : lb) v = -v;
  }
  for (int64_t o = 0; o < m_; ++o) real_[o] += came[o];
  lb_.swap(lb);
}

// Next phase: shrink eps and move every unit that violates it to its cheapest object.
void DummyAuction::next_phase() {
  eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
  bool bad = false;
  int64_t inexact = 0;  // units left above their exact best (within eps of it)
#pragma omp parallel for schedule(static) reduction(|| : bad) reduction(+ : inexact)
  for (int64_t i = 0; i < b_.n; ++i) {
    const Three t = cheapest_three(i);
    if (t.best < 0) {
      bad = true;
      continue;
    }
    const double own = cost(i, obj_[i]);
    if (own > t.bc + eps_) {
      obj_[i] = static_cast<int32_t>(t.best);
      set_own(i);
    } else {
      inexact += own > t.bc;
    }
    second_.put(i, obj_[i], t);
  }
  check_bids(bad, "auction_assign");
  real_ = global_counts(b_, obj_.data(), m_, &inexact);
  exact_ = inexact == 0;
  std::fill(lb_.begin(), lb_.end(), -kInf);
  gather_dummies(p_, ob_, eps_, dummies_);
  exact_ = exact_ && dummies_exact();
}
}  // namespace auction
}  // namespace cluster_kernels
