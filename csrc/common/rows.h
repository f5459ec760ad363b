// Host-side row helpers the CPU (csrc/cpu) and CUDA (csrc/cuda) Lloyd iterations share: one definition, so both
// paths compute the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace cluster_kernels {

// Scales each of the k rows of c (k x d, row-major) to unit length (metric="cosine"); a zero row stays zero.
inline void normalise_rows(std::vector<double>& c, int64_t k, int64_t d) {
  for (int64_t j = 0; j < k; ++j) {
    double s = 0.0;
    for (int64_t t = 0; t < d; ++t) s += c[j * d + t] * c[j * d + t];
    const double inv = 1.0 / std::max(std::sqrt(s), 1e-30);
    for (int64_t t = 0; t < d; ++t) c[j * d + t] *= inv;
  }
}

}  // namespace cluster_kernels
