// No CPU counterpart: the device forms of common/auction_objects.h (the CPU uses that header alone).
// Device-side pieces of the eviction auction (the counterpart of csrc/cpu/auction_objects.h, whose host-side
// Objects, place_dummies and EpsSchedule the CUDA auction uses as they are): the cheapest object of a point,
// zeros of one sign, an atomic min of doubles, and the segments of over-full objects handed to the device.
#pragma once

#include <math_constants.h>

#include <cstdint>

namespace cluster_kernels {
namespace cuda {

// -0.0 -> +0.0: every zero gets one bit pattern, so a zero's sign can never depend on the order in
// which a min over arrivals was taken.
__device__ __forceinline__ double canon(double v) { return v == 0.0 ? 0.0 : v; }

// Cheapest object for the point whose cost row is Di, other than `exclude`; the lowest index wins
// ties (the CPU's best_cluster / best_of). Object o's cost is Di[cl[o]] + prices[o].
__device__ __forceinline__ int best_object(const double* Di, const int* cl, const double* prices, int m, int exclude,
                                           double* best_cost) {
  int b = -1;
  double bc = CUDART_INF;
  for (int o = 0; o < m; ++o) {
    if (o == exclude) continue;
    const double c = __dadd_rn(Di[cl[o]], prices[o]);
    if (c < bc) {
      bc = c;
      b = o;
    }
  }
  *best_cost = bc;
  return b;
}

// Values only ever decrease, so a stale first read costs at most one extra compare-and-swap.
__device__ __forceinline__ void atomic_min_double(double* addr, double val) {
  unsigned long long* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a;
  while (val < __longlong_as_double(static_cast<long long>(old))) {
    const unsigned long long assumed = old;
    old = atomicCAS(a, assumed, static_cast<unsigned long long>(__double_as_longlong(val)));
    if (old == assumed) break;
  }
}

// One over-full object: its members occupy sorted positions [off, off + size), ordered by
// (regret, index); `excess` units leave, real members or its `ndum` dummy units (regret rho).
struct SegmentIn {
  int64_t off, size, excess, ndum;
  double rho;
  int scanned;  // 0: the members were not scanned (only dummies leave; the host decides)
};

struct SegmentOut {
  int64_t nr, nd;    // real members and dummy units that leave
  double last;       // regret of the last unit that leaves
  double rest_min;   // smallest regret among the members that stay (inf if none)
  int error;
};

}  // namespace cuda
}  // namespace cluster_kernels
