// No CUDA counterpart: the device path has no thread count; its stream and device scope are in cuda/device_utils.cuh.
// The OpenMP thread count of one native call, restored afterwards.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#endif

namespace cluster_kernels {

// Sets the OpenMP thread count for one call (n <= 0: the OpenMP default) and restores it afterwards.
class ThreadScope {
 public:
  explicit ThreadScope(int n) {
#ifdef _OPENMP
    prev_ = omp_get_max_threads();
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
  }
  ~ThreadScope() {
#ifdef _OPENMP
    omp_set_num_threads(prev_);
#endif
  }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  int prev_ = 1;
};

}  // namespace cluster_kernels
