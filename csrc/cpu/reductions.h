// The CPU K-means' deterministic reductions: fixed chunks of rows summed in order, and lane sums over the
// features that vectorise without reassociating. The CUDA counterpart is cuda/reductions.cuh.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace cluster_kernels {

// Rows per reduction chunk. It depends on n only, never on the thread count, so every floating
// point sum is combined in the same order whatever the number of threads.
inline int64_t chunk_rows(int64_t n) { return std::max<int64_t>(2048, (n + 255) / 256); }

// Deterministic sum of f(i) over [0, n): per-chunk sequential sums, chunks added in order.
template <typename F>
double chunked_sum(int64_t n, F f) {
  const int64_t cs = chunk_rows(n);
  const int64_t nc = (n + cs - 1) / cs;
  std::vector<double> part(nc, 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nc; ++c) {
    double s = 0.0;
    const int64_t e = std::min(n, (c + 1) * cs);
    for (int64_t i = c * cs; i < e; ++i) s += f(i);
    part[c] = s;
  }
  double total = 0.0;
  for (double v : part) total += v;
  return total;
}

// The sum of term(t) over t < d in double, over kNormLanes lane accumulators written out in the source (vectorised
// without reassociation, so the result does not depend on the SIMD width; a single running sum would be a d-long
// dependency chain), combined pairwise in a fixed order.
constexpr int kNormLanes = 8;
template <class Term>
inline double lane_sum(int64_t d, Term term) {
  double acc[kNormLanes] = {};
  int64_t t = 0;
  for (; t + kNormLanes <= d; t += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) acc[l] += term(t + l);
  double tail = 0.0;
  for (; t < d; ++t) tail += term(t);
  for (int w = kNormLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0] + tail;
}

// |v|^2 in double.
template <typename T>
inline double row_sqnorm(const T* v, int64_t d) {
  return lane_sum(d, [v](int64_t t) { return static_cast<double>(v[t]) * static_cast<double>(v[t]); });
}

}  // namespace cluster_kernels
