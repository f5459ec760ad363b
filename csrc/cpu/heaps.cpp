// No CUDA counterpart: the device sorts every over-full cluster's members instead (cuda/auction_steps.cu).
// The floor auction's per-cluster eviction heaps (floor_auction.h): a forward round reads only the members that
// can be among the `excess` smallest regrets.
#include "cpu/floor_auction.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace cluster_kernels {
namespace auction {

// Largest rounding difference between a member's regret sc - (own + p_j) and key - p_j, key = sc - own, over
// this problem's magnitudes (eps_final >= 64 DBL_EPSILON (max |cost| + max |initial price| + span); prices
// grow during rounds, hence the current largest price).
double FloorAuction::rounding_margin() const {
  double pmax = 0.0;
  for (double p : p_) pmax = std::max(pmax, std::fabs(p));
  return es_.eps_final / 4.0 + 16.0 * DBL_EPSILON * pmax;
}

// The heaps of the clusters in `over` not built yet in this phase: their members (one pass over the
// labels for all of them) keyed at the current prices.
void FloorAuction::build_heaps(const std::vector<int64_t>& over) {
  std::vector<int64_t> slot(b_.k, -1), fresh;
  for (int64_t j : over) {
    if (built_[j]) continue;
    slot[j] = static_cast<int64_t>(fresh.size());
    fresh.push_back(j);
    built_[j] = 1;
  }
  if (fresh.empty()) return;
  group_rows(b_.n, static_cast<int64_t>(fresh.size()), [&](int64_t i) { return slot[obj_[i]]; }, members_);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t f = 0; f < static_cast<int64_t>(fresh.size()); ++f) {
    const int64_t j = fresh[f];
    auto& h = heap_[j];
    h.clear();
    const auto& mem = members_[f];
    for (size_t e = 0; e < mem.size(); ++e) {
      if (e + kPrefetchAhead < mem.size()) prefetch_row(mem[e + kPrefetchAhead]);
      h.push_back({second_cost(mem[e], j) - own_[mem[e]], mem[e]});
    }
    std::make_heap(h.begin(), h.end(), entry_after);
  }
}

// Into `cand`: members of the over-full cluster j popped from its heap, with their regrets (regret_) and
// fresh keys (key_), at least this rank's `t` smallest regrets among them and every member that could tie
// or beat the t-th (the rest stay in the heap, their keys lower bounds of their regrets plus p_j).
void FloorAuction::candidates(int64_t j, int64_t t, double margin, std::vector<int64_t>& cand) {
  auto& h = heap_[j];
  cand.clear();
  std::vector<double> best;  // the t smallest regrets popped so far, a max-heap
  const double pj = p_[j];
  while (!h.empty()) {
    if (static_cast<int64_t>(best.size()) >= t && h.front().key - pj - margin > best.front()) break;
    std::pop_heap(h.begin(), h.end(), entry_after);
    const int64_t i = h.back().row;
    h.pop_back();
    if (!h.empty()) prefetch_row(h.front().row);  // the likely next pop: its row arrives while this one is read
    const double sc = second_cost(i, j);
    key_[i] = sc - own_[i];
    regret_[i] = sc - (own_[i] + pj);  // own_[i] is row(i)[j]
    cand.push_back(i);
    if (static_cast<int64_t>(best.size()) < t) {
      best.push_back(regret_[i]);
      std::push_heap(best.begin(), best.end());
    } else if (regret_[i] < best.front()) {
      std::pop_heap(best.begin(), best.end());
      best.back() = regret_[i];
      std::push_heap(best.begin(), best.end());
    }
  }
}
}  // namespace auction
}  // namespace cluster_kernels
