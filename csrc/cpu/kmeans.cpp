// Capacity-constrained K-means on the CPU: distances, Lloyd iterations and k-means++ (the auction: auction.cpp).
// See kmeans.h and the module docstring of cluster_kernels/kmeans.py for the algorithm.
#include "cpu/kmeans.h"

#include "cpu/blas.h"
#include "cpu/raw_vector.h"
#include "cpu/thread_scope.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

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

// Rows per reduction chunk. It depends on n only, never on the thread count, so every floating
// point sum is combined in the same order whatever the number of threads.
int64_t chunk_rows(int64_t n) { return std::max<int64_t>(2048, (n + 255) / 256); }

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

// ------------------------------------------------------------------------------------------------
// Distances: D_ij = |x_i|^2 + |c_j|^2 - 2 x_i.c_j, clamped at 0. The dot product keeps L
// independent lane accumulators written out in the source, so the compiler vectorises it without
// reassociating and the result does not depend on the SIMD width.
// ------------------------------------------------------------------------------------------------

template <typename T, int L>
inline T dot_lanes(const T* __restrict a, const T* __restrict b, int64_t d) {
  T acc[L];
  for (int l = 0; l < L; ++l) acc[l] = T(0);
  int64_t t = 0;
  for (; t + L <= d; t += L) {
    for (int l = 0; l < L; ++l) acc[l] += a[t + l] * b[t + l];
  }
  T tail = T(0);
  for (; t < d; ++t) tail += a[t] * b[t];
  for (int w = L / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0] + tail;
}

template <typename T>
constexpr int lanes() {
  return sizeof(T) == 4 ? 32 : 16;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CLUSTER_KERNELS_NO_CLONES)
#define CK_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CK_TARGET_CLONES
#endif

// The portable distance kernels (used when no BLAS is registered, and for one centroid): rows [i0, i1) into
// out[(i - i0) * k + j].
// Many centroids: a register tile of kPts points x W centroids, the centroids transposed to a
// (d, kp) panel so W consecutive centroids form one SIMD vector (GCC vector extension: one AVX
// register in the x86-64-v3 clone, two SSE registers otherwise). Each output is a sum over t in
// order, so the result does not depend on the vector width.
template <typename T, int W>
inline void sqdist_tile(const T* __restrict x, const double* xnorm, int64_t i0, int64_t i1, int64_t d,
                        const T* __restrict ct, int64_t kp, const double* cnorm, int64_t k, double* out) {
  typedef T vec __attribute__((vector_size(W * sizeof(T))));
  constexpr int kPts = 4;
  for (int64_t i = i0; i < i1; i += kPts) {
    const int np = static_cast<int>(std::min<int64_t>(kPts, i1 - i));
    const T* xr[kPts];
    for (int p = 0; p < kPts; ++p) xr[p] = x + (i + std::min(p, np - 1)) * d;
    for (int64_t j0 = 0; j0 < k; j0 += W) {
      vec acc[kPts];
      for (int p = 0; p < kPts; ++p) acc[p] = vec{};
      for (int64_t t = 0; t < d; ++t) {
        vec c;
        std::memcpy(&c, ct + t * kp + j0, sizeof(vec));
        for (int p = 0; p < kPts; ++p) acc[p] += xr[p][t] * c;
      }
      for (int p = 0; p < np; ++p) {
        for (int w = 0; w < W && j0 + w < k; ++w) {
          const double v = xnorm[i + p] + cnorm[j0 + w] - 2.0 * static_cast<double>(acc[p][w]);
          out[(i - i0 + p) * k + j0 + w] = v > 0.0 ? v : 0.0;
        }
      }
    }
  }
}

// One centroid (k-means++): lanes over the feature dimension instead.
template <typename T>
inline void sqdist_one(const T* __restrict x, const double* xnorm, int64_t i0, int64_t i1, int64_t d,
                       const T* __restrict c, const double* cnorm, double* out) {
  for (int64_t i = i0; i < i1; ++i) {
    const double v = xnorm[i] + cnorm[0] - 2.0 * static_cast<double>(dot_lanes<T, lanes<T>()>(x + i * d, c, d));
    out[i - i0] = v > 0.0 ? v : 0.0;
  }
}

