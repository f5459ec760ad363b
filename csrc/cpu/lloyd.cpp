// The Lloyd loop of the CPU K-means: restarts, assignment steps (the argmin without capacities, else the auction
// of auction.h on the cost matrix), centroid updates and the final exact distances; the entry points of kmeans.h.
// The CUDA counterpart is cuda/lloyd.cu.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/raw_vector.h"
#include "cpu/auction.h"
#include "cpu/centroids.h"
#include "cpu/distance_tiles.h"
#include "cpu/kmeans.h"
#include "cpu/kmeans_plusplus.h"
#include "cpu/prepare.h"
#include "cpu/reductions.h"
#include "cpu/thread_scope.h"

namespace cluster_kernels {

bool openmp_enabled() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

int openmp_max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Seconds since the last lap (or construction).
class Stopwatch {
 public:
  double lap() {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return s;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// The centroids in T (the distance tiles' type) and their squared norms.
template <typename T>
void to_T(const std::vector<double>& c, int64_t k, int64_t d, std::vector<T>& ct, std::vector<double>& cn) {
  ct.resize(static_cast<size_t>(k) * d);
  cn.resize(k);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < d; ++t) ct[j * d + t] = static_cast<T>(c[j * d + t]);
    cn[j] = row_sqnorm(ct.data() + j * d, d);
  }
}

// Exact |x_i - c_{label_i}|^2 of the prepared rows into own; their chunked sum.
template <typename T>
double exact_own_distances(const Prepared<T>& p, int64_t n, int64_t d, const std::vector<double>& cent,
                           const std::vector<int64_t>& labels, std::vector<double>& own) {
  own.resize(n);
#pragma omp parallel
  {
    std::vector<T> buf(p.buffer(1));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = p.row(i, buf.data());
      const double* c = cent.data() + labels[i] * d;
      own[i] = lane_sum(d, [xi, c](int64_t t) {
        const double diff = static_cast<double>(xi[t]) - c[t];
        return diff * diff;
      });
    }
  }
  return chunked_sum(n, [&](int64_t i) { return own[i]; });
}

// One assignment step of the Lloyd loop: the problem, and the buffers reused across iterations.
template <typename T>
struct LloydStep {
  const Prepared<T>& prep;
  int64_t n, d, k;
  const int64_t *lo, *hi;
  const Blas* blas;
  bool unconstrained;         // no bound can bind: the assignment is the argmin, no n x k matrix is kept
  bool summed = false;        // after assign: `sums` holds the kept labels' cluster sums (taken with the argmin)
  ClusterSums sums;
  RawVector<double> dist;     // (n, k) costs for the auction (empty when unconstrained)
  std::vector<double> own_prev;
  std::vector<T> ct;
  std::vector<double> cn;
  PhaseTimes& ph;
  Stopwatch& watch;

  LloydStep(const Prepared<T>& p, int64_t n_, int64_t d_, int64_t k_, const int64_t* lo_, const int64_t* hi_,
       const Blas* b, PhaseTimes& ph_, Stopwatch& w)
      : prep(p), n(n_), d(d_), k(k_), lo(lo_), hi(hi_), blas(b), unconstrained(true), sums(n_, k_, d_),
        own_prev(n_), ph(ph_), watch(w) {
    for (int64_t j = 0; j < k; ++j) unconstrained = unconstrained && lo[j] <= 0 && hi[j] >= n;
    if (!unconstrained) dist.resize(static_cast<size_t>(n) * k);
  }

