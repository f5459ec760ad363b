// Capacity-constrained K-means on the CPU: eviction auction + Lloyd iterations + k-means++.
// See kmeans.h and the module docstring of cluster_kernels/kmeans.py for the algorithm.
#include "cpu/kmeans.h"

#include "cpu/auction_objects.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
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

using auction::cheapest_dummy_object;
using auction::EpsSchedule;
using auction::Objects;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Sets the OpenMP thread count for one call and restores it afterwards.
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

 private:
  int prev_ = 1;
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
          out[(i + p) * k + j0 + w] = v > 0.0 ? v : 0.0;
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
    out[i] = v > 0.0 ? v : 0.0;
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

// Distances of all rows of x to k centroids c (k, d) row-major. For k > 1 the centroids are first
// transposed into a zero-padded (d, kp) panel.
template <typename T>
void sqdist(const T* x, const double* xnorm, int64_t n, int64_t d, const T* c, const double* cnorm, int64_t k,
            double* out) {
  constexpr int64_t kBlock = 64;
  const int64_t kp = k == 1 ? 1 : (k + tile_width<T>() - 1) / tile_width<T>() * tile_width<T>();
  std::vector<T> panel;
  const T* ct = c;
  if (k > 1) {
    panel.assign(static_cast<size_t>(d) * kp, T(0));
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < d; ++t) panel[t * kp + j] = c[j * d + t];
    ct = panel.data();
  }
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    sqdist_block(x, xnorm, b * kBlock, std::min(n, (b + 1) * kBlock), d, ct, kp, cnorm, k, out);
  }
}

template <typename T>
double row_sqnorm(const T* v, int64_t d) {
  double s = 0.0;
  for (int64_t t = 0; t < d; ++t) s += static_cast<double>(v[t]) * static_cast<double>(v[t]);
  return s;
}

// ------------------------------------------------------------------------------------------------
// The eviction auction.
// ------------------------------------------------------------------------------------------------


std::vector<int64_t> count_objects(const std::vector<int32_t>& obj, int64_t m) {
  const int64_t n = static_cast<int64_t>(obj.size());
  std::vector<int64_t> counts(m, 0);
#pragma omp parallel
  {
    std::vector<int64_t> local(m, 0);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) ++local[obj[i]];
#pragma omp critical
    for (int64_t o = 0; o < m; ++o) counts[o] += local[o];  // integers: order does not matter
  }
  return counts;
}


EpsSchedule eps_schedule(const double* D, int64_t n, int64_t k, const std::vector<double>& prices, bool warm,
                         const AuctionParams& ap) {
  double span = 0.0, amax = 0.0;
#pragma omp parallel for schedule(static) reduction(max : span, amax)
  for (int64_t i = 0; i < n; ++i) {
    double lo_v = kInf, hi_v = -kInf;
    for (int64_t j = 0; j < k; ++j) {
      lo_v = std::min(lo_v, D[i * k + j]);
      hi_v = std::max(hi_v, D[i * k + j]);
    }
    span = std::max(span, hi_v - lo_v);
    amax = std::max(amax, std::max(std::fabs(lo_v), std::fabs(hi_v)));
  }
  if (!(span > 0.0)) span = 1.0;
  double pmax = 0.0;
  for (double p : prices) pmax = std::max(pmax, std::fabs(p));
  // Below a few ulps of the costs, eps increments would vanish and the auction would never end.
  const double eps_final = std::max(ap.eps_final * span, 64.0 * DBL_EPSILON * (amax + pmax + span));
  return {std::max((warm ? ap.eps_warm : ap.eps_start) * span, eps_final), eps_final};
}

// Cheapest cluster for point i other than `exclude` (the lowest index wins ties).
inline int64_t best_cluster(const double* Di, const double* prices, int64_t k, int64_t exclude, double* best_cost) {
  int64_t b = -1;
  double bc = kInf;
  for (int64_t j = 0; j < k; ++j) {
    if (j == exclude) continue;
    const double c = Di[j] + prices[j];
    if (c < bc) {
      bc = c;
      b = j;
    }
  }
  *best_cost = bc;
  return b;
}