CK_TARGET_CLONES
void sqdist_block_f(const float* x, const double* xnorm, int64_t i0, int64_t i1, int64_t d, const float* ct,
                    int64_t kp, const double* cnorm, int64_t k, double* out) {
  if (k == 1)
    sqdist_one(x, xnorm, i0, i1, d, ct, cnorm, out);
  else
    sqdist_tile<float, 8>(x, xnorm, i0, i1, d, ct, kp, cnorm, k, out);
}

CK_TARGET_CLONES
void sqdist_block_d(const double* x, const double* xnorm, int64_t i0, int64_t i1, int64_t d, const double* ct,
                    int64_t kp, const double* cnorm, int64_t k, double* out) {
  if (k == 1)
    sqdist_one(x, xnorm, i0, i1, d, ct, cnorm, out);
  else
    sqdist_tile<double, 4>(x, xnorm, i0, i1, d, ct, kp, cnorm, k, out);
}

inline void sqdist_block(const float* x, const double* xn, int64_t i0, int64_t i1, int64_t d, const float* ct,
                         int64_t kp, const double* cn, int64_t k, double* out) {
  sqdist_block_f(x, xn, i0, i1, d, ct, kp, cn, k, out);
}
inline void sqdist_block(const double* x, const double* xn, int64_t i0, int64_t i1, int64_t d, const double* ct,
                         int64_t kp, const double* cn, int64_t k, double* out) {
  sqdist_block_d(x, xn, i0, i1, d, ct, kp, cn, k, out);
}

template <typename T>
constexpr int64_t tile_width() {
  return sizeof(T) == 4 ? 8 : 4;
}

// Rows per distance tile. Fixed (never derived from the thread count): each tile is one single-threaded GEMM
// on one OpenMP thread, so the products, hence the labels, do not depend on the number of threads.
constexpr int64_t kTileRows = 256;

// The centroids (k, d) of one distance pass in the layout of its kernel: with a BLAS, row-major as given (the
// GEMM's B^T); without one, for k > 1, transposed into a zero-padded (d, kp) panel.
template <typename T>
struct Panel {
  const T* c;
  const double* cnorm;
  int64_t k, kp;
  const Blas* blas;  // null or without this type's GEMM: the portable tile loop
  std::vector<T> transposed;

  Panel(const T* c_, const double* cn, int64_t k_, int64_t d, const Blas* b)
      : c(c_), cnorm(cn), k(k_), kp(1), blas(b && b->has<T>() && k_ > 1 ? b : nullptr) {
    if (blas || k == 1) return;
    kp = (k + tile_width<T>() - 1) / tile_width<T>() * tile_width<T>();
    transposed.assign(static_cast<size_t>(d) * kp, T(0));
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < d; ++t) transposed[t * kp + j] = c[j * d + t];
    c = transposed.data();
  }
  size_t scratch_size() const { return blas ? static_cast<size_t>(kTileRows * k) : 0; }
};

// Distances D_ij = max(0, |x_i|^2 + |c_j|^2 - 2 x_i.c_j) of rows [i0, i1) into out[(i - i0) * k + j]; with a
// BLAS the dot products are one GEMM into `scratch` (kTileRows x k of T).
template <typename T>
void distance_tile(const T* x, const double* xnorm, int64_t i0, int64_t i1, int64_t d, const Panel<T>& pn,
                   T* scratch, double* out) {
  const int64_t k = pn.k;
  if (!pn.blas) {
    sqdist_block(x, xnorm, i0, i1, d, pn.c, pn.kp, pn.cnorm, k, out);
    return;
  }
  pn.blas->gemm_nt(i1 - i0, k, d, x + i0 * d, d, pn.c, d, scratch, k);
  for (int64_t i = i0; i < i1; ++i) {
    const T* dot = scratch + (i - i0) * k;
    double* o = out + (i - i0) * k;
    for (int64_t j = 0; j < k; ++j) {
      const double v = xnorm[i] + pn.cnorm[j] - 2.0 * static_cast<double>(dot[j]);
      o[j] = v > 0.0 ? v : 0.0;
    }
  }
}