  // New labels for the centroids `cent` and their distances `own`: the optimal assignment, unless the previous
  // labels `labels` (empty at first) cost less. Returns the objective of the labels kept.
  double assign(const std::vector<double>& cent, AuctionState& prices, std::vector<int64_t>& labels,
                std::vector<int64_t>& new_labels, std::vector<double>& own, int64_t& rounds) {
    to_T(cent, k, d, ct, cn);
    const int64_t* prev = labels.empty() ? nullptr : labels.data();
    summed = false;
    if (unconstrained) {
      nearest(prep, n, ct.data(), cn.data(), k, blas, prev, new_labels.data(), own.data(), own_prev.data(), &sums);
      summed = true;
      ph.distance += watch.lap();
    } else {
      sqdist(prep, n, ct.data(), cn.data(), k, dist.data(), blas);
      ph.distance += watch.lap();
      rounds += auction_assign(dist.data(), n, k, lo, hi, prices, new_labels.data());
      ph.auction += watch.lap();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        own[i] = dist[i * k + new_labels[i]];
        if (prev) own_prev[i] = dist[i * k + prev[i]];
      }
    }
    double cost = chunked_sum(n, [&](int64_t i) { return own[i]; });
    if (prev) {
      const double before = chunked_sum(n, [&](int64_t i) { return own_prev[i]; });
      if (cost > before) {
        summed = false;  // the sums are the rejected labels'
        new_labels = labels;
        own.swap(own_prev);
        cost = before;
      }
    }
    ph.objective += watch.lap();
    return cost;
  }
};

// One restart's outcome.
struct LloydRun {
  std::vector<int64_t> labels;
  std::vector<double> cent, history;
  int n_iter = 0;
  bool converged = false;
  int64_t rounds = 0;
  AuctionStats auction;
};

// The Lloyd loop of one restart from the centroids `cent` (prepared frame).
template <typename T>
LloydRun lloyd(LloydStep<T>& step, std::vector<double> cent, const KMeansParams& p) {
  LloydRun r;
  AuctionState prices;
  std::vector<int64_t> new_labels(step.n);
  std::vector<double> own(step.n);
  for (r.n_iter = 1; r.n_iter <= p.max_iter; ++r.n_iter) {
    const double cost = step.assign(cent, prices, r.labels, new_labels, own, r.rounds);
    const bool same = !r.labels.empty() && new_labels == r.labels;
    const double improved = r.history.empty() ? kInf : r.history.back() - cost;
    const double ref = r.history.empty() ? cost : r.history.back();
    r.labels = new_labels;
    r.history.push_back(cost);
    if (!step.summed) sum_clusters(step.prep, step.n, r.labels, step.sums);
    centroids_from_sums(step.prep, step.n, step.sums, r.labels, own, p.spherical, cent);
    step.ph.update += step.watch.lap();
    if (same || improved <= p.tol * std::fabs(ref)) {
      r.converged = true;
      break;
    }
  }
  if (r.n_iter > p.max_iter) r.n_iter = p.max_iter;
  r.cent = std::move(cent);
  r.auction = prices.stats;
  return r;
}

// Initial centroids of restart `run` in the prepared frame: `init` centred, or k-means++.
template <typename T>
std::vector<double> start_centroids(const Prepared<T>& prep, int64_t n, int64_t d, const T* init, int run,
                                    const KMeansParams& p) {
  const int64_t k = p.k;
  std::vector<double> cent;
  if (init) {
    cent.resize(static_cast<size_t>(k) * d);
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(init[j * d + t]) - prep.mean[t];
  } else {
    SplitMix64 rng(run_seed(p.seed, static_cast<uint64_t>(run)));
    cent = kmeans_plusplus(prep, n, k, rng, p.blas);
  }
  if (p.spherical) normalise_rows(cent, k, d);
  check_range<T>("capacity_kmeans", "init", max_abs(cent));
  return cent;
}

// The best restart in the caller's frame: distances, inertia and history scaled (cosine: halved), centroids
// uncentred.
void finish(KMeansResult& best, double best_final, const std::vector<double>& best_cent,
            const std::vector<double>& mean, int64_t k, int64_t d, bool spherical) {
  // Every restart's objective was NaN: nothing to return (best_cent is empty).
  if (best_cent.empty()) throw std::invalid_argument("capacity_kmeans: no finite objective (x out of range)");
  const double scale = spherical ? 0.5 : 1.0;  // |a - b|^2 = 2 (1 - cos) for unit vectors
  best.inertia = best_final * scale;
  for (double& v : best.distances) v *= scale;
  for (double& v : best.history) v *= scale;
  best.centroids.resize(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) best.centroids[j * d + t] = best_cent[j * d + t] + mean[t];
}

}  // namespace

