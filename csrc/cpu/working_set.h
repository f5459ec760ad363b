// No CUDA counterpart: the device auction solves every row on each call.
// Warm floor auctions on a working set of the rows near a boundary, grown until the prices found certify the
// whole problem (working_set.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/auction_steps.h"

namespace cluster_kernels {
namespace auction {

// Below this many rows (all ranks), or below 3 clusters, the whole problem runs.
constexpr int64_t kWorkingSetMin = 4096;
// Nor does a working set run when the caps leave fewer than 1/kWorkingSetSlack of the rows free: with (nearly)
// exact balance every cluster is full, and the working set's problem takes about as many rounds as the whole one.
constexpr int64_t kWorkingSetSlack = 8;
// A working set that grows past 1/kWorkingSetMost of the rows costs about as much as the whole problem: the call
// solves the whole problem instead, and the next calls do so directly, 1, 2, 4, ... of them after each such call
// in a row (early Lloyd iterations move prices far; later ones, most of a run, little). The call after a cold
// start is one of them.
constexpr int64_t kWorkingSetMost = 4;
// The first working set: the rows with the smallest margins, 1/kWorkingSetFirst of them at least, and at least
// kWorkingSetGrow of the previous call's final set (most of that set was rows that joined).
constexpr int64_t kWorkingSetFirst = 32;
constexpr double kWorkingSetGrow = 0.625;
// A solve after more than 1/kWorkingSetRestart of the set joined starts again from p0; after fewer, from the last
// solve's prices with eps_warm / kWorkingSetCloseEps as its first eps.
constexpr int64_t kWorkingSetRestart = 10;
constexpr double kWorkingSetCloseEps = 8.0;

class WorkingSet {
 public:
  WorkingSet(const Block& b, const int64_t* hi, AuctionState& state, int32_t* obj, const AuctionParams& ap);  // working_set.cpp

  static bool applies(const Block& b, const int64_t* hi, AuctionState& state, const AuctionParams& ap);  // working_set.cpp

  int64_t run();  // working_set.cpp

  // The cost range of every row (checked), for the auctions and the general auction after them.
  const CostRange& range() const { return range_; }

 private:
  const Block& b_;
  const int64_t* hi_;
  AuctionState& state_;
  int32_t* obj_;
  const AuctionParams& ap_;
  CostRange range_;
  const std::vector<double> p0_;
  std::vector<int32_t> best_, second_;  // per row, its cheapest and second cheapest cluster at p0_
  std::vector<double> gap_, gap3_;      // their cost differences: second less cheapest, third less cheapest
  std::vector<char> in_;                // whether the row is in the working set
  std::vector<int64_t> rows_;           // the working set's rows, ascending

  int64_t whole();  // working_set.cpp

  void margins();  // working_set.cpp

  void first_set();  // working_set.cpp

  std::vector<int64_t> set_caps();  // working_set.cpp

  int64_t join_violators();  // working_set.cpp
};

}  // namespace auction
}  // namespace cluster_kernels