// Distances of all rows of x to k centroids c (k, d) row-major, into out (n, k).
template <typename T>
void sqdist(const T* x, const double* xnorm, int64_t n, int64_t d, const T* c, const double* cnorm, int64_t k,
            double* out, const Blas* blas) {
  const Panel<T> pn(c, cnorm, k, d, blas);
  const int64_t nb = (n + kTileRows - 1) / kTileRows;
#pragma omp parallel
  {
    std::vector<T> scratch(pn.scratch_size());
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = b * kTileRows;
      distance_tile(x, xnorm, i0, std::min(n, i0 + kTileRows), d, pn, scratch.data(), out + i0 * k);
    }
  }
}

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
  // Rows [i0, i1) of chunk c added to its sums, in row order.
  template <typename T>
  void add(const T* x, const int64_t* labels, int64_t c, int64_t i0, int64_t i1) {
    double* acc = chunk_sums(c);
    int64_t* cnt = chunk_counts(c);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = labels[i];
      ++cnt[j];
      const T* xi = x + i * d;
      double* aj = acc + j * d;
      for (int64_t t = 0; t < d; ++t) aj[t] += static_cast<double>(xi[t]);
    }
  }
};

// Without capacities the assignment is the argmin (the auction's answer at zero prices): tile by tile, the
// nearest centroid (lowest index on ties), its distance own_new[i] and the distance to prev[i] (if given),
// without an n x k matrix. With `sums`, each chunk's rows are also added to the cluster sums of their new
// labels while the tile is still in cache, which saves the centroid update its own pass over x.
template <typename T>
void nearest(const T* x, const double* xnorm, int64_t n, int64_t d, const T* c, const double* cnorm, int64_t k,
             const Blas* blas, const int64_t* prev, int64_t* labels, double* own_new, double* own_prev,
             ClusterSums* sums = nullptr) {
  const Panel<T> pn(c, cnorm, k, d, blas);
  // Work items: chunks of the sums when summing (tiles of kTileRows rows inside each), else single tiles.
  const int64_t span = sums ? sums->cs : kTileRows;
  const int64_t items = (n + span - 1) / span;
#pragma omp parallel
  {
    std::vector<T> scratch(pn.scratch_size());
    std::vector<double> tile(static_cast<size_t>(kTileRows * k));
#pragma omp for schedule(static)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t w0 = w * span, w1 = std::min(n, w0 + span);
      if (sums) sums->clear_chunk(w);
      for (int64_t i0 = w0; i0 < w1; i0 += kTileRows) {
        const int64_t i1 = std::min(w1, i0 + kTileRows);
        distance_tile(x, xnorm, i0, i1, d, pn, scratch.data(), tile.data());
        for (int64_t i = i0; i < i1; ++i) {
          const double* Di = tile.data() + (i - i0) * k;
          int64_t best = 0;
          for (int64_t j = 1; j < k; ++j) best = Di[j] < Di[best] ? j : best;
          labels[i] = best;
          own_new[i] = Di[best];
          if (prev) own_prev[i] = Di[prev[i]];
        }
        if (sums) sums->add(x, labels, w, i0, i1);
      }
    }
  }
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
double row_sqnorm(const T* v, int64_t d) {
  return lane_sum(d, [v](int64_t t) { return static_cast<double>(v[t]) * static_cast<double>(v[t]); });
}

// ------------------------------------------------------------------------------------------------
// Input checks. The Python wrappers (cluster_kernels/kmeans.py) refuse NaN/Inf and rescale the data by a
// power of two into [2^-24, 2^24]; called directly, the kernels refuse what they cannot compute instead of
// producing NaN/Inf distances, whose argmins have no valid index.
// ------------------------------------------------------------------------------------------------

