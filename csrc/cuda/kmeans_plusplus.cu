// Greedy k-means++ on the device (kmeans_plusplus.cuh). The CPU counterpart is cpu/kmeans_plusplus.cpp.
#include "cuda/kmeans_plusplus.cuh"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cuda/distance_tiles.cuh"

namespace cluster_kernels {
namespace cuda {

namespace {

// std::min(closest[i], cand[i * trials + t]) of the CPU: the first argument unless the second is smaller.
__device__ __forceinline__ double min_of(double a, double b) { return b < a ? b : a; }

struct MinColumnTerm {  // min(closest[i], cand[i, t]): the potential of candidate t
  const double* closest;
  const double* cand;
  int64_t trials, t;
  __device__ double operator()(int64_t i) const { return min_of(closest[i], cand[i * trials + t]); }
};

__global__ void min_column_kernel(const double* __restrict__ closest, const double* __restrict__ cand, int64_t n,
                                  int64_t trials, int64_t t, double* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = min_of(closest[i], cand[i * trials + t]);
}

// The candidates' rows and squared norms, gathered so one distance pass serves all of them.
template <typename T>
__global__ void gather_rows_kernel(const T* __restrict__ xp, const double* __restrict__ xnorm, int64_t d,
                                   const int64_t* __restrict__ rows, int64_t count, T* __restrict__ out,
                                   double* __restrict__ out_norm) {
  for (int64_t g = thread_index(); g < count * d; g += thread_stride()) {
    const int64_t r = g / d, t = g - r * d;
    out[g] = xp[rows[r] * d + t];
    if (t == 0) out_norm[r] = xnorm[rows[r]];
  }
}

// The CPU draws upper_bound(cum, r) on the running sum of the weights w. Here the running sum is
// P[b] (tile prefix) plus the in-order sum inside tile b: find the first tile whose end exceeds r,
// then walk it. If rounding leaves r beyond the walk, take the tile's last point of positive weight.
__global__ void kpp_search_kernel(const double* __restrict__ w, int64_t n, const double* __restrict__ P,
                                  int64_t ntiles, const double* __restrict__ rs, int trials, int64_t* __restrict__ out) {
  for (int t = static_cast<int>(thread_index()); t < trials; t += static_cast<int>(thread_stride())) {
    const double r = rs[t];
    int64_t lo = 0, hi = ntiles;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (P[mid + 1] > r) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    int64_t pick = n - 1;
    if (lo < ntiles) {
      const int64_t begin = lo * kSumTile, end = imin(n, begin + kSumTile);
      double run = P[lo];
      int64_t last_positive = end - 1, found = -1;
      for (int64_t i = begin; i < end; ++i) {
        const double wi = w[i];
        if (wi > 0.0) last_positive = i;
        run = __dadd_rn(run, wi);
        if (run > r) {
          found = i;
          break;
        }
      }
      pick = found >= 0 ? found : last_positive;
    }
    out[t] = imin(pick, n - 1);
  }
}

// Greedy k-means++ (the CPU's kmeans_plusplus): the buffers of one seeding and its two steps per centre.
template <typename T>
class PlusPlus {
 public:
  PlusPlus(Ctx& ctx, const Prepared<T>& p, int64_t n, int64_t d, int trials, Reducer& red)
      : ctx_(ctx), p_(p), n_(n), d_(d), trials_(trials), red_(red), b0_(ctx.alloc<double>(n)),
        b1_(ctx.alloc<double>(n)), cand_d_(ctx.alloc<double>(static_cast<size_t>(n) * trials)),
        cand_rows_(ctx.alloc<T>(static_cast<size_t>(trials) * d)), cand_norm_(ctx.alloc<double>(trials)),
        P_(ctx.alloc<double>(static_cast<size_t>(tiles_for(n) + 1))), rs_dev_(ctx.alloc<double>(trials)),
        cands_dev_(ctx.alloc<int64_t>(trials)), rs_(trials), cands_(trials) {}

  // Distances to the first centre, row `first`.
  void start(int64_t first) {
    launch_sqdist<T>(ctx_, p_.x.data(), p_.xnorm.data(), n_, d_, p_.x.data() + first * d_, p_.xnorm.data() + first, 1,
                     closest_);
  }

