// The device steps of the eviction auction (auction_steps.cu; the reverse step: reverse_step.cu; the certificate:
// certificate.cu), the CPU's auction_steps.h on the GPU. AuctionGpu owns the device buffers
// for one problem size and the device steps both auctions take (argmins, phase starts, regrets and the
// selection of the members that leave, re-bids, reverse steps); per-object state (counts, prices, dummy
// units, regret bounds) stays on the host exactly as in the CPU code and is copied over when a kernel
// needs it (K is small). Every comparison and price update of the CPU code is repeated, so on the same
// cost matrix the labels are those of auction_assign.
#pragma once

#include <cstdint>
#include <vector>

#include "common/auction_objects.h"
#include "common/params.h"
#include "cuda/auction_objects.cuh"
#include "cuda/device_utils.cuh"

namespace cluster_kernels {
namespace cuda {

// The host-side auction pieces of common/auction_objects.h, as the CPU code (namespace auction) names them.
using auction::cheapest_dummy_object;
using auction::EpsSchedule;
using auction::free_places;
using auction::gather_dummies;
using auction::Objects;

class AuctionGpu {
 public:
  AuctionGpu(Ctx& ctx, int64_t n, int64_t k);

  // auction_assign of cpu/auction.cpp on the device cost matrix D (n, k); labels: device int32 (n) (auction.cu).
  int64_t assign(const double* D, const int64_t* lo, const int64_t* hi, AuctionState& state, int* labels,
                 const AuctionParams& ap);

  // ---- The device steps of FloorAuction and DummyAuction, on the current cost matrix.
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  // The auction's objects: one per cluster (floor auction), or the general auction's objects.
  void use_clusters();
  void use_objects(const auction::Objects& ob);
  // eps schedule from the largest per-point cost range (computed once per cost matrix) and the prices.
  auction::EpsSchedule eps_schedule(const std::vector<double>& prices, bool warm, const AuctionParams& ap);
  void upload_prices(const std::vector<double>& prices);
  // Every point takes its cheapest object at the device prices.
  void argmin_all();
  // Phase start: points more than eps above their cheapest object move to it.
  void phase(double eps);
  // Points per object.
  std::vector<int64_t> object_counts();
  // Members of the objects with slot[o] = s >= 0 sorted by (s, regret, index), and the eviction decision of
  // every scanned segment; returns the number of members sorted. The device prices must be the current ones.
  int64_t select(const std::vector<int>& slot, const std::vector<SegmentIn>& seg, std::vector<SegmentOut>& res);
  // The first take[s] members of every segment re-bid at the device prices (already the new ones). Returns
  // the arrivals per object; arrival_min (optional) gets the smallest arrival regret per object.
  std::vector<int64_t> rebid(const std::vector<SegmentIn>& seg, const std::vector<int64_t>& take, int64_t members,
                             std::vector<double>* arrival_min);
  // Reverse step of cluster j (floor auction): the gaps of every point to j in (gap, index) order; writes the
  // r-th smallest gap and how many points move (all r, or those preferring j by more than eps when the
  // price stops at 0).
  void pull_candidates(int j, int64_t r, double price, double eps, double* last, int64_t* pulled);
  // Moves the first `pulled` points of the last pull_candidates to cluster j; returns how many left each object.
  std::vector<int64_t> move_to(int j, int64_t pulled);
  // labels[i] = cluster of point i's object.
  void write_labels(int* labels);
  // The floor auction's certificate: per pair (own cluster a, other cluster b), a * k + b, the smallest reduced
  // cost difference at the device prices below `reach` (+inf where none); the objects must be the clusters.
  std::vector<double> reduced_slack(double reach);

 private:
  Ctx& ctx_;
  int64_t n_, k_;
  size_t mcap_;
  DevArray<int> obj_, iota_, sel_idx_, sidx1_, sidx2_, moved_;
  DevArray<double> reg_, sel_key_, skey_;
  DevArray<unsigned char> flag_;
  DevArray<unsigned> sslot_, sslot2_;
  DevArray<int> cl_id_, cl_obj_, slot_;
  DevArray<double> prices_, arr_min_;
  DevArray<unsigned long long> hist_, span_;
  DevArray<SegmentIn> seg_in_;
  DevArray<SegmentOut> seg_out_;
  DevArray<int64_t> seg_off_, take_, nsel_;
  DevArray<double> pull_last_;
  DevArray<int64_t> pull_cnt_;
  DevArray<unsigned long long> slack_;  // (k, k) ordered keys of reduced_slack

  const double* D_ = nullptr;  // the cost matrix of the current assign()
  const int* cl_ = nullptr;    // cluster of each object of the current auction
  int m_ = 0;                  // objects of the current auction
  const int* sorted_idx_ = nullptr;
  const unsigned* sorted_slot_ = nullptr;
  bool span_known_ = false;
  double span_raw_ = 0.0, amax_ = 0.0;

  void sort_members(int64_t members, int nover);
};

}  // namespace cuda
}  // namespace cluster_kernels
