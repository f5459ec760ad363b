// The distance tiles of the CPU K-means (distance_tiles.h): a GEMM per tile through the registered BLAS, or the
// portable register-tiled loop. The CUDA counterpart is cuda/distance_tiles.cu.
#include "cpu/distance_tiles.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace cluster_kernels {

namespace {

// The dot product keeps L independent lane accumulators written out in the source, so the compiler vectorises it
// without reassociating and the result does not depend on the SIMD width.

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

// Distances D_ij = max(0, |x_i|^2 + |c_j|^2 - 2 x_i.c_j) of the m prepared rows `rows` (row-major, their squared
// norms xnorm) into out[i * k + j]; with a BLAS the dot products are one GEMM into `scratch` (kTileRows x k of T).
template <typename T>
void distance_tile(const T* rows, const double* xnorm, int64_t m, int64_t d, const Panel<T>& pn, T* scratch,
                   double* out) {
  const int64_t k = pn.k;
  if (!pn.blas) {
    sqdist_block(rows, xnorm, 0, m, d, pn.c, pn.kp, pn.cnorm, k, out);
    return;
  }
  pn.blas->gemm_nt(m, k, d, rows, d, pn.c, d, scratch, k);
  for (int64_t i = 0; i < m; ++i) {
    const T* dot = scratch + i * k;
    double* o = out + i * k;
    for (int64_t j = 0; j < k; ++j) {
      const double v = xnorm[i] + pn.cnorm[j] - 2.0 * static_cast<double>(dot[j]);
      o[j] = v > 0.0 ? v : 0.0;
    }
  }
}

}  // namespace

// Distances of every prepared row of p to k centroids c (k, d) row-major, into out (n, k).
template <typename T>
void sqdist(const Prepared<T>& p, int64_t n, const T* c, const double* cnorm, int64_t k, double* out,
            const Blas* blas) {
  const int64_t d = p.d;
  const Panel<T> pn(c, cnorm, k, d, blas);
  const int64_t nb = (n + kTileRows - 1) / kTileRows;
#pragma omp parallel
  {
    std::vector<T> scratch(pn.scratch_size());
    std::vector<T> buf(p.buffer(kTileRows));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = b * kTileRows, i1 = std::min(n, i0 + kTileRows);
      distance_tile(p.rows(i0, i1, buf.data()), p.xnorm.data() + i0, i1 - i0, d, pn, scratch.data(), out + i0 * k);
    }
  }
}

// Without capacities the assignment is the argmin (the auction's answer at zero prices): tile by tile, the
// nearest centroid (lowest index on ties), its distance own_new[i] and the distance to prev[i] (if given),
// without an n x k matrix. With `sums`, each chunk's rows are also added to the cluster sums of their new
// labels while the tile is still in cache, which saves the centroid update its own pass over x.
template <typename T>
void nearest(const Prepared<T>& p, int64_t n, const T* c, const double* cnorm, int64_t k, const Blas* blas,
             const int64_t* prev, int64_t* labels, double* own_new, double* own_prev, ClusterSums* sums) {
  const int64_t d = p.d;
  const Panel<T> pn(c, cnorm, k, d, blas);
  // Work items: chunks of the sums when summing (tiles of kTileRows rows inside each), else single tiles.
  const int64_t span = sums ? sums->cs : kTileRows;
  const int64_t items = (n + span - 1) / span;
#pragma omp parallel
  {
    std::vector<T> scratch(pn.scratch_size());
    std::vector<double> tile(static_cast<size_t>(kTileRows * k));
    std::vector<T> buf(p.buffer(kTileRows));
#pragma omp for schedule(static)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t w0 = w * span, w1 = std::min(n, w0 + span);
      if (sums) sums->clear_chunk(w);
      for (int64_t i0 = w0; i0 < w1; i0 += kTileRows) {
        const int64_t i1 = std::min(w1, i0 + kTileRows);
        const T* rows = p.rows(i0, i1, buf.data());
        distance_tile(rows, p.xnorm.data() + i0, i1 - i0, d, pn, scratch.data(), tile.data());
        for (int64_t i = i0; i < i1; ++i) {
          const double* Di = tile.data() + (i - i0) * k;
          int64_t best = 0;
          for (int64_t j = 1; j < k; ++j) best = Di[j] < Di[best] ? j : best;
          labels[i] = best;
          own_new[i] = Di[best];
          if (prev) own_prev[i] = Di[prev[i]];
        }
        if (sums) sums->add(rows, labels + i0, w, i1 - i0);
      }
    }
  }
}

template void sqdist<float>(const Prepared<float>&, int64_t, const float*, const double*, int64_t, double*,
                            const Blas*);
template void sqdist<double>(const Prepared<double>&, int64_t, const double*, const double*, int64_t, double*,
                             const Blas*);
template void nearest<float>(const Prepared<float>&, int64_t, const float*, const double*, int64_t, const Blas*,
                             const int64_t*, int64_t*, double*, double*, ClusterSums*);
template void nearest<double>(const Prepared<double>&, int64_t, const double*, const double*, int64_t, const Blas*,
                              const int64_t*, int64_t*, double*, double*, ClusterSums*);

}  // namespace cluster_kernels
