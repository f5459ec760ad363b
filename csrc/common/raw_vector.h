// The allocator of the large work buffers and the vector that uses it (the CPU Lloyd loop's cost matrix and
// cluster sums, the floor auction's column copy in common/params.h's AuctionState).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace cluster_kernels {

// The allocator of the large work buffers (the cost matrix and its column copy, the cluster sums):
// - its value-initialisation is default-initialisation: resize() of a buffer about to be written in full leaves it
//   unwritten, which saves a zeroing pass (and its pages are first touched by the threads that fill them);
// - buffers of 4 MiB or more are 2 MiB-aligned and advised as huge pages (Linux): a fresh n x d copy otherwise
//   costs one page fault, and one kernel zeroing, per 4 KiB, which on virtual machines took as long as a Lloyd
//   iteration's GEMM at n = 200 000, d = 256.
template <class T>
struct DefaultInitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <class U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  static constexpr size_t kHugePage = size_t{2} << 20;
  static bool large(size_t count) { return count * sizeof(T) >= 2 * kHugePage; }
  T* allocate(size_t count) {
    if (!large(count)) return std::allocator<T>::allocate(count);
    const size_t bytes = count * sizeof(T);
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without transparent huge pages nothing changes
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t count) {
    if (large(count))
      free(p);
    else
      std::allocator<T>::deallocate(p, count);
  }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <class T>
using RawVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace cluster_kernels