// Largest |prepared entry| (centred data, centroids) accepted: float32 dot products of d such entries stay
// far below FLT_MAX (2^128), double ones below DBL_MAX.
template <typename T>
constexpr double max_entry() {
  return sizeof(T) == 4 ? 0x1p40 : 0x1p480;
}

// The first row of v (rows x d) with a NaN or Inf entry, or -1.
template <typename T>
int64_t first_nonfinite_row(const T* v, int64_t rows, int64_t d) {
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

// ------------------------------------------------------------------------------------------------
// Lloyd iterations (the auction itself is in auction.cpp).
// ------------------------------------------------------------------------------------------------

// The frame of the Lloyd iterations: the rows (x itself, or a centred or unit-row copy in T), their squared norms,
// and the mean that was removed (zero when none was).
template <typename T>
struct Prepared {
  const T* x = nullptr;  // (n, d): the input, or copy.data()
  RawVector<T> copy;
  std::vector<double> xnorm;
  std::vector<double> mean;
};

// Centring only buys precision: float32 |x|^2 + |c|^2 - 2 x.c loses about eps |x| |c| to rounding, so it pays
// when |mean|^2 is not small next to the mean squared distance to the mean. Below kCentreRatio of it, the rows
// are used in place (the rounding bound grows by at most that fraction), which saves an n x d copy: at
// n = 10^6, d = 1 024 that is 4 GiB and seconds of page faults per call, more than the Lloyd iterations' GEMMs.
constexpr double kCentreRatio = 0.25;

// One pass over x gives the column sums, the row norms and the largest |entry|; the NaN/Inf check costs no pass
// of its own: a NaN or an infinity makes a column sum (or a row norm) non-finite, and only then is x scanned for
// the first bad row (a sum that merely overflowed finds none and is left to the range check). A second pass
// writes the centred or unit-row copy when one is needed.
template <typename T>
Prepared<T> prepare(const char* op, const T* x, int64_t n, int64_t d, bool spherical) {
  Prepared<T> p;
  p.mean.assign(d, 0.0);
  p.xnorm.resize(n);
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
  double total_sq = 0.0;
  for (int64_t c = 0; c < nc; ++c) {
    total_sq += part_sq[c];
    if (!spherical)
      for (int64_t t = 0; t < d; ++t) p.mean[t] += part[c * d + t];
  }
  bool finite = std::isfinite(total_sq);
  for (int64_t t = 0; t < d; ++t) finite = finite && std::isfinite(p.mean[t]);
  if (!finite) check_finite(op, "x", x, n, d);
  if (spherical && zero_row) throw std::invalid_argument(std::string(op) + ": metric='cosine' needs non-zero rows");
  for (int64_t t = 0; t < d; ++t) p.mean[t] /= static_cast<double>(n);
  if (!spherical) {
    double m2 = 0.0;
    for (int64_t t = 0; t < d; ++t) m2 += p.mean[t] * p.mean[t];
    const double spread = total_sq / static_cast<double>(n) - m2;  // mean |x_i - mean|^2
    if (m2 <= kCentreRatio * spread && raw_largest <= max_entry<T>()) {
      std::fill(p.mean.begin(), p.mean.end(), 0.0);
      p.x = x;
      return p;
    }
  }
  p.copy.resize(static_cast<size_t>(n) * d);
  double largest = 0.0;
#pragma omp parallel for schedule(static) reduction(max : largest)
  for (int64_t i = 0; i < n; ++i) {
    const T* src = x + i * d;
    T* dst = p.copy.data() + i * d;
    if (spherical) {
      if (!std::isfinite(p.xnorm[i])) largest = kInf;  // the squared norm overflowed (float64 input)
      const double inv = 1.0 / std::sqrt(p.xnorm[i]);
      for (int64_t t = 0; t < d; ++t) dst[t] = static_cast<T>(static_cast<double>(src[t]) * inv);
    } else {
      for (int64_t t = 0; t < d; ++t) {
        dst[t] = static_cast<T>(static_cast<double>(src[t]) - p.mean[t]);
        largest = std::max(largest, std::fabs(static_cast<double>(dst[t])));
      }
    }
    p.xnorm[i] = row_sqnorm(dst, d);
  }
  p.x = p.copy.data();
  check_range<T>(op, "x", largest);
  return p;
}

void normalise_rows(std::vector<double>& c, int64_t k, int64_t d) {
  for (int64_t j = 0; j < k; ++j) {
    double s = 0.0;
    for (int64_t t = 0; t < d; ++t) s += c[j * d + t] * c[j * d + t];
    const double inv = 1.0 / std::max(std::sqrt(s), 1e-30);
    for (int64_t t = 0; t < d; ++t) c[j * d + t] *= inv;
  }
}

// Squared distance of every row of x to one row `r` of x (for k-means++).
template <typename T>
void dist_to_row(const Prepared<T>& p, int64_t n, int64_t d, int64_t r, std::vector<double>& out) {
  sqdist(p.x, p.xnorm.data(), n, d, p.x + r * d, p.xnorm.data() + r, 1, out.data(), nullptr);
}

template <typename T>
std::vector<double> kmeans_plusplus(const Prepared<T>& p, int64_t n, int64_t d, int64_t k, SplitMix64& rng,
                                    const Blas* blas) {
  const int trials = 2 + static_cast<int>(std::log(static_cast<double>(k)));
  std::vector<double> centers(static_cast<size_t>(k) * d);
  auto put = [&](int64_t j, int64_t row) {
    for (int64_t t = 0; t < d; ++t) centers[j * d + t] = static_cast<double>(p.x[row * d + t]);
  };
  const int64_t first = std::min<int64_t>(static_cast<int64_t>(rng.uniform() * static_cast<double>(n)), n - 1);
  put(0, first);
  std::vector<double> closest(n), cand_d(static_cast<size_t>(n) * trials), best_d(n), cum(n);
  std::vector<T> cand_rows(static_cast<size_t>(trials) * d);
  std::vector<double> cand_norm(trials);
  dist_to_row(p, n, d, first, closest);
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
      std::copy(p.x + cands[t] * d, p.x + (cands[t] + 1) * d, cand_rows.begin() + t * d);
      cand_norm[t] = p.xnorm[cands[t]];
    }
    sqdist(p.x, p.xnorm.data(), n, d, cand_rows.data(), cand_norm.data(), trials, cand_d.data(), blas);
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

// The sums of every chunk of rows by their labels (the centroid update's pass over x, when the assignment did
// not take them).
template <typename T>
void sum_clusters(const Prepared<T>& p, int64_t n, const std::vector<int64_t>& labels, ClusterSums& sums) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < sums.nc; ++c) {
    sums.clear_chunk(c);
    sums.add(p.x, labels.data(), c, c * sums.cs, std::min(n, (c + 1) * sums.cs));
  }
}