  // Draws the candidates of the next centre, measures them in one pass over the data (as the CPU) and keeps the
  // one of lowest potential; returns its row.
  int64_t next(SplitMix64& rng) {
    draw(rng);
    gather_rows_kernel<T><<<blocks_for(trials_ * d_), kThreads, 0, ctx_.stream>>>(
        p_.x.data(), p_.xnorm.data(), d_, cands_dev_.data(), trials_, cand_rows_.data(), cand_norm_.data());
    CK_LAUNCH("gather_rows_kernel");
    launch_sqdist<T>(ctx_, p_.x.data(), p_.xnorm.data(), n_, d_, cand_rows_.data(), cand_norm_.data(), trials_,
                     cand_d_.data());
    double best_pot = kInf;
    int best_t = -1;
    for (int t = 0; t < trials_; ++t) {
      const double pot = red_.sum(MinColumnTerm{closest_, cand_d_.data(), trials_, t}, n_);
      if (pot < best_pot) {
        best_pot = pot;
        best_t = t;
      }
    }
    if (best_t < 0) throw std::runtime_error("capacity_kmeans: k-means++ found no candidate (internal error)");
    min_column_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(closest_, cand_d_.data(), n_, trials_, best_t,
                                                                    best_d_);
    CK_LAUNCH("min_column_kernel");
    std::swap(closest_, best_d_);
    return cands_[best_t];
  }

 private:
  Ctx& ctx_;
  const Prepared<T>& p_;
  const int64_t n_, d_;
  const int trials_;
  Reducer& red_;
  DevArray<double> b0_, b1_, cand_d_;
  DevArray<T> cand_rows_;
  DevArray<double> cand_norm_, P_, rs_dev_;
  DevArray<int64_t> cands_dev_;
  std::vector<double> rs_;
  std::vector<int64_t> cands_;
  double* closest_ = b0_.data();
  double* best_d_ = b1_.data();

  // The candidates: upper_bound of splitmix64 draws on the running sum of the closest distances.
  void draw(SplitMix64& rng) {
    const double total = red_.prefix(ArrayTerm{closest_}, n_, P_.data());
    for (int t = 0; t < trials_; ++t) rs_[t] = rng.uniform() * total;
    ctx_.to_device(rs_dev_.data(), rs_.data(), rs_.size());
    kpp_search_kernel<<<1, 32, 0, ctx_.stream>>>(closest_, n_, P_.data(), tiles_for(n_), rs_dev_.data(), trials_,
                                                 cands_dev_.data());
    CK_LAUNCH("kpp_search_kernel");
    ctx_.to_host(cands_.data(), cands_dev_.data(), cands_.size());
    ctx_.sync();
  }
};

}  // namespace

template <typename T>
std::vector<double> kmeans_plusplus(Ctx& ctx, const Prepared<T>& p, int64_t n, int64_t d, int64_t k, SplitMix64& rng,
                                    Reducer& red) {
  const int trials = 2 + static_cast<int>(std::log(static_cast<double>(k)));
  std::vector<double> centers(static_cast<size_t>(k) * d);
  auto put = [&](int64_t j, int64_t row) {
    const std::vector<double> v = device_row(ctx, p, d, row);
    std::copy(v.begin(), v.end(), centers.begin() + j * d);
  };
  const int64_t first = std::min<int64_t>(static_cast<int64_t>(rng.uniform() * static_cast<double>(n)), n - 1);
  put(0, first);
  PlusPlus<T> pp(ctx, p, n, d, trials, red);
  pp.start(first);
  for (int64_t j = 1; j < k; ++j) put(j, pp.next(rng));
  return centers;
}

template std::vector<double> kmeans_plusplus<float>(Ctx&, const Prepared<float>&, int64_t, int64_t, int64_t, SplitMix64&,
                                                   Reducer&);
template std::vector<double> kmeans_plusplus<double>(Ctx&, const Prepared<double>&, int64_t, int64_t, int64_t, SplitMix64&,
                                                   Reducer&);

}  // namespace cuda
}  // namespace cluster_kernels
