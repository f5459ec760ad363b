// The floor auction on the device (floor_auction.cu; its reverse step: reverse_step.cu; its certificate:
// certificate.cu): upper bounds only; the result is left in the auction's objects (one per cluster). The CPU
// counterpart is cpu/floor_auction.h.
#pragma once

#include <cstdint>
#include <vector>

#include "common/auction_objects.h"
#include "common/params.h"
#include "cuda/auction_steps.cuh"

namespace cluster_kernels {
namespace cuda {

class FloorAuction {
 public:
  FloorAuction(AuctionGpu& a, const int64_t* hi, std::vector<double>& prices, const AuctionParams& ap);  // floor_auction.cu

  int64_t run();  // floor_auction.cu

 private:
  bool certified();  // certificate.cu

  bool at_free_argmin() const;  // floor_auction.cu

  AuctionGpu& a_;
  const int64_t* hi_;
  std::vector<double>& p_;
  const AuctionParams& ap_;
  const int64_t k_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t slack_ = 0, rounds_ = 0;
  std::vector<int64_t> counts_;
  std::vector<int> slot_;
  std::vector<SegmentOut> res_;

  void argmin_recount();  // floor_auction.cu

  void start(bool first);  // floor_auction.cu

  void pull(int64_t j);  // reverse_step.cu

  bool round();  // floor_auction.cu
};

}  // namespace cuda
}  // namespace cluster_kernels
