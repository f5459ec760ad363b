// The eviction auction of capacity-constrained K-means (cluster_kernels/kmeans_reference.py, module docstring) on
// a float64 cost block, for one process or for one rank of many. The CUDA counterpart is cuda/auction.cuh.
//
// Every rank holds the cost rows of its own points, rows [offset, offset + n) of the global (n_total, k)
// matrix. Prices, counts, eps and dummy units are global: each rank computes them alike from the
// collectives below (all-reduced counts, the global cost span, selections by (value, global row)), so
// every rank takes the decisions one process takes on the whole matrix. Argmins, regrets, gaps and
// re-bids are local. With the default Collective (one process) nothing is exchanged and this is the
// auction of capacity_kmeans_cpu.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"

namespace cluster_kernels {

// What the auction needs from the other ranks. The default is one process: every call is the identity
// (and select, which the auction then never calls, answers from the local candidates alone).
class Collective {
 public:
  virtual ~Collective() = default;
  // Whether other ranks take part (false: the auction makes no call below).
  virtual bool distributed() const { return false; }
  // In-place all-reduce (sum) of v over the ranks.
  virtual void sum(std::vector<int64_t>& v) { (void)v; }
  // In-place all-reduce (max) of v over the ranks.
  virtual void max(std::vector<double>& v) { (void)v; }
  // Per group g in [0, G), the t[g]-th smallest key (val, gid) over all ranks, or (inf, INT64_MAX) when
  // fewer exist. Entry e of this rank's candidates belongs to group grp[e]; a rank passes at most its
  // t[g] smallest keys per group (the others cannot be the answer). t[g] >= 1; gids are unique.
  virtual void select(const std::vector<int64_t>& grp, const std::vector<double>& val,
                      const std::vector<int64_t>& gid, const std::vector<int64_t>& t, std::vector<double>& tv,
                      std::vector<int64_t>& tg);
};

// The block of the global problem this process holds: rows [offset, offset + n) of n_total.
struct RowBlock {
  int64_t offset = 0;
  int64_t n_total = 0;
};

// Optimal assignment of n points with costs dist (n x k, row-major, float64) to k clusters with
// lo[j] <= size_j <= hi[j]. The problem without lower bounds is solved first (floor auction); if
// its solution meets them it is optimal, otherwise the general (dummy) auction runs. Returns the
// number of auction rounds.
int64_t auction_assign(const double* dist, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap = AuctionParams());

// auction_assign on this rank's rows dist (n, k) of the global problem `rows`; lo/hi are the
// global bounds. Every rank must call it with the same lo, hi, state and parameters. Returns the rounds.
int64_t auction_assign(const double* dist, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap, Collective& comm,
                       const RowBlock& rows);

}  // namespace cluster_kernels