template <typename T>
KMeansResult capacity_kmeans(const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi, const T* init,
                             const KMeansParams& p) {
  ThreadScope threads(p.n_threads);
  Stopwatch watch;
  PhaseTimes ph;
  const int64_t k = p.k;
  if (init) check_finite("capacity_kmeans", "init", init, k, d);
  Prepared<T> prep = prepare("capacity_kmeans", x, n, d, p.spherical);
  ph.prepare += watch.lap();
  LloydStep<T> step(prep, n, d, k, lo, hi, p.blas, ph, watch);
  KMeansResult best;
  double best_final = kInf;
  std::vector<double> best_cent;
  const int runs = init ? 1 : p.n_init;
  for (int run = 0; run < runs; ++run) {
    std::vector<double> cent = start_centroids(prep, n, d, init, run, p);
    ph.init += watch.lap();
    LloydRun r = lloyd(step, std::move(cent), p);
    std::vector<double> exact;
    const double final_cost = exact_own_distances(prep, n, d, r.cent, r.labels, exact);
    ph.finish += watch.lap();
    if (final_cost < best_final) {
      best_final = final_cost;
      best.labels = std::move(r.labels);
      best.distances = std::move(exact);
      best.history = std::move(r.history);
      best.n_iter = r.n_iter;
      best.converged = r.converged;
      best.auction_rounds = r.rounds;
      best.auction = r.auction;
      best_cent = std::move(r.cent);
    }
  }
  finish(best, best_final, best_cent, prep.mean, k, d, p.spherical);
  best.seconds = ph;
  return best;
}

template <typename T>
void assign_with_capacity(const T* x, int64_t n, int64_t d, const T* centroids, int64_t k, const int64_t* lo,
                          const int64_t* hi, bool spherical, int n_threads, int64_t* labels, double* distances,
                          const Blas* blas) {
  ThreadScope threads(n_threads);
  check_finite("assign_with_capacity", "centroids", centroids, k, d);
  Prepared<T> prep = prepare("assign_with_capacity", x, n, d, spherical);
  std::vector<double> cent(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(centroids[j * d + t]) - prep.mean[t];
  if (spherical) normalise_rows(cent, k, d);
  check_range<T>("assign_with_capacity", "centroids", max_abs(cent));
  std::vector<T> ct;
  std::vector<double> cn;
  to_T(cent, k, d, ct, cn);
  RawVector<double> dist(static_cast<size_t>(n) * k);
  sqdist(prep, n, ct.data(), cn.data(), k, dist.data(), blas);
  AuctionState prices;
  auction_assign(dist.data(), n, k, lo, hi, prices, labels);
  std::vector<int64_t> lab(labels, labels + n);
  std::vector<double> own;
  exact_own_distances(prep, n, d, cent, lab, own);
  const double scale = spherical ? 0.5 : 1.0;
  for (int64_t i = 0; i < n; ++i) distances[i] = own[i] * scale;
}

template KMeansResult capacity_kmeans<float>(const float*, int64_t, int64_t, const int64_t*, const int64_t*,
                                             const float*, const KMeansParams&);
template KMeansResult capacity_kmeans<double>(const double*, int64_t, int64_t, const int64_t*, const int64_t*,
                                              const double*, const KMeansParams&);
template void assign_with_capacity<float>(const float*, int64_t, int64_t, const float*, int64_t, const int64_t*,
                                          const int64_t*, bool, int, int64_t*, double*, const Blas*);
template void assign_with_capacity<double>(const double*, int64_t, int64_t, const double*, int64_t, const int64_t*,
                                           const int64_t*, bool, int, int64_t*, double*, const Blas*);

}  // namespace cluster_kernels