// The relaxed problem size_j <= hi_j (no lower bounds), in the "floor" form of the dual: prices are
// >= 0 and a cluster with a positive price must be exactly full. Forward rounds keep that true
// (members leave only by eviction, exactly the excess), and each eps phase restarts from the exact
// argmin after dropping to 0 the price of any under-full cluster. No dummy units, so slack capacity
// costs nothing: an arrival at a cluster with room is simply absorbed.
int64_t floor_auction(const double* D, int64_t n, int64_t k, const int64_t* hi, std::vector<double>& prices,
                      int32_t* obj, const AuctionParams& ap) {
  const bool warm = static_cast<int64_t>(prices.size()) == k;
  if (!warm) prices.assign(k, 0.0);
  EpsSchedule es = eps_schedule(D, n, k, prices, warm, ap);
  double eps = es.eps;
  int64_t slack = -n;
  for (int64_t j = 0; j < k; ++j) slack += hi[j];
  std::vector<int64_t> counts(k);
  auto recount = [&]() {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++counts[obj[i]];
  };
  std::vector<double> gap(n);
  std::vector<int64_t> cand;
  // Phase start: every point takes its exact argmin. A cluster left below its cap with a positive
  // price then lowers its price just enough to pull in its deficit (a reverse-auction step: the
  // points with the smallest extra cost come, and every other point stays within eps of its best);
  // a price that would go below 0 stops at 0, where being under-full is allowed. Zeroing the price
  // outright instead would throw away what earlier phases learnt and restart price wars.
  // The first phase starts from the exact argmin; later phases move only the points that violate
  // the new eps (everyone else already sits within it), which keeps most of the previous phase's work.
  auto start = [&](bool first) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      double bc;
      const int64_t b = best_cluster(D + i * k, prices.data(), k, -1, &bc);
      if (first || D[i * k + obj[i]] + prices[obj[i]] > bc + eps) obj[i] = static_cast<int32_t>(b);
    }
    recount();
    if (slack <= 0) return;
    for (int64_t pass = 0;; ++pass) {
      bool changed = false;
      for (int64_t j = 0; j < k; ++j) {
        if (counts[j] >= hi[j] || prices[j] <= 0.0) continue;
        changed = true;
        if (pass >= 4 * k) {  // safety net: plain zeroing always terminates
          prices[j] = 0.0;
          continue;
        }
        const int64_t r = hi[j] - counts[j];
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t o = obj[i];
          gap[i] = o == j ? kInf : (D[i * k + j] + prices[j]) - (D[i * k + o] + prices[o]);
        }
        cand.resize(n);
        std::iota(cand.begin(), cand.end(), 0);
        auto by_gap = [&](int64_t a, int64_t b) { return gap[a] < gap[b] || (gap[a] == gap[b] && a < b); };
        std::nth_element(cand.begin(), cand.begin() + (r - 1), cand.end(), by_gap);
        std::sort(cand.begin(), cand.begin() + r, by_gap);
        const double drop = gap[cand[r - 1]] + eps;
        int64_t pulled = r;
        if (drop >= prices[j]) {
          // The price stops at 0: only points that now strictly prefer j by more than eps move.
          const double d0 = prices[j];
          prices[j] = 0.0;
          pulled = 0;
          while (pulled < r && gap[cand[pulled]] - d0 < -eps) ++pulled;
        } else {
          prices[j] -= drop;
        }
        for (int64_t e = 0; e < pulled; ++e) {
          --counts[obj[cand[e]]];
          obj[cand[e]] = static_cast<int32_t>(j);
        }
        counts[j] += pulled;
      }
      if (!changed) return;
      if (pass >= 4 * k) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
          double bc;
          obj[i] = static_cast<int32_t>(best_cluster(D + i * k, prices.data(), k, -1, &bc));
        }
        recount();
      }
    }
  };
  start(true);
  std::vector<double> regret(n);
  std::vector<int64_t> slot(k);
  std::vector<std::vector<int64_t>> members;
  int64_t rounds = 0;
  for (;;) {
    for (;;) {
      std::vector<int64_t> over;
      for (int64_t j = 0; j < k; ++j) {
        slot[j] = -1;
        if (counts[j] > hi[j]) {
          slot[j] = static_cast<int64_t>(over.size());
          over.push_back(j);
        }
      }
      if (over.empty()) break;
      if (++rounds > ap.max_rounds) throw std::runtime_error("floor_auction: no termination (internal error)");
      const int64_t nover = static_cast<int64_t>(over.size());
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = obj[i];
        if (slot[j] < 0) continue;
        double sc;
        best_cluster(D + i * k, prices.data(), k, j, &sc);
        regret[i] = sc - (D[i * k + j] + prices[j]);
      }
      if (static_cast<int64_t>(members.size()) < nover) members.resize(nover);
      for (int64_t s = 0; s < nover; ++s) members[s].clear();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slot[obj[i]];
        if (s >= 0) members[s].push_back(i);
      }
      std::vector<double> new_price(nover);
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t s = 0; s < nover; ++s) {
        const int64_t j = over[s];
        std::vector<int64_t>& mem = members[s];
        const int64_t excess = counts[j] - hi[j];
        auto by_regret = [&](int64_t a, int64_t b) {
          return regret[a] < regret[b] || (regret[a] == regret[b] && a < b);
        };
        // The `excess` smallest (regret, index) leave; the price rises past the last of them.
        std::nth_element(mem.begin(), mem.begin() + (excess - 1), mem.end(), by_regret);
        new_price[s] = prices[j] + regret[mem[excess - 1]] + eps;
      }
      for (int64_t s = 0; s < nover; ++s) {
        prices[over[s]] = new_price[s];
        counts[over[s]] -= counts[over[s]] - hi[over[s]];
      }
      // Evicted points re-bid at the new prices, so no point sits more than eps from its best.
      std::vector<int64_t> moved;
      for (int64_t s = 0; s < nover; ++s) {
        const int64_t excess = static_cast<int64_t>(members[s].size()) - hi[over[s]];
        moved.insert(moved.end(), members[s].begin(), members[s].begin() + excess);
      }
      const int64_t nm = static_cast<int64_t>(moved.size());