// Cluster means from the chunk sums (chunks added in order); empty clusters re-seeded at the point farthest
// from its own centroid among clusters of size > 1, exactly as the reference does.
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
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(p.x[pick * d + t]);
    --counts[labels[pick]];
    own[pick] = -1.0;
  }
  if (spherical) normalise_rows(cent, k, d);
}

template <typename T>
void to_T(const std::vector<double>& c, int64_t k, int64_t d, std::vector<T>& ct, std::vector<double>& cn) {
  ct.resize(static_cast<size_t>(k) * d);
  cn.resize(k);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < d; ++t) ct[j * d + t] = static_cast<T>(c[j * d + t]);
    cn[j] = row_sqnorm(ct.data() + j * d, d);
  }
}

template <typename T>
double exact_own_distances(const Prepared<T>& p, int64_t n, int64_t d, const std::vector<double>& cent,
                           const std::vector<int64_t>& labels, std::vector<double>& own) {
  own.resize(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = p.x + i * d;
    const double* c = cent.data() + labels[i] * d;
    own[i] = lane_sum(d, [xi, c](int64_t t) {
      const double diff = static_cast<double>(xi[t]) - c[t];
      return diff * diff;
    });
  }
  return chunked_sum(n, [&](int64_t i) { return own[i]; });
}

