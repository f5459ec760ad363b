// No CPU counterpart: device memory, the caller's stream and launch geometry (the CPU has cpu/thread_scope.h).
// Device memory, the caller's stream, launch geometry and the small device helpers every CUDA file of the
// K-means uses (the CUDA counterpart of csrc/cpu/thread_scope.h and the helpers at the top of kmeans.cpp).
// Host code here is plain C++ (inline); the shared kernels (histogram, iota, widening, radix sort) are in
// device_utils.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cluster_kernels {
namespace cuda {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kThreads = 256;  // every kernel's block size (the tree reductions assume it)
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kSumItems = 8;  // points per thread in a summation tile
constexpr int64_t kSumTile = int64_t{kThreads} * kSumItems;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr int kSharedHistMax = 8192;             // objects counted in shared memory (32 KiB)

[[noreturn]] inline void cuda_fail(cudaError_t err, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error: ") + call + " failed: " + cudaGetErrorString(err) + " (" +
                           file + ":" + std::to_string(line) + ")");
}

#define CK_CUDA(call)                                                             \
  do {                                                                            \
    const cudaError_t ck_err_ = (call);                                           \
    if (ck_err_ != cudaSuccess) cuda_fail(ck_err_, #call, __FILE__, __LINE__);    \
  } while (0)

#define CK_LAUNCH(name)                                                                   \
  do {                                                                                    \
    const cudaError_t ck_err_ = cudaGetLastError();                                       \
    if (ck_err_ != cudaSuccess) cuda_fail(ck_err_, "launch of " name, __FILE__, __LINE__); \
  } while (0)

inline unsigned blocks_for(int64_t items, int64_t per_block = kThreads, int64_t cap = kMaxBlocks) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(b, cap)));
}

inline int64_t tiles_for(int64_t n) { return (n + kSumTile - 1) / kSumTile; }

// Rows per reduction chunk of the CPU code (csrc/cpu/kmeans.cpp: chunk_rows).
inline int64_t chunk_rows(int64_t n) { return std::max<int64_t>(2048, (n + 255) / 256); }

inline int radix_bits(int64_t values) {
  int bits = 1;
  while ((int64_t{1} << bits) < values) ++bits;
  return bits;
}

// ------------------------------------------------------------------------------------------------
// Device memory, stream and device scope
// ------------------------------------------------------------------------------------------------

class DevMem {
 public:
  DevMem() = default;
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept { swap(o); }
  DevMem& operator=(DevMem&& o) noexcept {
    swap(o);
    return *this;
  }
  ~DevMem() { release(); }

  void allocate(size_t bytes, cudaStream_t stream, bool pools) {
    release();
    stream_ = stream;
    pools_ = pools;
    if (bytes == 0) return;
    if (pools) {
      CK_CUDA(cudaMallocAsync(&ptr_, bytes, stream));
    } else {
      CK_CUDA(cudaMalloc(&ptr_, bytes));
    }
    bytes_ = bytes;
  }
  void release() noexcept {
    if (ptr_ != nullptr) {
      // Stream-ordered: kernels queued before still see the memory. Errors cannot be reported here.
      if (pools_) {
        (void)cudaFreeAsync(ptr_, stream_);
      } else {
        (void)cudaFree(ptr_);
      }
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void swap(DevMem& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(stream_, o.stream_);
    std::swap(pools_, o.pools_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  bool pools_ = false;
};

template <typename T>
class DevArray {
 public:
  DevArray() = default;
  T* data() const { return static_cast<T*>(mem_.get()); }
  size_t size() const { return size_; }
  void swap(DevArray& o) noexcept {
    mem_.swap(o.mem_);
    std::swap(size_, o.size_);
  }

 private:
  friend struct Ctx;
  DevMem mem_;
  size_t size_ = 0;
};

// Restores the caller's current device on exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    CK_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) {
      CK_CUDA(cudaSetDevice(device));
      changed_ = true;
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (changed_) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// The caller's stream and the helpers every step uses. All work and all allocations are ordered on
// that stream, so the caller (torch's current stream) sees the outputs in order.
struct Ctx {
  cudaStream_t stream;
  bool pools = false;
  DevMem cub_tmp;

  Ctx(uintptr_t s, int device) : stream(reinterpret_cast<cudaStream_t>(s)) {
    int supported = 0;
    CK_CUDA(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    pools = supported != 0;
  }

  template <typename T>
  DevArray<T> alloc(size_t n) {
    DevArray<T> a;
    a.mem_.allocate(std::max<size_t>(n, 1) * sizeof(T), stream, pools);
    a.size_ = n;
    return a;
  }
  // CUB treats a null temporary pointer as a size query, so the buffer is never empty.
  void* cub_storage(size_t bytes) {
    bytes = std::max<size_t>(bytes, 256);
    if (bytes > cub_tmp.bytes()) cub_tmp.allocate(bytes, stream, pools);
    return cub_tmp.get();
  }
  void sync() { CK_CUDA(cudaStreamSynchronize(stream)); }
  template <typename T>
  void to_device(T* dst, const T* src, size_t n) {
    if (n) CK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  template <typename T>
  void to_host(T* dst, const T* src, size_t n) {
    if (n) CK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  }
  template <typename T>
  void copy(T* dst, const T* src, size_t n) {
    if (n) CK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }
  template <typename T>
  T read(const T* src) {
    T v;
    to_host(&v, src, 1);
    sync();
    return v;
  }
};

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t thread_index() { return int64_t{blockIdx.x} * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t thread_stride() { return int64_t{gridDim.x} * blockDim.x; }
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// ------------------------------------------------------------------------------------------------
// Shared launches (device_utils.cu)
// ------------------------------------------------------------------------------------------------

// Histogram of v[0, len) over [0, m) into host int64 counts (entries outside [0, m) are skipped).
std::vector<int64_t> histogram(Ctx& ctx, DevArray<unsigned long long>& buf, const int* v, int64_t len, int m);

// Stable radix sort of (key, value) pairs on the low end_bit bits of the keys (KeyT: double or unsigned).
template <typename KeyT>
void sort_pairs(Ctx& ctx, const KeyT* kin, KeyT* kout, const int* vin, int* vout, int64_t count, int end_bit);

// a[i] = i for i in [0, n).
void fill_iota(Ctx& ctx, int* a, int64_t n);

// out[i] = a[i] widened to int64, for i in [0, n).
void widen(Ctx& ctx, const int* a, int64_t n, int64_t* out);

}  // namespace cuda
}  // namespace cluster_kernels
