// The frame of the CUDA Lloyd iterations (prepare.cuh). The CPU counterpart is cpu/prepare.cpp.
#include "cuda/prepare.cuh"

#include <cmath>
#include <stdexcept>

namespace cluster_kernels {
namespace cuda {

namespace {

// part[c * d + t] = sum of x[i, t] over the rows i of chunk c, in row order (the CPU's prepare()).
template <typename T>
__global__ void column_chunk_sums_kernel(const T* __restrict__ x, int64_t n, int64_t d, int64_t cs, int64_t nc,
                                         double* __restrict__ part) {
  for (int64_t g = thread_index(); g < nc * d; g += thread_stride()) {
    const int64_t c = g / d, t = g - c * d;
    const int64_t end = imin(n, (c + 1) * cs);
    double s = 0.0;
    for (int64_t i = c * cs; i < end; ++i) s = __dadd_rn(s, static_cast<double>(x[i * d + t]));
    part[g] = s;
  }
}

__global__ void mean_kernel(const double* __restrict__ part, int64_t nc, int64_t d, int64_t n,
                            double* __restrict__ mean) {
  for (int64_t t = thread_index(); t < d; t += thread_stride()) {
    double m = 0.0;
    for (int64_t c = 0; c < nc; ++c) m = __dadd_rn(m, part[c * d + t]);
    mean[t] = __ddiv_rn(m, static_cast<double>(n));
  }
}

// One thread per row: the row norm is a sequential sum over columns, as on the CPU.
template <typename T>
__global__ void prepare_rows_kernel(const T* __restrict__ x, const double* __restrict__ mean, int64_t n, int64_t d,
                                    bool spherical, T* __restrict__ xp, double* __restrict__ xnorm, int* zero_row) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const T* src = x + i * d;
    T* dst = xp + i * d;
    double inv = 0.0;
    if (spherical) {
      double s = 0.0;
      for (int64_t t = 0; t < d; ++t) {
        const double v = static_cast<double>(src[t]);
        s = __dadd_rn(s, __dmul_rn(v, v));
      }
      const double nrm = __dsqrt_rn(s);
      if (nrm == 0.0) atomicExch(zero_row, 1);
      inv = nrm > 0.0 ? __ddiv_rn(1.0, nrm) : 0.0;
    }
    double s2 = 0.0;
    for (int64_t t = 0; t < d; ++t) {
      const double v64 = static_cast<double>(src[t]);
      const T v = static_cast<T>(spherical ? __dmul_rn(v64, inv) : __dsub_rn(v64, mean[t]));
      dst[t] = v;
      const double vd = static_cast<double>(v);
      s2 = __dadd_rn(s2, __dmul_rn(vd, vd));
    }
    xnorm[i] = s2;
  }
}

}  // namespace

template <typename T>
Prepared<T> prepare(Ctx& ctx, const T* x, int64_t n, int64_t d, bool spherical) {
  Prepared<T> p;
  p.mean.assign(d, 0.0);
  p.x = ctx.alloc<T>(static_cast<size_t>(n) * d);
  p.xnorm = ctx.alloc<double>(n);
  DevArray<double> mean_dev;
  if (!spherical) {
    const int64_t cs = chunk_rows(n);
    const int64_t nc = (n + cs - 1) / cs;
    DevArray<double> part = ctx.alloc<double>(static_cast<size_t>(nc * d));
    mean_dev = ctx.alloc<double>(d);
    column_chunk_sums_kernel<T><<<blocks_for(nc * d), kThreads, 0, ctx.stream>>>(x, n, d, cs, nc, part.data());
    CK_LAUNCH("column_chunk_sums_kernel");
    mean_kernel<<<blocks_for(d), kThreads, 0, ctx.stream>>>(part.data(), nc, d, n, mean_dev.data());
    CK_LAUNCH("mean_kernel");
    ctx.to_host(p.mean.data(), mean_dev.data(), static_cast<size_t>(d));
  }
  DevArray<int> zero_row = ctx.alloc<int>(1);
  CK_CUDA(cudaMemsetAsync(zero_row.data(), 0, sizeof(int), ctx.stream));
  prepare_rows_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream>>>(
      x, spherical ? nullptr : mean_dev.data(), n, d, spherical, p.x.data(), p.xnorm.data(), zero_row.data());
  CK_LAUNCH("prepare_rows_kernel");
  if (ctx.read(zero_row.data()) != 0)
    throw std::invalid_argument("capacity_kmeans: metric='cosine' needs non-zero rows");
  return p;
}

template <typename T>
static double row_sqnorm(const T* v, int64_t d) {
  double s = 0.0;
  for (int64_t t = 0; t < d; ++t) s += static_cast<double>(v[t]) * static_cast<double>(v[t]);
  return s;
}

template <typename T>
void upload_centroids(Ctx& ctx, const std::vector<double>& c, int64_t k, int64_t d, DevArray<T>& ct_dev,
                      DevArray<double>& cn_dev) {
  std::vector<T> ct(static_cast<size_t>(k) * d);
  std::vector<double> cn(k);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < d; ++t) ct[j * d + t] = static_cast<T>(c[j * d + t]);
    cn[j] = row_sqnorm(ct.data() + j * d, d);
  }
  ctx.to_device(ct_dev.data(), ct.data(), ct.size());
  ctx.to_device(cn_dev.data(), cn.data(), cn.size());
  ctx.sync();  // ct and cn are about to go out of scope
}

template <typename T>
std::vector<double> device_row(Ctx& ctx, const Prepared<T>& p, int64_t d, int64_t row) {
  std::vector<T> v(d);
  ctx.to_host(v.data(), p.x.data() + row * d, static_cast<size_t>(d));
  ctx.sync();
  return std::vector<double>(v.begin(), v.end());
}

template Prepared<float> prepare<float>(Ctx&, const float*, int64_t, int64_t, bool);
template Prepared<double> prepare<double>(Ctx&, const double*, int64_t, int64_t, bool);
template void upload_centroids<float>(Ctx&, const std::vector<double>&, int64_t, int64_t, DevArray<float>&,
                                     DevArray<double>&);
template void upload_centroids<double>(Ctx&, const std::vector<double>&, int64_t, int64_t, DevArray<double>&,
                                     DevArray<double>&);
template std::vector<double> device_row<float>(Ctx&, const Prepared<float>&, int64_t, int64_t);
template std::vector<double> device_row<double>(Ctx&, const Prepared<double>&, int64_t, int64_t);

}  // namespace cuda
}  // namespace cluster_kernels