// One assignment step of the Lloyd loop: the problem, and the buffers reused across iterations.
template <typename T>
struct Step {
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

  Step(const Prepared<T>& p, int64_t n_, int64_t d_, int64_t k_, const int64_t* lo_, const int64_t* hi_,
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
      nearest(prep.x, prep.xnorm.data(), n, d, ct.data(), cn.data(), k, blas, prev, new_labels.data(),
              own.data(), own_prev.data(), &sums);
      summed = true;
      ph.distance += watch.lap();
    } else {
      sqdist(prep.x, prep.xnorm.data(), n, d, ct.data(), cn.data(), k, dist.data(), blas);
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
struct Run {
  std::vector<int64_t> labels;
  std::vector<double> cent, history;
  int n_iter = 0;
  bool converged = false;
  int64_t rounds = 0;
  AuctionStats auction;
};

// The Lloyd loop of one restart from the centroids `cent` (prepared frame).
template <typename T>
Run lloyd(Step<T>& step, std::vector<double> cent, const KMeansParams& p) {
  Run r;
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
    cent = kmeans_plusplus(prep, n, d, k, rng, p.blas);
  }
  if (p.spherical) normalise_rows(cent, k, d);
  check_range<T>("capacity_kmeans", "init", max_abs(cent));
  return cent;
}

// The best restart in the caller's frame: distances, inertia and history scaled (cosine: halved), centroids
// uncentred.
void finish(KMeansOutput& best, double best_final, const std::vector<double>& best_cent,
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
KMeansOutput capacity_kmeans_cpu(const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
                                 const T* init, const KMeansParams& p) {
  ThreadScope threads(p.n_threads);
  Stopwatch watch;
  PhaseTimes ph;
  const int64_t k = p.k;
  if (init) check_finite("capacity_kmeans", "init", init, k, d);
  Prepared<T> prep = prepare("capacity_kmeans", x, n, d, p.spherical);
  ph.prepare += watch.lap();
  Step<T> step(prep, n, d, k, lo, hi, p.blas, ph, watch);
  KMeansOutput best;
  double best_final = kInf;
  std::vector<double> best_cent;
  const int runs = init ? 1 : p.n_init;
  for (int run = 0; run < runs; ++run) {
    std::vector<double> cent = start_centroids(prep, n, d, init, run, p);
    ph.init += watch.lap();
    Run r = lloyd(step, std::move(cent), p);
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
void assign_with_capacity_cpu(const T* x, int64_t n, int64_t d, const T* centroids, int64_t k, const int64_t* lo,
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
  sqdist(prep.x, prep.xnorm.data(), n, d, ct.data(), cn.data(), k, dist.data(), blas);
  AuctionState prices;
  auction_assign(dist.data(), n, k, lo, hi, prices, labels);
  std::vector<int64_t> lab(labels, labels + n);
  std::vector<double> own;
  exact_own_distances(prep, n, d, cent, lab, own);
  const double scale = spherical ? 0.5 : 1.0;
  for (int64_t i = 0; i < n; ++i) distances[i] = own[i] * scale;
}

template KMeansOutput capacity_kmeans_cpu<float>(const float*, int64_t, int64_t, const int64_t*, const int64_t*,
                                                 const float*, const KMeansParams&);
template KMeansOutput capacity_kmeans_cpu<double>(const double*, int64_t, int64_t, const int64_t*, const int64_t*,
                                                  const double*, const KMeansParams&);
template void assign_with_capacity_cpu<float>(const float*, int64_t, int64_t, const float*, int64_t, const int64_t*,
                                              const int64_t*, bool, int, int64_t*, double*, const Blas*);
template void assign_with_capacity_cpu<double>(const double*, int64_t, int64_t, const double*, int64_t,
                                               const int64_t*, const int64_t*, bool, int, int64_t*, double*,
                                               const Blas*);

}  // namespace cluster_kernels