#pragma omp parallel for schedule(static) if (nm > 4096)
      for (int64_t e = 0; e < nm; ++e) {
        double bc;
        obj[moved[e]] = static_cast<int32_t>(best_cluster(D + moved[e] * k, prices.data(), k, -1, &bc));
      }
      for (int64_t e = 0; e < nm; ++e) ++counts[obj[moved[e]]];
    }
    if (eps <= es.eps_final) break;
    eps = std::max(eps / ap.eps_shrink, es.eps_final);
    start(false);
  }
  return rounds;
}

// The general problem lo_j <= size_j <= hi_j: each cluster is split into a mandatory object (lo
// slots, real points only) and an optional one (hi - lo slots), and sum(hi) - n zero-cost dummy
// units fill the optional slots that real points leave free, so every object ends exactly full.
// A plain forward auction then applies; it is slower than the floor form when there is slack (the
// dummies trade places in eps steps), so it only runs when the lower bounds bind.
int64_t dummy_auction(const double* D, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                      std::vector<double>& prices, int64_t* labels, const AuctionParams& ap) {
  const Objects ob(lo, hi, k);
  const int64_t m = ob.size();
  const bool warm = static_cast<int64_t>(prices.size()) == m;
  if (!warm) prices.assign(m, 0.0);
  const EpsSchedule es = eps_schedule(D, n, k, prices, warm, ap);
  const double eps_final = es.eps_final;
  double eps = es.eps;

  const int64_t* cl = ob.cluster.data();
  auto cost = [&](int64_t i, int64_t o) { return D[i * k + cl[o]] + prices[o]; };
  // Cheapest object for point i other than `exclude`; the lowest index wins ties.
  auto best_of = [&](int64_t i, int64_t exclude, double* best_cost) {
    int64_t b = -1;
    double bc = kInf;
    for (int64_t o = 0; o < m; ++o) {
      if (o == exclude) continue;
      const double c = cost(i, o);
      if (c < bc) {
        bc = c;
        b = o;
      }
    }
    *best_cost = bc;
    return b;
  };

  std::vector<int32_t> obj(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    double bc;
    obj[i] = static_cast<int32_t>(best_of(i, -1, &bc));
  }
  std::vector<int64_t> real = count_objects(obj, m);
  int64_t n_dummy = -n;
  for (int64_t j = 0; j < k; ++j) n_dummy += hi[j];
  std::vector<int64_t> dummies = auction::place_dummies(prices, ob, real, n_dummy);

  std::vector<double> regret(n);
  std::vector<int64_t> slot(m, -1);
  // lb[o]: lower bound on the smallest regret among o's real members. It lets a round that only
  // evicts dummies skip the O(members * m) regret scan: rising prices elsewhere only raise regrets,
  // a raise of o's own price lowers them all by the same amount, and arrivals report theirs.
  std::vector<double> lb(m, -kInf);
  std::vector<std::vector<int64_t>> members;
  int64_t rounds = 0;

  for (;;) {
    for (;;) {  // auction rounds at this eps
      std::vector<int64_t> over;
      for (int64_t o = 0; o < m; ++o)
        if (real[o] + dummies[o] > ob.cap[o]) over.push_back(o);
      if (over.empty()) break;
      if (++rounds > ap.max_rounds) throw std::runtime_error("auction_assign: no termination (internal error)");
      const int64_t nover = static_cast<int64_t>(over.size());

      std::vector<int64_t> excess(nover), dst_dummy(nover);
      std::vector<double> rho(nover);
      bool any_scan = false;
      std::fill(slot.begin(), slot.end(), -1);
      for (int64_t s = 0; s < nover; ++s) {
        const int64_t o = over[s];
        excess[s] = real[o] + dummies[o] - ob.cap[o];
        dst_dummy[s] = cheapest_dummy_object(prices, ob, o);
        rho[s] = (dummies[o] > 0 && dst_dummy[s] >= 0) ? prices[dst_dummy[s]] - prices[o] : kInf;
        if (!(excess[s] <= dummies[o] && rho[s] <= lb[o])) {
          slot[o] = s;
          any_scan = true;
        }
      }
      if (static_cast<int64_t>(members.size()) < nover) members.resize(nover);
      for (int64_t s = 0; s < nover; ++s) members[s].clear();
      if (any_scan) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t o = obj[i];
          if (slot[o] < 0) continue;
          double sc;
          best_of(i, o, &sc);
          regret[i] = sc - cost(i, o);
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t s = slot[obj[i]];
          if (s >= 0) members[s].push_back(i);
        }
      }

      std::vector<double> new_price(nover), new_lb(nover);
      std::vector<int64_t> n_real(nover), n_dum(nover);
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t s = 0; s < nover; ++s) {
        const int64_t o = over[s];
        int64_t nr = 0, nd = 0;
        double last = -kInf, rest_min = lb[o];
        if (slot[o] < 0) {  // only dummies leave: rho <= every real member's regret
          nd = excess[s];
          last = rho[s];
        } else {
          std::vector<int64_t>& mem = members[s];
          const int64_t size = static_cast<int64_t>(mem.size());
          const int64_t take = std::min(excess[s], size);
          auto by_regret = [&](int64_t a, int64_t b) {
            return regret[a] < regret[b] || (regret[a] == regret[b] && a < b);
          };
          std::partial_sort(mem.begin(), mem.begin() + take, mem.end(), by_regret);
          for (int64_t e = 0; e < excess[s]; ++e) {
            // Dummies go first on equal regret.
            if (nd < dummies[o] && (nr >= size || rho[s] <= regret[mem[nr]])) {
              ++nd;
              last = rho[s];
            } else {
              last = regret[mem[nr]];
              ++nr;
            }
          }
          rest_min = kInf;
          for (int64_t e = nr; e < size; ++e) rest_min = std::min(rest_min, regret[mem[e]]);
        }
        const double delta = last + eps;
        new_price[s] = prices[o] + delta;
        new_lb[s] = rest_min - delta;
        n_real[s] = nr;
        n_dum[s] = nd;
      }
      for (int64_t s = 0; s < nover; ++s) {
        const int64_t o = over[s];
        if (!std::isfinite(new_price[s])) throw std::runtime_error("auction_assign: infinite price (internal error)");
        prices[o] = new_price[s];
        lb[o] = new_lb[s];
        real[o] -= n_real[s];
        dummies[o] -= n_dum[s];
      }
      // Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best.
      std::vector<int64_t> moved;
      for (int64_t s = 0; s < nover; ++s)
        if (slot[over[s]] >= 0) moved.insert(moved.end(), members[s].begin(), members[s].begin() + n_real[s]);
      const int64_t nm = static_cast<int64_t>(moved.size());
      std::vector<double> arrival_regret(nm);
