// The centroid update of the CPU Lloyd loop (centroids.h). The CUDA counterpart is cuda/centroids.cu.
#include "cpu/centroids.h"

#include <stdexcept>

namespace cluster_kernels {

namespace {

// Rows a sum_clusters thread prepares at a time (a centred or unit frame forms them in its buffer).
constexpr int64_t kSumRows = 256;

}  // namespace

template <typename T>
void sum_clusters(const Prepared<T>& p, int64_t n, const std::vector<int64_t>& labels, ClusterSums& sums) {
#pragma omp parallel
  {
    std::vector<T> buf(p.buffer(kSumRows));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < sums.nc; ++c) {
      sums.clear_chunk(c);
      const int64_t end = std::min(n, (c + 1) * sums.cs);
      for (int64_t i0 = c * sums.cs; i0 < end; i0 += kSumRows) {
        const int64_t i1 = std::min(end, i0 + kSumRows);
        sums.add(p.rows(i0, i1, buf.data()), labels.data() + i0, c, i1 - i0);
      }
    }
  }
}

template <typename T>
void centroids_from_sums(const Prepared<T>& p, int64_t n, const ClusterSums& s, const std::vector<int64_t>& labels,
                         const std::vector<double>& own_in, bool spherical, std::vector<double>& cent) {
  const int64_t k = s.k, d = s.d;
  std::vector<double> sums(static_cast<size_t>(k) * d, 0.0);
  std::vector<int64_t> counts(k, 0);
  for (int64_t c = 0; c < s.nc; ++c) {
    for (int64_t j = 0; j < k; ++j) {
      counts[j] += s.count[c * k + j];
      for (int64_t t = 0; t < d; ++t) sums[j * d + t] += s.part[(c * k + j) * d + t];
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] == 0) continue;
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = sums[j * d + t] / static_cast<double>(counts[j]);
  }
  std::vector<double> own;  // a copy only when a cluster is empty: re-seeding marks the points it took
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] != 0) continue;
    if (own.empty()) own = own_in;
    int64_t pick = -1;
    double far = -1.0;
    for (int64_t i = 0; i < n; ++i) {
      if (counts[labels[i]] > 1 && own[i] > far) {
        far = own[i];
        pick = i;
      }
    }
    if (pick < 0) throw std::runtime_error("capacity_kmeans: cannot re-seed an empty cluster (internal error)");
    std::vector<T> buf(p.buffer(1));
    const T* row = p.row(pick, buf.data());
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(row[t]);
    --counts[labels[pick]];
    own[pick] = -1.0;
  }
  if (spherical) normalise_rows(cent, k, d);
}

template void sum_clusters<float>(const Prepared<float>&, int64_t, const std::vector<int64_t>&, ClusterSums&);
template void sum_clusters<double>(const Prepared<double>&, int64_t, const std::vector<int64_t>&, ClusterSums&);
template void centroids_from_sums<float>(const Prepared<float>&, int64_t, const ClusterSums&,
                                         const std::vector<int64_t>&, const std::vector<double>&, bool,
                                         std::vector<double>&);
template void centroids_from_sums<double>(const Prepared<double>&, int64_t, const ClusterSums&,
                                          const std::vector<int64_t>&, const std::vector<double>&, bool,
                                          std::vector<double>&);

}  // namespace cluster_kernels
