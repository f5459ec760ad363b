// The centroid update of the CPU Lloyd loop (centroids.cpp): per-chunk cluster sums in a fixed order, the means,
// and the re-seeding of empty clusters. The CUDA counterpart is cuda/centroids.cuh.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/raw_vector.h"
#include "cpu/prepare.h"
#include "cpu/reductions.h"

namespace cluster_kernels {

// Per-cluster sums and counts of rows in chunks of chunk_rows(n) rows (a split fixed by n, never by the thread
// count): chunk c's partial sums are part[(c * k + j) * d + t], its counts count[c * k + j]; each is a
// sequential sum in row order, and the chunks are added in order (centroids_from_sums), so the centroids do
// not depend on the number of threads or on whether the sums were taken with the assignment or after it.
struct ClusterSums {
  int64_t cs = 0, nc = 0, k = 0, d = 0;
  RawVector<double> part;  // every chunk is cleared before it is summed
  std::vector<int64_t> count;

  ClusterSums(int64_t n, int64_t k_, int64_t d_) : cs(chunk_rows(n)), nc((n + cs - 1) / cs), k(k_), d(d_) {
    part.resize(static_cast<size_t>(nc) * k * d);
    count.resize(static_cast<size_t>(nc) * k);
  }
  double* chunk_sums(int64_t c) { return part.data() + c * k * d; }
  int64_t* chunk_counts(int64_t c) { return count.data() + c * k; }
  void clear_chunk(int64_t c) {
    std::fill(chunk_sums(c), chunk_sums(c) + k * d, 0.0);
    std::fill(chunk_counts(c), chunk_counts(c) + k, int64_t{0});
  }
  // The next `m` rows of chunk c (prepared, row-major) with their labels added to its sums, in row order.
  template <typename T>
  void add(const T* rows, const int64_t* labels, int64_t c, int64_t m) {
    double* acc = chunk_sums(c);
    int64_t* cnt = chunk_counts(c);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t j = labels[i];
      ++cnt[j];
      const T* xi = rows + i * d;
      double* aj = acc + j * d;
      for (int64_t t = 0; t < d; ++t) aj[t] += static_cast<double>(xi[t]);
    }
  }
};

// The sums of every chunk of rows by their labels (the centroid update's pass over x, when the assignment did not
// take them).
template <typename T>
void sum_clusters(const Prepared<T>& p, int64_t n, const std::vector<int64_t>& labels, ClusterSums& sums);

// Cluster means from the chunk sums (chunks added in order) into cent; empty clusters re-seeded at the point
// farthest from its own centroid among clusters of size > 1 (own_in: each point's distance), as the reference does.
template <typename T>
void centroids_from_sums(const Prepared<T>& p, int64_t n, const ClusterSums& s, const std::vector<int64_t>& labels,
                         const std::vector<double>& own_in, bool spherical, std::vector<double>& cent);

}  // namespace cluster_kernels
