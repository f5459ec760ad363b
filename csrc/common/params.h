// The parameter, state and result types the CPU (csrc/cpu) and CUDA (csrc/cuda) K-means and auctions share, and
// the splitmix64 stream of their k-means++ draws (the one of cluster_kernels/kmeans_reference.py).
#pragma once

#include <cstdint>
#include <vector>

#include "common/raw_vector.h"

namespace cluster_kernels {

struct Blas;  // cpu/blas.h: the CPU distance tiles' GEMM (the CUDA path ignores it)

// Auction constants: fractions of the cost range (mirrors EPS_* in cluster_kernels/kmeans.py).
struct AuctionParams {
  double eps_start = 0.1;    // cold-start eps
  double eps_warm = 1e-2;    // eps when prices are warm-started from the previous Lloyd iteration
  double eps_final = 1e-10;  // last phase's eps (float64 costs)
  double eps_shrink = 8.0;   // eps divisor per phase
  double eps_certify = 1e-4; // from this eps on, the floor auction checks after each phase whether its labels are
                             // already optimal (common/certificate.h, exact_prices) and then ends
  int64_t max_rounds = 1000000;  // safety net; reaching it is an internal error
  bool force_general = false;    // tests: skip the floor auction and run the general one
  bool working_set = true;       // warm starts solve on a working set (cpu/working_set.h); false: every row
};

struct KMeansParams {
  int64_t k = 8;          // number of clusters
  bool spherical = false; // metric="cosine": unit rows, renormalised centroids
  int n_init = 3;         // k-means++ restarts (ignored when initial centroids are given)
  int max_iter = 100;     // Lloyd iterations per restart
  double tol = 1e-4;      // relative objective decrease below which a restart stops
  uint64_t seed = 0;      // splitmix64 seed
  int n_threads = 0;      // OpenMP threads (0: the OpenMP default)
  const Blas* blas = nullptr;  // distance tiles through this BLAS (null: the portable tile loop)
};

// Wall seconds per phase of the CPU capacity_kmeans, summed over restarts and Lloyd iterations.
struct PhaseTimes {
  double prepare = 0.0;    // checks, row norms, the centred (or unit-row) copy when one is made
  double init = 0.0;       // k-means++
  double distance = 0.0;   // distance tiles (and, without capacities, the fused argmin and cluster sums)
  double auction = 0.0;    // the capacity auction (its argmin included)
  double objective = 0.0;  // objective of the new and the previous labels, own distances
  double update = 0.0;     // centroid update (with capacities: also its pass summing the rows)
  double finish = 0.0;     // exact own distances of the final labels
};

// What the floor auction did, summed over calls (benchmarks and tests read it; no result depends on it).
struct AuctionStats {
  int64_t pulls = 0;       // reverse steps
  int64_t pull_scans = 0;  // reverse steps that read every row (the others re-read the rows kept by an earlier one)
  int64_t working_calls = 0;   // warm calls that started on a working set
  int64_t working_solves = 0;  // floor auctions those ran on a working set (one per growth of the set)
  int64_t working_whole = 0;   // of those calls, the ones that ended on the whole problem (the set grew too large)
  int64_t working_rows = 0;    // final working-set rows, summed over the calls that ended on one
};

// The result of one K-means call, CPU and CUDA alike. The CUDA path writes labels, centroids and distances to the
// caller's device buffers and leaves those three vectors (and `auction`, `seconds`) empty.
struct KMeansResult {
  std::vector<int64_t> labels;      // (n,)
  std::vector<double> centroids;    // (k, d), in the caller's frame (mean added back)
  std::vector<double> distances;    // (n,) squared distance to own centroid (cosine: 1 - cos)
  double inertia = 0.0;
  std::vector<double> history;      // objective after each assignment step (cosine: halved)
  int n_iter = 0;
  bool converged = false;
  int64_t auction_rounds = 0;       // total over the best restart
  AuctionStats auction;             // the best restart's
  PhaseTimes seconds;               // over all restarts
};

// Dual prices kept between calls for warm starts (empty: cold start).
struct AuctionState {
  std::vector<double> floor_prices;    // the relaxed problem (upper bounds only), one per cluster
  std::vector<double> general_prices;  // the general problem, one per object (mandatory/optional part)
  bool used_general = false;           // whether the last call needed the general auction
  // Scratch of the floor auction (its column-major copy of the costs), kept between calls so that a Lloyd loop
  // faults its pages in once, not on every iteration; a RawVector, so those pages are huge pages and resize()
  // leaves them unwritten (the copy writes them all).
  RawVector<double> columns;
  AuctionStats stats;
  // The working set of warm calls (cpu/working_set.h): the last call's final size (all ranks; 0: none), the
  // next one's first; and, after calls whose set grew too large, the calls left to solve whole and the next pause.
  struct Working {
    int64_t rows = 0, skip = 0, pause = 0;
  } working;
};

// The splitmix64 stream shared with the Python reference and the CUDA path.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
};

inline uint64_t run_seed(uint64_t seed, uint64_t run) {
  return seed * 0x100000001B3ULL + run * 0x9E3779B97F4A7C15ULL + 1ULL;
}

}  // namespace cluster_kernels
