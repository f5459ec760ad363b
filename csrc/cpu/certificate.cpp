// The floor auction's certificate (floor_auction.h; the exact prices: common/certificate.h): after a phase, whether
// the labels are already exactly optimal. The CUDA counterpart is cuda/certificate.cu.
#include "cpu/floor_auction.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include "common/certificate.h"

namespace cluster_kernels {
namespace auction {

// After a phase: whether the labels are already optimal, exactly (auction_objects.h, exact_prices); if so the
// prices become the exact ones and the later phases, which could only confirm it, are skipped. Only the pairs
// (own cluster, other cluster) with a reduced cost difference below the reach (certify_reach) can matter, so a
// point whose cached regret is at least that reads no row.
bool FloorAuction::certified() {
  const int64_t k = b_.k;
  const double reach = auction::certify_reach(k, eps_);
  std::vector<double> slack(static_cast<size_t>(k * k), kInf);
#pragma omp parallel
  {
    std::vector<double> local(static_cast<size_t>(k * k), kInf);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < b_.n; ++i) {
      const int64_t a = obj_[i];
      const double* Di = row(i);
      const double own = own_[i] + p_[a];  // own_[i] is Di[a]
      double sc;
      if (second_.get(i, a, &sc, [&](int64_t c) { return Di[c] + p_[c]; }) && !(sc - own < reach)) continue;
      double* la = local.data() + a * k;
      for (int64_t c = 0; c < k; ++c) {
        const double g = (Di[c] + p_[c]) - own;
        if (c != a && g < reach && g < la[c]) la[c] = g;
      }
    }
#pragma omp critical
    for (size_t e = 0; e < slack.size(); ++e) slack[e] = std::min(slack[e], local[e]);  // a min: any order
  }
  if (b_.comm.distributed()) {  // the minimum over the ranks, as a maximum of the negated values
    for (double& v : slack) v = -v;
    b_.comm.max(slack);
    for (double& v : slack) v = -v;
  }
  std::vector<double> exact;
  if (!auction::exact_prices(k, slack, p_, counts_, hi_, reach, exact)) return false;
  p_ = exact;
  return true;
}
}  // namespace auction
}  // namespace cluster_kernels
