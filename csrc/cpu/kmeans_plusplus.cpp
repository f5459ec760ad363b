// Greedy k-means++ of the CPU K-means (kmeans_plusplus.h). The CUDA counterpart is cuda/kmeans_plusplus.cu.
#include "cpu/kmeans_plusplus.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "cpu/distance_tiles.h"
#include "cpu/reductions.h"

namespace cluster_kernels {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Squared distance of every row of x to one row `r` of x (for k-means++).
template <typename T>
void dist_to_row(const Prepared<T>& p, int64_t n, int64_t r, std::vector<double>& out) {
  std::vector<T> buf(p.buffer(1));
  sqdist(p, n, p.row(r, buf.data()), p.xnorm.data() + r, 1, out.data(), nullptr);
}

}  // namespace


template <typename T>
std::vector<double> kmeans_plusplus(const Prepared<T>& p, int64_t n, int64_t k, SplitMix64& rng, const Blas* blas) {
  const int64_t d = p.d;
  const int trials = 2 + static_cast<int>(std::log(static_cast<double>(k)));
  std::vector<double> centers(static_cast<size_t>(k) * d);
  std::vector<T> buf(p.buffer(1));
  auto put = [&](int64_t j, int64_t row) {
    const T* r = p.row(row, buf.data());
    for (int64_t t = 0; t < d; ++t) centers[j * d + t] = static_cast<double>(r[t]);
  };
  const int64_t first = std::min<int64_t>(static_cast<int64_t>(rng.uniform() * static_cast<double>(n)), n - 1);
  put(0, first);
  std::vector<double> closest(n), cand_d(static_cast<size_t>(n) * trials), best_d(n), cum(n);
  std::vector<T> cand_rows(static_cast<size_t>(trials) * d);
  std::vector<double> cand_norm(trials);
  dist_to_row(p, n, first, closest);
  for (int64_t j = 1; j < k; ++j) {
    double run = 0.0;
    for (int64_t i = 0; i < n; ++i) cum[i] = (run += closest[i]);
    const double total = cum[n - 1];
    std::vector<int64_t> cands(trials);
    for (int t = 0; t < trials; ++t) {
      const double r = rng.uniform() * total;
      const int64_t idx = std::upper_bound(cum.begin(), cum.end(), r) - cum.begin();
      cands[t] = std::min(idx, n - 1);
    }
    // All candidates in one pass over the data (the tiled kernel), then their potentials.
    for (int t = 0; t < trials; ++t) {
      const T* r = p.row(cands[t], buf.data());
      std::copy(r, r + d, cand_rows.begin() + t * d);
      cand_norm[t] = p.xnorm[cands[t]];
    }
    sqdist(p, n, cand_rows.data(), cand_norm.data(), trials, cand_d.data(), blas);
    double best_pot = kInf;
    int best_t = -1;
    for (int t = 0; t < trials; ++t) {
      const double pot = chunked_sum(n, [&](int64_t i) { return std::min(closest[i], cand_d[i * trials + t]); });
      if (pot < best_pot) {
        best_pot = pot;
        best_t = t;
      }
    }
    // No finite potential (distances overflowed): there is no candidate to index.
    if (best_t < 0) throw std::invalid_argument("capacity_kmeans: k-means++ found no finite potential (x out of range)");
    const int64_t best_c = cands[best_t];
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) best_d[i] = std::min(closest[i], cand_d[i * trials + best_t]);
    put(j, best_c);
    closest.swap(best_d);
  }
  return centers;
}

template std::vector<double> kmeans_plusplus<float>(const Prepared<float>&, int64_t, int64_t, SplitMix64&,
                                                    const Blas*);
template std::vector<double> kmeans_plusplus<double>(const Prepared<double>&, int64_t, int64_t, SplitMix64&,
                                                     const Blas*);

}  // namespace cluster_kernels
