// No CPU counterpart: the shared device kernels (histograms, index fills, widening, radix sort).
// The kernels every part of the CUDA K-means shares: integer histograms, index fills, widening to int64, and
// CUB's stable radix sort of (key, index) pairs (device_utils.cuh declares them).
#include "cuda/device_utils.cuh"

#include <cub/device/device_radix_sort.cuh>

namespace cluster_kernels {
namespace cuda {
namespace {

__global__ void iota_kernel(int* __restrict__ a, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) a[i] = static_cast<int>(i);
}

// Counts of v[p] in [0, m) (negative entries are skipped). Integer atomics: exact in any order.
__global__ void hist_kernel(const int* __restrict__ v, int64_t len, int m, bool use_shared,
                            unsigned long long* __restrict__ out) {
  extern __shared__ unsigned int sh_hist[];
  if (use_shared) {  // kernel argument: uniform over the block
    for (int o = threadIdx.x; o < m; o += blockDim.x) sh_hist[o] = 0u;
    __syncthreads();
  }
  for (int64_t p = thread_index(); p < len; p += thread_stride()) {
    const int o = v[p];
    if (o < 0 || o >= m) continue;
    if (use_shared) {
      atomicAdd(&sh_hist[o], 1u);
    } else {
      atomicAdd(&out[o], 1ull);
    }
  }
  if (use_shared) {
    __syncthreads();
    for (int o = threadIdx.x; o < m; o += blockDim.x) {
      if (sh_hist[o] != 0u) atomicAdd(&out[o], static_cast<unsigned long long>(sh_hist[o]));
    }
  }
}


__global__ void widen_kernel(const int* __restrict__ a, int64_t n, int64_t* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = a[i];
}


}  // namespace

// Histogram of v[0, len) over [0, m) into host int64 counts.
std::vector<int64_t> histogram(Ctx& ctx, DevArray<unsigned long long>& buf, const int* v, int64_t len, int m) {
  CK_CUDA(cudaMemsetAsync(buf.data(), 0, sizeof(unsigned long long) * static_cast<size_t>(m), ctx.stream));
  if (len > 0) {
    const bool use_shared = m <= kSharedHistMax;
    const size_t shmem = use_shared ? sizeof(unsigned) * static_cast<size_t>(m) : 0;
    hist_kernel<<<blocks_for(len, kThreads, 1024), kThreads, shmem, ctx.stream>>>(v, len, m, use_shared, buf.data());
    CK_LAUNCH("hist_kernel");
  }
  std::vector<unsigned long long> h(m);
  ctx.to_host(h.data(), buf.data(), static_cast<size_t>(m));
  ctx.sync();
  return std::vector<int64_t>(h.begin(), h.end());
}


template <typename KeyT>
void sort_pairs(Ctx& ctx, const KeyT* kin, KeyT* kout, const int* vin, int* vout, int64_t count, int end_bit) {
  if (count <= 0) return;
  size_t bytes = 0;
  const int num = static_cast<int>(count);
  CK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, bytes, kin, kout, vin, vout, num, 0, end_bit, ctx.stream));
  void* tmp = ctx.cub_storage(bytes);
  CK_CUDA(cub::DeviceRadixSort::SortPairs(tmp, bytes, kin, kout, vin, vout, num, 0, end_bit, ctx.stream));
}

template void sort_pairs<double>(Ctx&, const double*, double*, const int*, int*, int64_t, int);
template void sort_pairs<unsigned>(Ctx&, const unsigned*, unsigned*, const int*, int*, int64_t, int);

void fill_iota(Ctx& ctx, int* a, int64_t n) {
  iota_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(a, n);
  CK_LAUNCH("iota_kernel");
}

void widen(Ctx& ctx, const int* a, int64_t n, int64_t* out) {
  widen_kernel<<<blocks_for(n), kThreads, 0, ctx.stream>>>(a, n, out);
  CK_LAUNCH("widen_kernel");
}

}  // namespace cuda
}  // namespace cluster_kernels
