// No CUDA counterpart: the device distance tiles are their own kernel (cuda/distance_tiles.cu), not a BLAS call.
// A CBLAS reached through function pointers that the Python side finds at run time (cluster_kernels/_blas.py:
// numpy's bundled OpenBLAS), so the extension links no BLAS of its own and builds without BLAS headers. The
// distance tiles of the K-means (kmeans.cpp) are one GEMM each, |x|^2 + |c|^2 - 2 x c^T; without a registered
// BLAS they fall back to the portable tile loop of kmeans.cpp.
//
// Determinism: every call computes one fixed block of rows on the calling OpenMP thread, and the Python side
// holds the BLAS at one thread while a native K-means call runs, so no product depends on the thread count.
#pragma once

#include <cstdint>

namespace cluster_kernels {

// cblas_?gemm with 32-bit (LP64) or 64-bit (ILP64) integers; the enums are C ints.
using SgemmLp64 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t, const float*,
                           int32_t, float, float*, int32_t);
using DgemmLp64 = void (*)(int, int, int, int32_t, int32_t, int32_t, double, const double*, int32_t, const double*,
                           int32_t, double, double*, int32_t);
using SgemmIlp64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                            int64_t, float, float*, int64_t);
using DgemmIlp64 = void (*)(int, int, int, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                            int64_t, double, double*, int64_t);

// The addresses of cblas_sgemm / cblas_dgemm (0: not available) and their integer width.
struct Blas {
  uintptr_t sgemm = 0;
  uintptr_t dgemm = 0;
  bool ilp64 = false;

  template <typename T>
  bool has() const {
    return (sizeof(T) == 4 ? sgemm : dgemm) != 0;
  }

  // C (m, n) = A (m, kd) B^T for row-major A (lda) and B (n, kd; ldb): the distance tile's dot products.
  void gemm_nt(int64_t m, int64_t n, int64_t kd, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
               int64_t ldc) const {
    if (ilp64)
      reinterpret_cast<SgemmIlp64>(sgemm)(kRowMajor, kNoTrans, kTrans, m, n, kd, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
    else
      reinterpret_cast<SgemmLp64>(sgemm)(kRowMajor, kNoTrans, kTrans, static_cast<int32_t>(m),
                                         static_cast<int32_t>(n), static_cast<int32_t>(kd), 1.0f, a,
                                         static_cast<int32_t>(lda), b, static_cast<int32_t>(ldb), 0.0f, c,
                                         static_cast<int32_t>(ldc));
  }
  void gemm_nt(int64_t m, int64_t n, int64_t kd, const double* a, int64_t lda, const double* b, int64_t ldb,
               double* c, int64_t ldc) const {
    if (ilp64)
      reinterpret_cast<DgemmIlp64>(dgemm)(kRowMajor, kNoTrans, kTrans, m, n, kd, 1.0, a, lda, b, ldb, 0.0, c, ldc);
    else
      reinterpret_cast<DgemmLp64>(dgemm)(kRowMajor, kNoTrans, kTrans, static_cast<int32_t>(m),
                                         static_cast<int32_t>(n), static_cast<int32_t>(kd), 1.0, a,
                                         static_cast<int32_t>(lda), b, static_cast<int32_t>(ldb), 0.0, c,
                                         static_cast<int32_t>(ldc));
  }

 private:
  static constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_ORDER, CBLAS_TRANSPOSE
};

}  // namespace cluster_kernels
