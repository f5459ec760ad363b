// The floor auction: the capacity problem without lower bounds (size_j <= hi_j), on a block of cost rows. Its
// member functions live in one file per mechanism, named after each declaration: floor_auction.cpp (phases,
// forward rounds, re-bids), reverse_step.cpp (reverse steps and the candidates they keep), heaps.cpp (the
// per-cluster eviction heaps), certificate.cpp (the early end once the labels are provably optimal). The CUDA
// counterpart is cuda/floor_auction.cuh.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/auction_steps.h"
#include "cpu/second_cache.h"

namespace cluster_kernels {
namespace auction {

// Largest cost block (entries) of which the floor auction keeps a column-major copy for its reverse steps
// (2^24 entries: 128 MiB, e.g. n = 262 144 at k = 64); above it they read the rows, so a distributed rank of
// n = 500 000 rows and one process of 10^6 hold no second n x k float64 array. Results are the same either way.
constexpr int64_t kMaxColumnCopy = int64_t{1} << 24;
// Rows a reverse step's scan keeps for the next reverse steps of the same cluster (FloorAuction::KeptPull): at
// first kKeptPull (most pull a handful of points, and a few hundred rows cost little to re-read), doubled up to
// kKeptPullMost each time they did not suffice.
constexpr int64_t kKeptPull = 256;
constexpr int64_t kKeptPullMost = 4096;
// A reverse step re-reads the rows moved since its cluster's last scan while they are at most 1/kMovedReread of
// the rows; beyond, it scans again.
constexpr int64_t kMovedReread = 16;

// ------------------------------------------------------------------------------------------------
// The floor auction: the relaxed problem size_j <= hi_j (no lower bounds) in the "floor" form of the
// dual: prices are >= 0 and a cluster with a positive price must be exactly full. Forward rounds keep
// that true (members leave only by eviction, exactly the excess); each eps phase starts from the argmin
// and reverse steps. No dummy units, so slack capacity costs nothing: an arrival at a cluster with room
// is simply absorbed.
// ------------------------------------------------------------------------------------------------

class FloorAuction {
 public:
  FloorAuction(const Block& b, const int64_t* hi, AuctionState& state, int32_t* obj, const AuctionParams& ap,
               const CostRange& range, double eps_start = 0.0);  // floor_auction.cpp

  int64_t run();  // floor_auction.cpp

 private:
  bool settled() const;  // floor_auction.cpp

  const Block& b_;
  const int64_t* hi_;
  std::vector<double>& p_;
  int32_t* obj_;
  const AuctionParams& ap_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t slack_ = 0, rounds_ = 0;
  bool exact_ = false;  // after the last bid_all: every point (all ranks) at its exact argmin
  bool idle_ = false;   // after the last phase start: exact_ and no pull
  std::vector<int64_t> counts_;
  // own_[i]: the cost row(i)[obj_[i]] (without price), kept with obj_; cols_: the costs column-major (k, n),
  // made at the first reverse step (empty before, or when the block is above kMaxColumnCopy entries). A
  // reverse step then reads two contiguous arrays instead of two entries of every cost row.
  RawVector<double>& cols_;  // the caller's buffer (AuctionState::columns), valid once have_cols_
  AuctionStats& stats_;
  bool have_cols_ = false;
  std::vector<double> own_, gap_, regret_;
  std::vector<std::vector<int64_t>> members_;
  SecondCache second_;
  std::vector<int64_t> lowered_;  // clusters whose price a reverse step lowered since the last flush_lowered
  // Per cluster j, a min-heap of its members keyed by (sc - own) at the time the key was taken (sc: the
  // cheapest other cluster's cost with price). Within a phase prices only rise, so a stored key is a lower
  // bound of the member's key now, and its regret now, sc - (own + p_j), is at least key - p_j less rounding
  // (margin_). A forward round pops members until no unpopped one can be among the `excess` smallest regrets,
  // reads only those, and pushes back the ones that stay: O(excess) rows per round instead of every member of
  // every over-full cluster. Built the first time a cluster is over-full in a phase; dropped at phase starts
  // (reverse steps lower prices, which can lower keys).
  struct Entry {
    double key;
    int64_t row;
  };
  // The heaps' order, as a type (not a function pointer) so that the heap operations inline it.
  struct EntryAfter {
    bool operator()(const Entry& a, const Entry& b) const { return a.key > b.key || (a.key == b.key && a.row > b.row); }
  };
  static constexpr EntryAfter entry_after{};
  std::vector<std::vector<Entry>> heap_;
  std::vector<char> built_;
  std::vector<double> key_;  // a popped candidate's fresh key