#pragma omp parallel for schedule(static) if (nm > 4096)
      for (int64_t e = 0; e < nm; ++e) {
        const int64_t i = moved[e];
        double bc, sc;
        const int64_t b = best_of(i, -1, &bc);
        best_of(i, b, &sc);
        obj[i] = static_cast<int32_t>(b);
        arrival_regret[e] = sc - bc;
      }
      for (int64_t e = 0; e < nm; ++e) {
        const int64_t o = obj[moved[e]];
        ++real[o];
        lb[o] = std::min(lb[o], arrival_regret[e]);
      }
      int64_t dummy_total = 0;
      for (int64_t s = 0; s < nover; ++s) dummy_total += n_dum[s];
      if (dummy_total > 0) dummies[cheapest_dummy_object(prices, ob, -1)] += dummy_total;
    }
    if (eps <= eps_final) break;
    // Next phase: shrink eps and move every unit that violates it to its cheapest object.
    eps = std::max(eps / ap.eps_shrink, eps_final);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      double bc;
      const int64_t b = best_of(i, -1, &bc);
      if (cost(i, obj[i]) > bc + eps) obj[i] = static_cast<int32_t>(b);
    }
    real = count_objects(obj, m);
    std::fill(lb.begin(), lb.end(), -kInf);
    const int64_t cheapest = cheapest_dummy_object(prices, ob, -1);
    for (int64_t o = 0; o < m; ++o) {
      if (o != cheapest && dummies[o] > 0 && prices[o] > prices[cheapest] + eps) {
        dummies[cheapest] += dummies[o];
        dummies[o] = 0;
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) labels[i] = cl[obj[i]];
  return rounds;
}

}  // namespace

