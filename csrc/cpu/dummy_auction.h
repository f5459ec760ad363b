// The general auction: lo_j <= size_j <= hi_j with mandatory/optional objects and dummy units (dummy_auction.cpp).
// The CUDA counterpart is cuda/dummy_auction.cuh.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/auction_steps.h"
#include "cpu/second_cache.h"

namespace cluster_kernels {
namespace auction {

// ------------------------------------------------------------------------------------------------
// The general problem lo_j <= size_j <= hi_j: each cluster is split into a mandatory object (lo slots,
// real points only) and an optional one (hi - lo slots), and sum(hi) - n zero-cost dummy units fill the
// optional slots that real points leave free, so every object ends exactly full. A plain forward auction
// then applies; it is slower than the floor form when there is slack (the dummies trade places in eps
// steps), so it only runs when the lower bounds bind.
// ------------------------------------------------------------------------------------------------

class DummyAuction {
 public:
  DummyAuction(const Block& b, const int64_t* lo, const int64_t* hi, std::vector<double>& prices,
               const AuctionParams& ap, const CostRange& range);  // dummy_auction.cpp

  int64_t run(int64_t* labels);  // dummy_auction.cpp

 private:
  // One object over capacity in this round.
  struct Over {
    int64_t o, excess;
    double rho;            // price step at which a dummy leaves for the cheapest other dummy object
    bool scan;             // whether real members may leave (their regrets are needed)
    int64_t n_real = 0, n_dum = 0;
    double last = -kInf;   // the price rise less eps: the last evicted unit's regret
    double rest = kInf;    // smallest regret among the local real members that stay
  };

  const Block& b_;
  const Objects ob_;
  const int64_t m_;
  bool exact_ = false;  // after the last phase start: every unit (all ranks) at its exact cheapest object
  std::vector<double>& p_;
  const AuctionParams& ap_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t rounds_ = 0;
  std::vector<int32_t> obj_;
  std::vector<int64_t> real_, dummies_;
  // lb_[o]: lower bound on the smallest regret among o's real members (all ranks). It lets a round that
  // only evicts dummies skip the O(members * m) regret scan: rising prices elsewhere only raise regrets, a
  // raise of o's own price lowers them all by the same amount, and arrivals report theirs.
  std::vector<double> own_, lb_, regret_;  // own_[i]: unit i's cost entry D[i, cluster(obj_[i])], kept with obj_
  std::vector<std::vector<int64_t>> members_;
  SecondCache second_;

  double cost(int64_t i, int64_t o) const { return b_.row(i)[ob_.cluster[o]] + p_[o]; }
  void set_own(int64_t i) { own_[i] = b_.row(i)[ob_.cluster[obj_[i]]]; }

  Three cheapest_three(int64_t i) const {
    return best_three(m_, [&](int64_t o) { return cost(i, o); });
  }

  bool dummies_exact() const;  // dummy_auction.cpp

  bool settled() const;  // dummy_auction.cpp

  std::vector<Over> over_objects();  // dummy_auction.cpp

  void scan(const std::vector<Over>& over);  // dummy_auction.cpp

  void split_evictions(std::vector<Over>& over);  // dummy_auction.cpp

  bool round();  // dummy_auction.cpp

  void rebid(const std::vector<int64_t>& moved, std::vector<double>& lb);  // dummy_auction.cpp

  void next_phase();  // dummy_auction.cpp
};

}  // namespace auction
}  // namespace cluster_kernels
