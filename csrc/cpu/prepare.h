// The frame of the CPU Lloyd iterations (prepare.cpp): the input checks, and the rows centred or made unit length
// on the fly, so that no n x d copy of x is ever made. The CUDA counterpart is cuda/prepare.cuh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/rows.h"

namespace cluster_kernels {

// Largest |prepared entry| (centred data, centroids) accepted: float32 dot products of d such entries stay
// far below FLT_MAX (2^128), double ones below DBL_MAX.
template <typename T>
constexpr double max_entry() {
  return sizeof(T) == 4 ? 0x1p40 : 0x1p480;
}

// Refuses NaN/Inf in v (rows x d), naming the first bad row.
template <typename T>
void check_finite(const char* op, const char* name, const T* v, int64_t rows, int64_t d);

// Refuses a largest |entry| above max_entry<T>() with a message that names the fix.
template <typename T>
void check_range(const char* op, const char* name, double largest);

double max_abs(const std::vector<double>& v);
// normalise_rows: common/rows.h

// The frame of the Lloyd iterations: the caller's rows x, used in place, centred (x - mean) or scaled to unit length
// (metric="cosine"), and the squared norms of the prepared rows. A prepared row is formed when it is read (row,
// rows) into a buffer of the reader's, with the very expression a stored copy was written with, so every result
// is that of the copy, which costs n x d of T (4 GiB at n = 10^6, d = 1 024, float32) and is never made.
template <typename T>
struct Prepared {
  enum class Frame { kInPlace, kCentred, kUnit };
  const T* x = nullptr;  // (n, d): the caller's rows
  int64_t d = 0;
  Frame frame = Frame::kInPlace;
  std::vector<double> xnorm;  // |prepared row|^2
  std::vector<double> mean;   // the mean removed (zero unless kCentred)
  std::vector<double> inv;    // kUnit: 1 / |x_i|

  bool in_place() const { return frame == Frame::kInPlace; }
  // Values a reader's buffer must hold for `count` prepared rows (0 in place: rows are read from x).
  size_t buffer(int64_t count) const { return in_place() ? 0 : static_cast<size_t>(count * d); }

  // Prepared row i: x's own row in place, else written to buf (d values).
  const T* row(int64_t i, T* buf) const {
    const T* src = x + i * d;
    if (frame == Frame::kInPlace) return src;
    if (frame == Frame::kCentred) {
      const double* m = mean.data();
      for (int64_t t = 0; t < d; ++t) buf[t] = static_cast<T>(static_cast<double>(src[t]) - m[t]);
    } else {
      const double s = inv[i];
      for (int64_t t = 0; t < d; ++t) buf[t] = static_cast<T>(static_cast<double>(src[t]) * s);
    }
    return buf;
  }
  // Prepared rows [i0, i1), row-major: x's own rows in place, else written to buf ((i1 - i0) x d values).
  const T* rows(int64_t i0, int64_t i1, T* buf) const {
    if (frame == Frame::kInPlace) return x + i0 * d;
    for (int64_t i = i0; i < i1; ++i) row(i, buf + (i - i0) * d);
    return buf;
  }
};

// The frame of x (n, d): checks it (NaN/Inf, range) and takes its row norms in one or two passes over x.
template <typename T>
Prepared<T> prepare(const char* op, const T* x, int64_t n, int64_t d, bool spherical);

}  // namespace cluster_kernels