int64_t auction_assign(const double* D, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap) {
  if (ap.force_general) {
    state.used_general = true;
    return dummy_auction(D, n, k, lo, hi, state.general_prices, labels, ap);
  }
  std::vector<int32_t> obj(n);
  int64_t rounds = floor_auction(D, n, k, hi, state.floor_prices, obj.data(), ap);
  std::vector<int64_t> sizes(k, 0);
  for (int64_t i = 0; i < n; ++i) ++sizes[obj[i]];
  bool lower_ok = true;
  for (int64_t j = 0; j < k; ++j) lower_ok = lower_ok && sizes[j] >= lo[j];
  if (lower_ok) {
    // Optimal without the lower bounds and it meets them: optimal with them too.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) labels[i] = obj[i];
    state.used_general = false;
    return rounds;
  }
  state.used_general = true;
  return rounds + dummy_auction(D, n, k, lo, hi, state.general_prices, labels, ap);
}

// ------------------------------------------------------------------------------------------------
// Lloyd iterations.
// ------------------------------------------------------------------------------------------------

namespace {

// Centred (or unit-row) copy of x in T, its row norms, and the mean that was removed.
template <typename T>
struct Prepared {
  std::vector<T> x;
  std::vector<double> xnorm;
  std::vector<double> mean;
};

template <typename T>
Prepared<T> prepare(const T* x, int64_t n, int64_t d, bool spherical) {
  Prepared<T> p;
  p.mean.assign(d, 0.0);
  p.x.resize(static_cast<size_t>(n) * d);
  p.xnorm.resize(n);
  if (!spherical) {
    const int64_t cs = chunk_rows(n);
    const int64_t nc = (n + cs - 1) / cs;
    std::vector<double> part(static_cast<size_t>(nc) * d, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nc; ++c) {
      double* acc = part.data() + c * d;
      for (int64_t i = c * cs; i < std::min(n, (c + 1) * cs); ++i)
        for (int64_t t = 0; t < d; ++t) acc[t] += static_cast<double>(x[i * d + t]);
    }
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t t = 0; t < d; ++t) p.mean[t] += part[c * d + t];
    for (int64_t t = 0; t < d; ++t) p.mean[t] /= static_cast<double>(n);
  }
  bool zero_row = false;
#pragma omp parallel for schedule(static) reduction(|| : zero_row)
  for (int64_t i = 0; i < n; ++i) {
    const T* src = x + i * d;
    T* dst = p.x.data() + i * d;
    if (spherical) {
      const double nrm = std::sqrt(row_sqnorm(src, d));
      if (nrm == 0.0) zero_row = true;
      const double inv = nrm > 0.0 ? 1.0 / nrm : 0.0;
      for (int64_t t = 0; t < d; ++t) dst[t] = static_cast<T>(static_cast<double>(src[t]) * inv);
    } else {
      for (int64_t t = 0; t < d; ++t) dst[t] = static_cast<T>(static_cast<double>(src[t]) - p.mean[t]);
    }
    p.xnorm[i] = row_sqnorm(dst, d);
  }
  if (zero_row) throw std::invalid_argument("capacity_kmeans: metric='cosine' needs non-zero rows");
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
  sqdist(p.x.data(), p.xnorm.data(), n, d, p.x.data() + r * d, p.xnorm.data() + r, 1, out.data());
}