  Three cheapest_three(int64_t i) const {
    const double* Di = row(i);
    return best_three(b_.k, [&](int64_t j) { return Di[j] + p_[j]; });
  }

  void set_price(int64_t j, double v) {
    second_.price(j, p_[j], v);
    p_[j] = v;
  }

  const double* row(int64_t i) const { return b_.row(i); }
  // Rows are read in data-dependent order (heap pops, member and eviction lists): asking for one a few steps
  // ahead overlaps its memory latency with the work on the current one.
  static constexpr size_t kPrefetchAhead = 4;
  void prefetch_row(int64_t i) const {
    const char* r = reinterpret_cast<const char*>(row(i));
    for (int64_t off = 0; off < b_.k * static_cast<int64_t>(sizeof(double)); off += 64) __builtin_prefetch(r + off);
  }

  const double* column(int64_t j);  // reverse_step.cpp

  void bid_all(bool only_violators);  // floor_auction.cpp

  void start(bool first);  // floor_auction.cpp

  void flush_lowered();  // reverse_step.cpp

  void pull(int64_t j);  // reverse_step.cpp

  // The reverse steps pull from the same few full clusters again and again (a chain of clusters with positive
  // prices passing points along until one with room takes them), each time a few points, and so do the next
  // phase starts. A row that kept its cluster o since a scan for j has its gap changed by exactly the change of
  // p_j less that of p_o; so every row the scan did not keep still has a gap of at least the scan's bound plus
  // the change of p_j less the largest rise of another price (within one phase start prices only drop: no rise).
  // The kept rows, plus the rows moved since (read again), then hold this rank's r smallest gaps as long as the
  // r-th of them lies below that bound. Same candidates, same selection: the labels and prices of a scan.
  struct KeptPull {
    std::vector<int64_t> rows;   // rows outside j at the scan (or moved since), the smallest gaps then
    double bound = kInf;         // every other row's gap at the scan, at least (kInf: there were no others)
    std::vector<double> prices;  // p_ at the scan
    size_t mark = 0;             // moved_.size() at the scan: rows moved after it are read again
    bool valid = false;
    int64_t keep = kKeptPull;    // rows the next scan keeps, at least; grows each time the kept ones did not suffice
  };
  std::vector<KeptPull> kept_;
  // Rows that changed cluster while some scan was kept (any_kept_), in order, repeats allowed: a scan's mark lies
  // past every move before it, so no one reads the moves made while none was kept.
  std::vector<int64_t> moved_;
  bool any_kept_ = false;
  std::vector<int64_t> seen_;   // per row, the last pull (pull_tick_) that took it as a candidate
  int64_t pull_tick_ = 0;

  void forget_pulls() {
    for (auto& c : kept_) c.valid = false;
    any_kept_ = false;
    moved_.clear();
  }

  void note_moved(const int64_t* rows, size_t count) {
    if (any_kept_) moved_.insert(moved_.end(), rows, rows + count);
  }

  template <class Gap>
  bool kept_candidates(int64_t j, int64_t r, Gap gap, std::vector<int64_t>& cand);  // reverse_step.cpp

  template <class Gap>
  void scan_candidates(int64_t j, int64_t r, Gap gap, std::vector<int64_t>& cand);  // reverse_step.cpp

  bool certified();  // certificate.cpp

  double rounding_margin() const;  // heaps.cpp

  // Row i's exact cheapest other cost sc (with prices) while it is in cluster j.
  double second_cost(int64_t i, int64_t j) {
    const double* Di = row(i);
    return second_.value(i, j, b_.k, [&](int64_t c) { return Di[c] + p_[c]; });
  }

  void build_heaps(const std::vector<int64_t>& over);  // heaps.cpp

  void candidates(int64_t j, int64_t t, double margin, std::vector<int64_t>& cand);  // heaps.cpp

  bool round();  // floor_auction.cpp

  void rebid(const std::vector<int64_t>& moved);  // floor_auction.cpp
};

}  // namespace auction
}  // namespace cluster_kernels
