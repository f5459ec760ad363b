// The general auction on the device (dummy_auction.cu): mandatory/optional objects per cluster, dummy units in the
// free optional slots. The CPU counterpart is cpu/dummy_auction.h.
#pragma once

#include <cstdint>
#include <vector>

#include "common/auction_objects.h"
#include "common/params.h"
#include "cuda/auction_steps.cuh"

namespace cluster_kernels {
namespace cuda {

class DummyAuction {
 public:
  DummyAuction(AuctionGpu& a, const int64_t* lo, const int64_t* hi, std::vector<double>& prices,
               const AuctionParams& ap);  // dummy_auction.cu

  int64_t run(int* labels);  // dummy_auction.cu

 private:
  // One object over capacity in this round.
  struct Over {
    int64_t o, excess;
    double rho;  // price step at which a dummy leaves for the cheapest other dummy object
    int64_t n_real = 0, n_dum = 0;
    double price = 0.0, lb = 0.0;  // the object's price and regret bound after the round
  };

  AuctionGpu& a_;
  const Objects ob_;
  const int64_t m_;
  std::vector<double>& p_;
  const AuctionParams& ap_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t rounds_ = 0;
  std::vector<int64_t> real_, dummies_;
  std::vector<int> slot_;
  // lb_[o]: lower bound on the smallest regret among o's real members (see auction.cpp).
  std::vector<double> lb_;
  std::vector<SegmentOut> res_;
  std::vector<double> arrival_min_;

  std::vector<Over> over_objects(bool* any_scan);  // dummy_auction.cu

  std::vector<SegmentIn> segments(const std::vector<Over>& over) const;  // dummy_auction.cu

  void decide(std::vector<Over>& over) const;  // dummy_auction.cu

  bool round();  // dummy_auction.cu

  void rebid(const std::vector<Over>& over, const std::vector<SegmentIn>& seg, int64_t members);  // dummy_auction.cu

  void next_phase();  // dummy_auction.cu
};

}  // namespace cuda
}  // namespace cluster_kernels