template <typename T>
std::vector<double> kmeans_plusplus(const Prepared<T>& p, int64_t n, int64_t d, int64_t k, SplitMix64& rng) {
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
      std::copy(p.x.begin() + cands[t] * d, p.x.begin() + (cands[t] + 1) * d, cand_rows.begin() + t * d);
      cand_norm[t] = p.xnorm[cands[t]];
    }
    sqdist(p.x.data(), p.xnorm.data(), n, d, cand_rows.data(), cand_norm.data(), trials, cand_d.data());
    double best_pot = kInf;
    int best_t = -1;
    for (int t = 0; t < trials; ++t) {
      const double pot = chunked_sum(n, [&](int64_t i) { return std::min(closest[i], cand_d[i * trials + t]); });
      if (pot < best_pot) {
        best_pot = pot;
        best_t = t;
      }
    }
    const int64_t best_c = cands[best_t];
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) best_d[i] = std::min(closest[i], cand_d[i * trials + best_t]);
    put(j, best_c);
    closest.swap(best_d);
  }
  return centers;
}

// Cluster means (chunked double sums, fixed order); empty clusters re-seeded at the point farthest
// from its own centroid among clusters of size > 1, exactly as the reference does.
template <typename T>
void update_centroids(const Prepared<T>& p, int64_t n, int64_t d, int64_t k, const std::vector<int64_t>& labels,
                      std::vector<double> own, bool spherical, std::vector<double>& cent) {
  const int64_t cs = chunk_rows(n);
  const int64_t nc = (n + cs - 1) / cs;
  std::vector<double> part(static_cast<size_t>(nc) * k * d, 0.0);
  std::vector<int64_t> pcount(static_cast<size_t>(nc) * k, 0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nc; ++c) {
    double* acc = part.data() + c * k * d;
    int64_t* cnt = pcount.data() + c * k;
    for (int64_t i = c * cs; i < std::min(n, (c + 1) * cs); ++i) {
      const int64_t j = labels[i];
      ++cnt[j];
      const T* xi = p.x.data() + i * d;
      double* aj = acc + j * d;
      for (int64_t t = 0; t < d; ++t) aj[t] += static_cast<double>(xi[t]);
    }
  }
  std::vector<double> sums(static_cast<size_t>(k) * d, 0.0);
  std::vector<int64_t> counts(k, 0);
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t j = 0; j < k; ++j) {
      counts[j] += pcount[c * k + j];
      for (int64_t t = 0; t < d; ++t) sums[j * d + t] += part[(c * k + j) * d + t];
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] == 0) continue;
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = sums[j * d + t] / static_cast<double>(counts[j]);
  }
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] != 0) continue;
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
    const T* xi = p.x.data() + i * d;
    const double* c = cent.data() + labels[i] * d;
    double s = 0.0;
    for (int64_t t = 0; t < d; ++t) {
      const double diff = static_cast<double>(xi[t]) - c[t];
      s += diff * diff;
    }
    own[i] = s;
  }
  return chunked_sum(n, [&](int64_t i) { return own[i]; });
}

}  // namespace

