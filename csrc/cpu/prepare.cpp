// The frame of the CPU Lloyd iterations (prepare.h): input checks, the mean, the row norms. The CUDA counterpart is
// cuda/prepare.cu.
//
// The Python wrappers (cluster_kernels/kmeans.py) refuse NaN/Inf and rescale the data by a power of two into
// [2^-24, 2^24]; called directly, the kernels refuse what they cannot compute instead of producing NaN/Inf
// distances, whose argmins have no valid index.
#include "cpu/prepare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#include "cpu/reductions.h"

namespace cluster_kernels {

// The first row of v (rows x d) with a NaN or Inf entry, or -1.
template <typename T>
static int64_t first_nonfinite_row(const T* v, int64_t rows, int64_t d) {
  int64_t first = rows;
#pragma omp parallel for schedule(static) reduction(min : first)
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t t = 0; t < d; ++t) {
      if (!std::isfinite(static_cast<double>(v[i * d + t]))) {
        first = std::min(first, i);
        break;
      }
    }
  }
  return first < rows ? first : -1;
}

template <typename T>
void check_finite(const char* op, const char* name, const T* v, int64_t rows, int64_t d) {
  const int64_t bad = first_nonfinite_row(v, rows, d);
  if (bad >= 0)
    throw std::invalid_argument(std::string(op) + ": " + name + " contains NaN or Inf (first bad row: " +
                                std::to_string(bad) + "); remove or impute those rows");
}

template <typename T>
void check_range(const char* op, const char* name, double largest) {
  if (largest <= max_entry<T>()) return;
  char msg[320];
  std::snprintf(msg, sizeof msg,
                "%s: %s is out of the native kernel's range: an entry of magnitude %.3g (after centring) exceeds "
                "%.3g for %s; call cluster_kernels.%s, which rescales the data by a power of two",
                op, name, largest, max_entry<T>(), sizeof(T) == 4 ? "float32" : "float64", op);
  throw std::invalid_argument(msg);
}

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double e : v) m = std::max(m, std::fabs(e));
  return m;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Centring only buys precision: float32 |x|^2 + |c|^2 - 2 x.c loses about eps |x| |c| to rounding, so it pays
// when |mean|^2 is not small next to the mean squared distance to the mean. Below kCentreRatio of it, the rows
// are used in place (the rounding bound grows by at most that fraction). Labels depend on this choice; memory does
// not (the centred rows are formed per tile, never stored).
constexpr double kCentreRatio = 0.25;

// What the first pass over x finds: the column sums (into mean), the sum of the squared row norms and the
// largest |entry| (x as given), and whether a row is zero.
struct FirstPass {
  double total_sq = 0.0, raw_largest = 0.0;
  bool zero_row = false;
};

// One pass over x gives the column sums, the row norms and the largest |entry|; the NaN/Inf check costs no pass
// of its own: a NaN or an infinity makes a column sum (or a row norm) non-finite, and only then is x scanned for
// the first bad row (a sum that merely overflowed finds none and is left to the range check).
template <typename T>
FirstPass first_pass(const T* x, int64_t n, int64_t d, bool spherical, Prepared<T>& p) {
  const int64_t cs = chunk_rows(n);
  const int64_t nc = (n + cs - 1) / cs;
  std::vector<double> part(spherical ? 0 : static_cast<size_t>(nc) * d, 0.0);
  std::vector<double> part_sq(nc, 0.0);
  bool zero_row = false;
  double raw_largest = 0.0;
#pragma omp parallel for schedule(static) reduction(|| : zero_row) reduction(max : raw_largest)
  for (int64_t c = 0; c < nc; ++c) {
    double* acc = spherical ? nullptr : part.data() + c * d;
    double sq = 0.0;
    for (int64_t i = c * cs; i < std::min(n, (c + 1) * cs); ++i) {
      const T* src = x + i * d;
      p.xnorm[i] = row_sqnorm(src, d);
      sq += p.xnorm[i];
      zero_row = zero_row || p.xnorm[i] == 0.0;
      if (acc) {
        for (int64_t t = 0; t < d; ++t) {
          acc[t] += static_cast<double>(src[t]);
          raw_largest = std::max(raw_largest, std::fabs(static_cast<double>(src[t])));
        }
      }
    }
    part_sq[c] = sq;
  }
  FirstPass f{0.0, raw_largest, zero_row};
  for (int64_t c = 0; c < nc; ++c) {
    f.total_sq += part_sq[c];
    if (!spherical)
      for (int64_t t = 0; t < d; ++t) p.mean[t] += part[c * d + t];
  }
  return f;
}

// The second pass of a centred or unit frame: the norms of the prepared rows (formed one at a time, as a copy's
// rows were) and the largest |prepared entry|; the unit frame's scales first.
template <typename T>
double prepared_norms(Prepared<T>& p, int64_t n, bool spherical) {
  const int64_t d = p.d;
  if (spherical) p.inv.resize(n);
  double largest = 0.0;
#pragma omp parallel reduction(max : largest)
  {
    std::vector<T> buf(d);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      if (spherical) {
        if (!std::isfinite(p.xnorm[i])) largest = kInf;  // the squared norm overflowed (float64 input)
        p.inv[i] = 1.0 / std::sqrt(p.xnorm[i]);
      }
      const T* r = p.row(i, buf.data());
      if (!spherical)
        for (int64_t t = 0; t < d; ++t) largest = std::max(largest, std::fabs(static_cast<double>(r[t])));
      p.xnorm[i] = row_sqnorm(r, d);
    }
  }
  return largest;
}

}  // namespace

template <typename T>
Prepared<T> prepare(const char* op, const T* x, int64_t n, int64_t d, bool spherical) {
  Prepared<T> p;
  p.x = x;
  p.d = d;
  p.mean.assign(d, 0.0);
  p.xnorm.resize(n);
  const FirstPass f = first_pass(x, n, d, spherical, p);
  bool finite = std::isfinite(f.total_sq);
  for (int64_t t = 0; t < d; ++t) finite = finite && std::isfinite(p.mean[t]);
  if (!finite) check_finite(op, "x", x, n, d);
  if (spherical && f.zero_row) throw std::invalid_argument(std::string(op) + ": metric='cosine' needs non-zero rows");
  for (int64_t t = 0; t < d; ++t) p.mean[t] /= static_cast<double>(n);
  if (!spherical) {
    double m2 = 0.0;
    for (int64_t t = 0; t < d; ++t) m2 += p.mean[t] * p.mean[t];
    const double spread = f.total_sq / static_cast<double>(n) - m2;  // mean |x_i - mean|^2
    if (m2 <= kCentreRatio * spread && f.raw_largest <= max_entry<T>()) {
      std::fill(p.mean.begin(), p.mean.end(), 0.0);
      return p;  // in place: the norms are the first pass's
    }
  }
  p.frame = spherical ? Prepared<T>::Frame::kUnit : Prepared<T>::Frame::kCentred;
  check_range<T>(op, "x", prepared_norms(p, n, spherical));
  return p;
}

template void check_finite<float>(const char*, const char*, const float*, int64_t, int64_t);
template void check_finite<double>(const char*, const char*, const double*, int64_t, int64_t);
template void check_range<float>(const char*, const char*, double);
template void check_range<double>(const char*, const char*, double);
template Prepared<float> prepare<float>(const char*, const float*, int64_t, int64_t, bool);
template Prepared<double> prepare<double>(const char*, const double*, int64_t, int64_t, bool);

}  // namespace cluster_kernels
