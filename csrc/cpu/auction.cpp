// The eviction auction on a float64 cost block (auction.h): the floor auction first (floor_auction.h, on a
// working set for warm calls: working_set.h), the general one (dummy_auction.h) only when the floor solution
// misses a lower bound. See cluster_kernels/kmeans_reference.py for the algorithm; this is the native port of
// its float64 reference (_floor_auction_ref, _dummy_auction_ref, assign_ref). The CUDA counterpart is
// cuda/auction.cu.
#include "cpu/auction.h"

#include <algorithm>
#include <limits>

#include "cpu/auction_steps.h"
#include "cpu/dummy_auction.h"
#include "cpu/floor_auction.h"
#include "cpu/working_set.h"

namespace cluster_kernels {

using auction::CostRange;
using auction::DummyAuction;
using auction::FloorAuction;
using auction::Block;
using auction::cost_range;
using auction::global_counts;
using auction::kInf;
using auction::kNoRow;
using auction::WorkingSet;

void Collective::select(const std::vector<int64_t>& grp, const std::vector<double>& val,
                        const std::vector<int64_t>& gid, const std::vector<int64_t>& t, std::vector<double>& tv,
                        std::vector<int64_t>& tg) {
  const int64_t groups = static_cast<int64_t>(t.size());
  std::vector<std::vector<int64_t>> by_group(groups);
  for (int64_t e = 0; e < static_cast<int64_t>(grp.size()); ++e) by_group[grp[e]].push_back(e);
  tv.assign(groups, kInf);
  tg.assign(groups, kNoRow);
  for (int64_t g = 0; g < groups; ++g) {
    auto& es = by_group[g];
    if (static_cast<int64_t>(es.size()) < t[g]) continue;
    auto less = [&](int64_t a, int64_t b) { return val[a] < val[b] || (val[a] == val[b] && gid[a] < gid[b]); };
    std::nth_element(es.begin(), es.begin() + (t[g] - 1), es.end(), less);
    tv[g] = val[es[t[g] - 1]];
    tg[g] = gid[es[t[g] - 1]];
  }
}

int64_t auction_assign(const double* D, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap, Collective& comm,
                       const RowBlock& rows) {
  const Block b{D, n, k, comm, rows.offset, rows.n_total};
  if (ap.force_general) {
    state.used_general = true;
    return DummyAuction(b, lo, hi, state.general_prices, ap, cost_range(b)).run(labels);
  }
  std::vector<int32_t> obj(n);
  CostRange range;
  int64_t rounds;
  if (WorkingSet::applies(b, hi, state, ap)) {
    WorkingSet ws(b, hi, state, obj.data(), ap);
    rounds = ws.run();
    range = ws.range();
  } else {
    range = cost_range(b);
    rounds = FloorAuction(b, hi, state, obj.data(), ap, range).run();
  }
  const std::vector<int64_t> sizes = global_counts(b, obj.data(), k);
  bool lower_ok = true;
  for (int64_t j = 0; j < k; ++j) lower_ok = lower_ok && sizes[j] >= lo[j];
  if (lower_ok) {
    // Optimal without the lower bounds and it meets them: optimal with them too.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) labels[i] = obj[i];
    state.used_general = false;
    return rounds;
  }
  state.used_general = true;
  return rounds + DummyAuction(b, lo, hi, state.general_prices, ap, range).run(labels);
}

int64_t auction_assign(const double* D, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap) {
  Collective one;
  return auction_assign(D, n, k, lo, hi, state, labels, ap, one, RowBlock{0, n});
}

}  // namespace cluster_kernels