template <typename T>
KMeansOutput capacity_kmeans_cpu(const T* x, int64_t n, int64_t d, const int64_t* lo, const int64_t* hi,
                                 const T* init, const KMeansParams& p) {
  ThreadScope threads(p.n_threads);
  const int64_t k = p.k;
  Prepared<T> prep = prepare(x, n, d, p.spherical);
  std::vector<double> dist(static_cast<size_t>(n) * k);
  std::vector<T> ct;
  std::vector<double> cn;

  KMeansOutput best;
  double best_final = kInf;
  std::vector<double> best_cent;
  const int runs = init ? 1 : p.n_init;
  for (int run = 0; run < runs; ++run) {
    std::vector<double> cent;
    if (init) {
      cent.resize(static_cast<size_t>(k) * d);
      for (int64_t j = 0; j < k; ++j)
        for (int64_t t = 0; t < d; ++t)
          cent[j * d + t] = static_cast<double>(init[j * d + t]) - prep.mean[t];
    } else {
      SplitMix64 rng(run_seed(p.seed, static_cast<uint64_t>(run)));
      cent = kmeans_plusplus(prep, n, d, k, rng);
    }
    if (p.spherical) normalise_rows(cent, k, d);

    AuctionState prices;
    std::vector<int64_t> labels, new_labels(n);
    std::vector<double> own(n), history;
    bool converged = false;
    int it = 0;
    int64_t rounds = 0;
    for (it = 1; it <= p.max_iter; ++it) {
      to_T(cent, k, d, ct, cn);
      sqdist(prep.x.data(), prep.xnorm.data(), n, d, ct.data(), cn.data(), k, dist.data());
      rounds += auction_assign(dist.data(), n, k, lo, hi, prices, new_labels.data());
      double cost = chunked_sum(n, [&](int64_t i) { return dist[i * k + new_labels[i]]; });
      if (!labels.empty()) {
        const double prev = chunked_sum(n, [&](int64_t i) { return dist[i * k + labels[i]]; });
        if (cost > prev) {
          new_labels = labels;
          cost = prev;
        }
      }
      const bool same = !labels.empty() && new_labels == labels;
      const double improved = history.empty() ? kInf : history.back() - cost;
      const double ref = history.empty() ? cost : history.back();
      labels = new_labels;
      history.push_back(cost);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) own[i] = dist[i * k + labels[i]];
      update_centroids(prep, n, d, k, labels, own, p.spherical, cent);
      if (same || improved <= p.tol * std::fabs(ref)) {
        converged = true;
        break;
      }
    }
    if (it > p.max_iter) it = p.max_iter;
    std::vector<double> exact;
    const double final_cost = exact_own_distances(prep, n, d, cent, labels, exact);
    if (final_cost < best_final) {
      best_final = final_cost;
      best.labels = labels;
      best.distances = exact;
      best.history = history;
      best.n_iter = it;
      best.converged = converged;
      best.auction_rounds = rounds;
      best_cent = cent;
    }
  }
  const double scale = p.spherical ? 0.5 : 1.0;  // |a - b|^2 = 2 (1 - cos) for unit vectors
  best.inertia = best_final * scale;
  for (double& v : best.distances) v *= scale;
  for (double& v : best.history) v *= scale;
  best.centroids.resize(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) best.centroids[j * d + t] = best_cent[j * d + t] + prep.mean[t];
  return best;
}

template <typename T>
void assign_with_capacity_cpu(const T* x, int64_t n, int64_t d, const T* centroids, int64_t k, const int64_t* lo,
                              const int64_t* hi, bool spherical, int n_threads, int64_t* labels, double* distances) {
  ThreadScope threads(n_threads);
  Prepared<T> prep = prepare(x, n, d, spherical);
  std::vector<double> cent(static_cast<size_t>(k) * d);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < d; ++t) cent[j * d + t] = static_cast<double>(centroids[j * d + t]) - prep.mean[t];
  if (spherical) normalise_rows(cent, k, d);
  std::vector<T> ct;
  std::vector<double> cn;
  to_T(cent, k, d, ct, cn);
  std::vector<double> dist(static_cast<size_t>(n) * k);
  sqdist(prep.x.data(), prep.xnorm.data(), n, d, ct.data(), cn.data(), k, dist.data());
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
                                              const int64_t*, bool, int, int64_t*, double*);
template void assign_with_capacity_cpu<double>(const double*, int64_t, int64_t, const double*, int64_t,
                                               const int64_t*, const int64_t*, bool, int, int64_t*, double*);

}  // namespace cluster_kernels
