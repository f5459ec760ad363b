// The eviction auction on the GPU (auction.cuh): csrc/cpu/auction.cpp moved onto the device step for step,
// with the same two classes, FloorAuction (upper bounds only) and DummyAuction (the general problem with dummy
// units), which run only when the lower bounds are not met by the floor solution.
//
// Parallel decomposition: per-point work (argmins, regrets, gaps, re-bids, phase starts) runs on the device with
// grid-stride loops; per-object state stays on the host. The members of the over-full objects that leave (the
// `excess` smallest (regret, index)): the members are compacted in index order (cub::DeviceSelect), stably
// radix-sorted by regret, then stably by object, so each object's members form one segment ordered by (regret,
// index); one thread per object then reads the CPU's eviction decision off its segment (closed form of the
// merge with dummy units, which go first on equal regret).
//
// Determinism and agreement with the CPU: no floating-point atomics and no order that depends on scheduling;
// every comparison and price update of auction.cpp is repeated with explicitly rounded intrinsics, so on the
// same cost matrix the labels are those of auction_assign.
#include "cuda/auction.cuh"

#include <math_constants.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

#include <cub/device/device_select.cuh>

namespace cluster_kernels {
namespace cuda {

using auction::cheapest_dummy_object;
using auction::EpsSchedule;
using auction::Objects;

namespace {

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

__global__ void argmin_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                              const double* __restrict__ prices, int m, int* __restrict__ obj) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    double bc;
    obj[i] = best_object(D + i * k, cl, prices, m, -1, &bc);
  }
}

// A 64-bit key per double that orders as the double (negative values included): an integer atomicMin then takes
// the double minimum, the same whatever the order of the updates. key_double inverts it (on the host).
__host__ __device__ __forceinline__ unsigned long long ordered_key(double v) {
  unsigned long long b;
  memcpy(&b, &v, sizeof b);
  return (b >> 63) ? ~b : (b | 0x8000000000000000ULL);
}
inline double key_double(unsigned long long key) {
  const unsigned long long b = (key >> 63) ? (key & 0x7FFFFFFFFFFFFFFFULL) : ~key;
  double v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// The floor auction's certificate (FloorAuction::certified of auction.cpp): per pair (own cluster a, other
// cluster c), the smallest reduced cost difference (D[i, c] + p[c]) - (D[i, a] + p[a]) below `reach`, as
// ordered keys (out starts at the key of +inf).
__global__ void slack_kernel(const double* __restrict__ D, int64_t n, int64_t k, const double* __restrict__ prices,
                             const int* __restrict__ obj, double reach, unsigned long long* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const double* Di = D + i * k;
    const int a = obj[i];
    const double own = __dadd_rn(Di[a], prices[a]);
    for (int64_t c = 0; c < k; ++c) {
      if (c == a) continue;
      const double g = __dsub_rn(__dadd_rn(Di[c], prices[c]), own);
      if (g < reach) atomicMin(out + a * k + c, ordered_key(g));
    }
  }
}

// Non-negative doubles order like their bit patterns, so an integer max is the double max. A row with a NaN,
// an Inf or a |cost| above auction::kMaxCost makes amax +inf: the host then refuses the cost matrix.
__global__ void __launch_bounds__(kThreads) span_kernel(const double* __restrict__ D, int64_t n, int64_t k,
                                                        unsigned long long* __restrict__ out) {
  __shared__ double sh_span[kThreads];
  __shared__ double sh_amax[kThreads];
  double span = 0.0, amax = 0.0;
  const double max_cost = auction::kMaxCost;
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    double lo_v = CUDART_INF, hi_v = -CUDART_INF;
    bool bad = false;
    for (int64_t j = 0; j < k; ++j) {
      const double v = D[i * k + j];
      bad = bad || !(fabs(v) <= max_cost);
      lo_v = v < lo_v ? v : lo_v;
      hi_v = hi_v < v ? v : hi_v;
    }
    if (bad) {
      amax = CUDART_INF;
      continue;
    }
    const double sp = __dsub_rn(hi_v, lo_v);
    span = span < sp ? sp : span;
    const double a = fmax(fabs(lo_v), fabs(hi_v));
    amax = amax < a ? a : amax;
  }
  sh_span[threadIdx.x] = span;
  sh_amax[threadIdx.x] = amax;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) {
      sh_span[threadIdx.x] = fmax(sh_span[threadIdx.x], sh_span[threadIdx.x + w]);
      sh_amax[threadIdx.x] = fmax(sh_amax[threadIdx.x], sh_amax[threadIdx.x + w]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicMax(&out[0], static_cast<unsigned long long>(__double_as_longlong(sh_span[0])));
    atomicMax(&out[1], static_cast<unsigned long long>(__double_as_longlong(sh_amax[0])));
  }
}

// Floor auction, phase start: extra cost of moving each point to cluster j (inf for j's members).
__global__ void gap_kernel(const double* __restrict__ D, int64_t n, int64_t k, const double* __restrict__ prices,
                           const int* __restrict__ obj, int j, double* __restrict__ key) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const int o = obj[i];
    double g = CUDART_INF;
    if (o != j) g = __dsub_rn(__dadd_rn(D[i * k + j], prices[j]), __dadd_rn(D[i * k + o], prices[o]));
    key[i] = canon(g);
  }
}

// skey: gaps in (gap, index) order. Writes the r-th smallest gap and how many points move: r, or
// when the price stops at 0 the prefix that prefers j by more than eps (gap - d0 is monotone in gap).
__global__ void pull_kernel(const double* __restrict__ skey, int64_t r, double price, double eps,
                            double* __restrict__ last_out, int64_t* __restrict__ pulled_out) {
  if (thread_index() != 0) return;
  const double last = skey[r - 1];
  int64_t pulled = r;
  if (__dadd_rn(last, eps) >= price) {
    int64_t lo = 0, hi = r;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (__dsub_rn(skey[mid], price) < -eps) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    pulled = lo;
  }
  *last_out = last;
  *pulled_out = pulled;
}

__global__ void move_kernel(const int* __restrict__ sidx, int64_t count, int j, int* __restrict__ obj,
                            int* __restrict__ old) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) {
    const int i = sidx[p];
    old[p] = obj[i];
    obj[i] = j;
  }
}

// Regret (second-best cost minus own cost) of the members of the objects with slot >= 0.
__global__ void regret_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                              const double* __restrict__ prices, int m, const int* __restrict__ obj,
                              const int* __restrict__ slot, double* __restrict__ reg,
                              unsigned char* __restrict__ flag) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const int o = obj[i];
    if (slot[o] < 0) {
      flag[i] = 0;
      continue;
    }
    const double* Di = D + i * k;
    double sc;
    best_object(Di, cl, prices, m, o, &sc);
    reg[i] = canon(__dsub_rn(sc, __dadd_rn(Di[cl[o]], prices[o])));
    flag[i] = 1;
  }
}

__global__ void gather_keys_kernel(const double* __restrict__ reg, const int* __restrict__ sel, int64_t count,
                                   double* __restrict__ out) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) out[p] = reg[sel[p]];
}

__global__ void gather_slots_kernel(const int* __restrict__ obj, const int* __restrict__ slot,
                                    const int* __restrict__ sidx, int64_t count, unsigned* __restrict__ out) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) out[p] = static_cast<unsigned>(slot[obj[sidx[p]]]);
}

// Closed form of the CPU's merge loop: "take a dummy if one is left and (no real member is left or
// rho <= the next member's regret), else the next member". With L = #members of regret < rho (a
// prefix), the reals of regret < rho leave first, then dummies, then the remaining reals.
__global__ void decide_kernel(const SegmentIn* __restrict__ in, int nseg, const double* __restrict__ reg,
                              const int* __restrict__ sidx, SegmentOut* __restrict__ out) {
  for (int s = static_cast<int>(thread_index()); s < nseg; s += static_cast<int>(thread_stride())) {
    const SegmentIn g = in[s];
    SegmentOut r{0, 0, -CUDART_INF, CUDART_INF, 0};
    if (g.scanned) {
      auto R = [&](int64_t p) { return reg[sidx[g.off + p]]; };
      if (g.ndum == 0) {
        r.nr = g.excess;
        r.last = g.excess <= g.size ? R(g.excess - 1) : CUDART_INF;
      } else {
        int64_t lo = 0, hi = g.size;
        while (lo < hi) {
          const int64_t mid = lo + (hi - lo) / 2;
          if (R(mid) < g.rho) {
            lo = mid + 1;
          } else {
            hi = mid;
          }
        }
        const int64_t L = lo;
        if (g.excess <= L) {
          r.nr = g.excess;
          r.last = R(g.excess - 1);
        } else {
          r.nd = g.ndum < g.excess - L ? g.ndum : g.excess - L;
          const int64_t rest = g.excess - L - r.nd;
          r.nr = L + rest;
          r.last = rest > 0 && r.nr <= g.size ? R(r.nr - 1) : g.rho;
        }
      }
      if (r.nr > g.size) {
        r.error = 1;  // more units leave than exist: an internal error, reported by the host
      } else {
        r.rest_min = r.nr < g.size ? R(r.nr) : CUDART_INF;
      }
    }
    out[s] = r;
  }
}

// Evicted members (the first take[s] of each segment) re-bid at the new prices. moved[p] is the new
// object (or -1) for the histogram of arrivals; arrival_min (optional) gets each arrival's regret.
__global__ void rebid_kernel(const double* __restrict__ D, int64_t k, const int* __restrict__ cl,
                             const double* __restrict__ prices, int m, const int* __restrict__ sidx,
                             const unsigned* __restrict__ sslot, int64_t count, const int64_t* __restrict__ seg_off,
                             const int64_t* __restrict__ take, int* __restrict__ obj, int* __restrict__ moved,
                             double* __restrict__ arrival_min) {
  for (int64_t p = thread_index(); p < count; p += thread_stride()) {
    const unsigned s = sslot[p];
    if (p - seg_off[s] >= take[s]) {
      moved[p] = -1;
      continue;
    }
    const int i = sidx[p];
    const double* Di = D + int64_t{i} * k;
    double bc;
    const int b = best_object(Di, cl, prices, m, -1, &bc);
    obj[i] = b;
    moved[p] = b;
    if (arrival_min != nullptr) {
      double sc;
      best_object(Di, cl, prices, m, b, &sc);
      atomic_min_double(&arrival_min[b], canon(__dsub_rn(sc, bc)));
    }
  }
}

// Phase start after the first (both auctions): units that violate the new eps move to their
// cheapest object; the others already sit within eps of it and keep the previous phase's work.
__global__ void phase_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                             const double* __restrict__ prices, int m, double eps, int* __restrict__ obj) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    const double* Di = D + i * k;
    double bc;
    const int b = best_object(Di, cl, prices, m, -1, &bc);
    const int o = obj[i];
    if (__dadd_rn(Di[cl[o]], prices[o]) > __dadd_rn(bc, eps)) obj[i] = b;
  }
}

__global__ void map_kernel(const int* __restrict__ obj, const int* __restrict__ cl, int64_t n, int* __restrict__ out) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) out[i] = cl[obj[i]];
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// AuctionGpu: buffers and the device steps
// ------------------------------------------------------------------------------------------------

AuctionGpu::AuctionGpu(Ctx& ctx, int64_t n, int64_t k)
    : ctx_(ctx),
      n_(n),
      k_(k),
      mcap_(static_cast<size_t>(2 * k)),
      obj_(ctx.alloc<int>(n)),
      iota_(ctx.alloc<int>(n)),
      sel_idx_(ctx.alloc<int>(n)),
      sidx1_(ctx.alloc<int>(n)),
      sidx2_(ctx.alloc<int>(n)),
      moved_(ctx.alloc<int>(n)),
      reg_(ctx.alloc<double>(n)),
      sel_key_(ctx.alloc<double>(n)),
      skey_(ctx.alloc<double>(n)),
      flag_(ctx.alloc<unsigned char>(n)),
      sslot_(ctx.alloc<unsigned>(n)),
      sslot2_(ctx.alloc<unsigned>(n)),
      cl_id_(ctx.alloc<int>(k)),
      cl_obj_(ctx.alloc<int>(mcap_)),
      slot_(ctx.alloc<int>(mcap_)),
      prices_(ctx.alloc<double>(mcap_)),
      arr_min_(ctx.alloc<double>(mcap_)),
      hist_(ctx.alloc<unsigned long long>(mcap_)),
      span_(ctx.alloc<unsigned long long>(2)),
      seg_in_(ctx.alloc<SegmentIn>(mcap_)),
      seg_out_(ctx.alloc<SegmentOut>(mcap_)),
      seg_off_(ctx.alloc<int64_t>(mcap_)),
      take_(ctx.alloc<int64_t>(mcap_)),
      nsel_(ctx.alloc<int64_t>(1)),
      pull_last_(ctx.alloc<double>(1)),
      pull_cnt_(ctx.alloc<int64_t>(1)),
      slack_(ctx.alloc<unsigned long long>(static_cast<size_t>(k * k))) {
  fill_iota(ctx, iota_.data(), n);
  std::vector<int> id(k);
  std::iota(id.begin(), id.end(), 0);
  ctx.to_device(cl_id_.data(), id.data(), id.size());
  ctx.sync();  // `id` dies here
}

void AuctionGpu::use_clusters() {
  cl_ = cl_id_.data();
  m_ = static_cast<int>(k_);
}

void AuctionGpu::use_objects(const Objects& ob) {
  m_ = static_cast<int>(ob.size());
  std::vector<int> cl(ob.cluster.begin(), ob.cluster.end());
  ctx_.to_device(cl_obj_.data(), cl.data(), cl.size());
  ctx_.sync();  // `cl` dies here
  cl_ = cl_obj_.data();
}

EpsSchedule AuctionGpu::eps_schedule(const std::vector<double>& prices, bool warm, const AuctionParams& ap) {
  if (!span_known_) {  // depends on D only: shared by the floor and the general auction
    CK_CUDA(cudaMemsetAsync(span_.data(), 0, 2 * sizeof(unsigned long long), ctx_.stream));
    span_kernel<<<blocks_for(n_, kThreads, 4096), kThreads, 0, ctx_.stream>>>(D_, n_, k_, span_.data());
    CK_LAUNCH("span_kernel");
    unsigned long long bits[2];
    ctx_.to_host(bits, span_.data(), 2);
    ctx_.sync();
    std::memcpy(&span_raw_, &bits[0], sizeof(double));
    std::memcpy(&amax_, &bits[1], sizeof(double));
    span_known_ = true;
  }
  if (!(amax_ <= auction::kMaxCost))
    throw std::invalid_argument("auction_assign: the cost matrix has a NaN, an Inf or a |cost| above 2.8e306; "
                                "every cost must be finite and in that range");
  double span = span_raw_;
  if (!(span > 0.0)) span = 1.0;
  double pmax = 0.0;
  for (double p : prices) pmax = std::max(pmax, std::fabs(p));
  // Below a few ulps of the costs, eps increments would vanish and the auction would never end.
  const double eps_final = std::max(ap.eps_final * span, 64.0 * DBL_EPSILON * (amax_ + pmax + span));
  return {std::max((warm ? ap.eps_warm : ap.eps_start) * span, eps_final), eps_final, span};
}

void AuctionGpu::upload_prices(const std::vector<double>& prices) {
  ctx_.to_device(prices_.data(), prices.data(), prices.size());
}

void AuctionGpu::argmin_all() {
  argmin_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, cl_, prices_.data(), m_, obj_.data());
  CK_LAUNCH("argmin_kernel");
}

void AuctionGpu::phase(double eps) {
  phase_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, cl_, prices_.data(), m_, eps, obj_.data());
  CK_LAUNCH("phase_kernel");
}

std::vector<int64_t> AuctionGpu::object_counts() { return histogram(ctx_, hist_, obj_.data(), n_, m_); }

// The flagged members compacted in index order (cub::DeviceSelect), stably sorted by regret, then stably by
// segment: (segment, regret, index).
void AuctionGpu::sort_members(int64_t members, int nover) {
  size_t bytes = 0;
  CK_CUDA(cub::DeviceSelect::Flagged(nullptr, bytes, iota_.data(), flag_.data(), sel_idx_.data(), nsel_.data(), n_,
                                     ctx_.stream));
  void* tmp = ctx_.cub_storage(bytes);
  CK_CUDA(cub::DeviceSelect::Flagged(tmp, bytes, iota_.data(), flag_.data(), sel_idx_.data(), nsel_.data(), n_,
                                     ctx_.stream));
  gather_keys_kernel<<<blocks_for(members), kThreads, 0, ctx_.stream>>>(reg_.data(), sel_idx_.data(), members,
                                                                        sel_key_.data());
  CK_LAUNCH("gather_keys_kernel");
  // Stable: equal regrets keep index order. Then stable by object: (object, regret, index).
  sort_pairs<double>(ctx_, sel_key_.data(), skey_.data(), sel_idx_.data(), sidx1_.data(), members, 64);
  gather_slots_kernel<<<blocks_for(members), kThreads, 0, ctx_.stream>>>(obj_.data(), slot_.data(), sidx1_.data(),
                                                                         members, sslot_.data());
  CK_LAUNCH("gather_slots_kernel");
  if (nover > 1) {
    sort_pairs<unsigned>(ctx_, sslot_.data(), sslot2_.data(), sidx1_.data(), sidx2_.data(), members,
                         radix_bits(nover));
    sorted_idx_ = sidx2_.data();
    sorted_slot_ = sslot2_.data();
  }
}

int64_t AuctionGpu::select(const std::vector<int>& slot, const std::vector<SegmentIn>& seg,
                           std::vector<SegmentOut>& res) {
  const int nover = static_cast<int>(seg.size());
  ctx_.to_device(slot_.data(), slot.data(), slot.size());
  regret_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, cl_, prices_.data(), m_, obj_.data(),
                                                               slot_.data(), reg_.data(), flag_.data());
  CK_LAUNCH("regret_kernel");
  int64_t members = 0;
  for (const SegmentIn& g : seg) members += g.size;
  sorted_idx_ = sidx1_.data();
  sorted_slot_ = sslot_.data();
  if (members > 0) {
    sort_members(members, nover);
  } else {
    CK_CUDA(cudaMemsetAsync(nsel_.data(), 0, sizeof(int64_t), ctx_.stream));
  }
  ctx_.to_device(seg_in_.data(), seg.data(), seg.size());
  decide_kernel<<<blocks_for(nover, 128), 128, 0, ctx_.stream>>>(seg_in_.data(), nover, reg_.data(), sorted_idx_,
                                                                  seg_out_.data());
  CK_LAUNCH("decide_kernel");
  res.resize(seg.size());
  ctx_.to_host(res.data(), seg_out_.data(), res.size());
  int64_t nsel = 0;
  ctx_.to_host(&nsel, nsel_.data(), 1);
  ctx_.sync();
  if (nsel != members) throw std::runtime_error("auction (CUDA): member count mismatch (internal error)");
  for (const SegmentOut& r : res) {
    if (r.error) throw std::runtime_error("auction (CUDA): eviction past the members (internal error)");
  }
  return members;
}

std::vector<int64_t> AuctionGpu::rebid(const std::vector<SegmentIn>& seg, const std::vector<int64_t>& take,
                                       int64_t members, std::vector<double>* arrival_min) {
  std::vector<int64_t> off(seg.size());
  for (size_t s = 0; s < seg.size(); ++s) off[s] = seg[s].off;
  ctx_.to_device(seg_off_.data(), off.data(), off.size());
  ctx_.to_device(take_.data(), take.data(), take.size());
  if (arrival_min != nullptr) {
    const std::vector<double> inf(static_cast<size_t>(m_), kInf);
    ctx_.to_device(arr_min_.data(), inf.data(), inf.size());
  }
  rebid_kernel<<<blocks_for(members), kThreads, 0, ctx_.stream>>>(
      D_, k_, cl_, prices_.data(), m_, sorted_idx_, sorted_slot_, members, seg_off_.data(), take_.data(),
      obj_.data(), moved_.data(), arrival_min != nullptr ? arr_min_.data() : nullptr);
  CK_LAUNCH("rebid_kernel");
  std::vector<int64_t> arrivals = histogram(ctx_, hist_, moved_.data(), members, m_);
  if (arrival_min != nullptr) {
    arrival_min->resize(static_cast<size_t>(m_));
    ctx_.to_host(arrival_min->data(), arr_min_.data(), arrival_min->size());
    ctx_.sync();
  }
  return arrivals;
}

void AuctionGpu::pull_candidates(int j, int64_t r, double price, double eps, double* last, int64_t* pulled) {
  gap_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, prices_.data(), obj_.data(), j,
                                                           sel_key_.data());
  CK_LAUNCH("gap_kernel");
  sort_pairs<double>(ctx_, sel_key_.data(), skey_.data(), iota_.data(), sidx1_.data(), n_, 64);
  pull_kernel<<<1, 32, 0, ctx_.stream>>>(skey_.data(), r, price, eps, pull_last_.data(), pull_cnt_.data());
  CK_LAUNCH("pull_kernel");
  ctx_.to_host(last, pull_last_.data(), 1);
  ctx_.to_host(pulled, pull_cnt_.data(), 1);
  ctx_.sync();
}

std::vector<int64_t> AuctionGpu::move_to(int j, int64_t pulled) {
  move_kernel<<<blocks_for(pulled), kThreads, 0, ctx_.stream>>>(sidx1_.data(), pulled, j, obj_.data(),
                                                                 moved_.data());
  CK_LAUNCH("move_kernel");
  return histogram(ctx_, hist_, moved_.data(), pulled, m_);
}

std::vector<double> AuctionGpu::reduced_slack(double reach) {
  const size_t kk = static_cast<size_t>(k_ * k_);
  std::vector<unsigned long long> keys(kk, ordered_key(std::numeric_limits<double>::infinity()));
  ctx_.to_device(slack_.data(), keys.data(), kk);
  slack_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(D_, n_, k_, prices_.data(), obj_.data(), reach,
                                                              slack_.data());
  CK_LAUNCH("slack_kernel");
  ctx_.to_host(keys.data(), slack_.data(), kk);
  ctx_.sync();
  std::vector<double> out(kk);
  for (size_t e = 0; e < kk; ++e) out[e] = key_double(keys[e]);
  return out;
}

void AuctionGpu::write_labels(int* labels) {
  map_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(obj_.data(), cl_, n_, labels);
  CK_LAUNCH("map_kernel");
}

namespace {

// ------------------------------------------------------------------------------------------------
// The floor auction (FloorAuction of auction.cpp): upper bounds only; the result is left in the
// auction's objects (one per cluster).
// ------------------------------------------------------------------------------------------------

class FloorAuction {
 public:
  FloorAuction(AuctionGpu& a, const int64_t* hi, std::vector<double>& prices, const AuctionParams& ap)
      : a_(a), hi_(hi), p_(prices), ap_(ap), k_(a.k()), slot_(a.k()) {
    a_.use_clusters();
    const bool warm = static_cast<int64_t>(p_.size()) == k_;
    if (!warm) p_.assign(k_, 0.0);
    es_ = a_.eps_schedule(p_, warm, ap);
    eps_ = es_.eps;
    slack_ = -a.n();
    for (int64_t j = 0; j < k_; ++j) slack_ += hi[j];
  }

  int64_t run() {
    start(true);
    if (at_free_argmin()) return rounds_;
    for (;;) {
      while (round()) {
      }
      if (eps_ <= es_.eps_final) break;
      if (eps_ <= ap_.eps_certify * es_.span && certified()) break;
      eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
      start(false);
    }
    return rounds_;
  }

 private:
  // After a phase: whether the labels are already optimal (FloorAuction::certified of auction.cpp); the prices
  // then become the exact ones.
  bool certified() {
    const double reach = auction::certify_reach(k_, eps_);
    a_.upload_prices(p_);
    const std::vector<double> slack = a_.reduced_slack(reach);
    std::vector<double> exact;
    if (!auction::exact_prices(k_, slack, p_, counts_, hi_, reach, exact)) return false;
    p_ = exact;
    return true;
  }

  // Every price 0 and no cluster over its cap after the first phase start: the exact argmin, optimal; the later
  // phases would change nothing (as FloorAuction::at_free_argmin of auction.cpp).
  bool at_free_argmin() const {
    for (int64_t j = 0; j < k_; ++j)
      if (p_[j] != 0.0 || counts_[j] > hi_[j]) return false;
    return true;
  }

  AuctionGpu& a_;
  const int64_t* hi_;
  std::vector<double>& p_;
  const AuctionParams& ap_;
  const int64_t k_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t slack_ = 0, rounds_ = 0;
  std::vector<int64_t> counts_;
  std::vector<int> slot_;
  std::vector<SegmentOut> res_;

  void argmin_recount() {
    a_.upload_prices(p_);
    a_.argmin_all();
    counts_ = a_.object_counts();
  }

  // Phase start (see auction.cpp): the exact argmin in the first phase, later only the points that violate
  // the new eps move; then reverse steps for under-full clusters with a positive price, one cluster at a
  // time in index order.
  void start(bool first) {
    if (first) {
      argmin_recount();
    } else {
      a_.upload_prices(p_);
      a_.phase(eps_);
      counts_ = a_.object_counts();
    }
    if (slack_ <= 0) return;
    for (int64_t pass = 0;; ++pass) {
      bool changed = false;
      for (int64_t j = 0; j < k_; ++j) {
        if (counts_[j] >= hi_[j] || p_[j] <= 0.0) continue;
        changed = true;
        if (pass >= 4 * k_) {  // safety net: plain zeroing always terminates
          p_[j] = 0.0;
          continue;
        }
        pull(j);
      }
      if (!changed) return;
      if (pass >= 4 * k_) argmin_recount();
    }
  }

  // Reverse step of the under-full cluster j.
  void pull(int64_t j) {
    const int64_t r = hi_[j] - counts_[j];
    a_.upload_prices(p_);
    double last = 0.0;
    int64_t pulled = 0;
    a_.pull_candidates(static_cast<int>(j), r, p_[j], eps_, &last, &pulled);
    const double drop = last + eps_;
    if (drop >= p_[j]) {
      p_[j] = 0.0;  // only the points that prefer j by more than eps moved
    } else {
      p_[j] -= drop;
    }
    if (pulled > 0) {
      const std::vector<int64_t> left = a_.move_to(static_cast<int>(j), pulled);
      for (int64_t o = 0; o < k_; ++o) counts_[o] -= left[o];
      counts_[j] += pulled;
    }
  }

  // One forward round: the `excess` smallest (regret, index) of every over-full cluster leave, its price
  // rises past the last of them, and the evicted re-bid. False when none is over-full.
  bool round() {
    std::vector<int64_t> over;
    for (int64_t j = 0; j < k_; ++j) {
      slot_[j] = -1;
      if (counts_[j] > hi_[j]) {
        slot_[j] = static_cast<int>(over.size());
        over.push_back(j);
      }
    }
    if (over.empty()) return false;
    if (++rounds_ > ap_.max_rounds) throw std::runtime_error("floor_auction: no termination (internal error)");
    const size_t nover = over.size();
    std::vector<SegmentIn> seg(nover);
    int64_t off = 0;
    for (size_t s = 0; s < nover; ++s) {
      const int64_t j = over[s];
      seg[s] = SegmentIn{off, counts_[j], counts_[j] - hi_[j], 0, kInf, 1};
      off += counts_[j];
    }
    a_.upload_prices(p_);
    const int64_t members = a_.select(slot_, seg, res_);
    std::vector<int64_t> take(nover);
    for (size_t s = 0; s < nover; ++s) {
      const int64_t j = over[s];
      p_[j] = p_[j] + res_[s].last + eps_;
      take[s] = seg[s].excess;
      counts_[j] = hi_[j];
    }
    // Evicted points re-bid at the new prices, so no point sits more than eps from its best.
    a_.upload_prices(p_);
    const std::vector<int64_t> arrivals = a_.rebid(seg, take, members, nullptr);
    for (int64_t o = 0; o < k_; ++o) counts_[o] += arrivals[o];
    return true;
  }
};

// ------------------------------------------------------------------------------------------------
// The general auction (DummyAuction of auction.cpp): mandatory/optional objects per cluster, dummy units
// in the free optional slots.
// ------------------------------------------------------------------------------------------------

class DummyAuction {
 public:
  DummyAuction(AuctionGpu& a, const int64_t* lo, const int64_t* hi, std::vector<double>& prices,
               const AuctionParams& ap)
      : a_(a), ob_(lo, hi, a.k()), m_(ob_.size()), p_(prices), ap_(ap), slot_(m_, -1), lb_(m_, -kInf) {
    a_.use_objects(ob_);
    const bool warm = static_cast<int64_t>(p_.size()) == m_;
    if (!warm) p_.assign(m_, 0.0);
    es_ = a_.eps_schedule(p_, warm, ap);
    eps_ = es_.eps;
    // Cold and warm start alike: every unit takes its cheapest object.
    a_.upload_prices(p_);
    a_.argmin_all();
    real_ = a_.object_counts();
    int64_t n_dummy = -a.n();
    for (int64_t j = 0; j < a.k(); ++j) n_dummy += hi[j];
    dummies_ = auction::place_dummies(p_, ob_, real_, n_dummy);
  }

  // Writes cluster labels (int32) to `labels`.
  int64_t run(int* labels) {
    for (;;) {
      while (round()) {
      }
      if (eps_ <= es_.eps_final) break;
      next_phase();
    }
    a_.write_labels(labels);
    return rounds_;
  }

 private:
  // One object over capacity in this round.
  struct Over {
    int64_t o, excess;
    double rho;  // price step at which a dummy leaves for the cheapest other dummy object
    int64_t n_real = 0, n_dum = 0;
    double price = 0.0, lb = 0.0;  // the object's price and regret bound after the round
  };

  AuctionGpu& a_;
  const Objects ob_;
  const int64_t m_;
  std::vector<double>& p_;
  const AuctionParams& ap_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t rounds_ = 0;
  std::vector<int64_t> real_, dummies_;
  std::vector<int> slot_;
  // lb_[o]: lower bound on the smallest regret among o's real members (see auction.cpp).
  std::vector<double> lb_;
  std::vector<SegmentOut> res_;
  std::vector<double> arrival_min_;

  // The objects above capacity; slot_[o] = s for those whose real members must be scanned.
  std::vector<Over> over_objects(bool* any_scan) {
    std::vector<Over> over;
    for (int64_t o = 0; o < m_; ++o)
      if (real_[o] + dummies_[o] > ob_.cap[o]) over.push_back(Over{o, real_[o] + dummies_[o] - ob_.cap[o], kInf});
    *any_scan = false;
    std::fill(slot_.begin(), slot_.end(), -1);
    for (size_t s = 0; s < over.size(); ++s) {
      Over& v = over[s];
      const int64_t dst_dummy = cheapest_dummy_object(p_, ob_, v.o);
      v.rho = (dummies_[v.o] > 0 && dst_dummy >= 0) ? p_[dst_dummy] - p_[v.o] : kInf;
      if (!(v.excess <= dummies_[v.o] && v.rho <= lb_[v.o])) {
        slot_[v.o] = static_cast<int>(s);
        *any_scan = true;
      }
    }
    return over;
  }

  // The segments of the sorted members handed to the device: scanned objects contribute their real members.
  std::vector<SegmentIn> segments(const std::vector<Over>& over) const {
    std::vector<SegmentIn> seg(over.size());
    int64_t off = 0;
    for (size_t s = 0; s < over.size(); ++s) {
      const Over& v = over[s];
      const bool scanned = slot_[v.o] >= 0;
      const int64_t size = scanned ? real_[v.o] : 0;
      seg[s] = SegmentIn{off, size, v.excess, dummies_[v.o], v.rho, scanned ? 1 : 0};
      off += size;
    }
    return seg;
  }

  // How many real units and dummies leave each object, its new price and regret bound.
  void decide(std::vector<Over>& over) const {
    for (size_t s = 0; s < over.size(); ++s) {
      Over& v = over[s];
      double last, rest_min = lb_[v.o];
      if (slot_[v.o] < 0) {  // only dummies leave: rho <= every real member's regret
        v.n_dum = v.excess;
        last = v.rho;
      } else {
        v.n_real = res_[s].nr;
        v.n_dum = res_[s].nd;
        last = res_[s].last;
        rest_min = res_[s].rest_min;
      }
      const double delta = last + eps_;
      v.price = p_[v.o] + delta;
      v.lb = rest_min - delta;
    }
  }

  // One forward round over the objects above capacity; false when none is.
  bool round() {
    bool any_scan = false;
    std::vector<Over> over = over_objects(&any_scan);
    if (over.empty()) return false;
    if (++rounds_ > ap_.max_rounds) throw std::runtime_error("auction_assign: no termination (internal error)");
    const std::vector<SegmentIn> seg = segments(over);
    int64_t members = 0;
    if (any_scan) {
      a_.upload_prices(p_);
      members = a_.select(slot_, seg, res_);
    }
    decide(over);
    for (const Over& v : over) {
      if (!std::isfinite(v.price)) throw std::runtime_error("auction_assign: infinite price (internal error)");
      p_[v.o] = v.price;
      lb_[v.o] = v.lb;
      real_[v.o] -= v.n_real;
      dummies_[v.o] -= v.n_dum;
    }
    rebid(over, seg, members);
    int64_t dummy_total = 0;
    for (const Over& v : over) dummy_total += v.n_dum;
    if (dummy_total > 0) dummies_[cheapest_dummy_object(p_, ob_, -1)] += dummy_total;
    return true;
  }

  // Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best; arrivals lower
  // the bound of their new object to their regret.
  void rebid(const std::vector<Over>& over, const std::vector<SegmentIn>& seg, int64_t members) {
    std::vector<int64_t> n_real(over.size());
    int64_t n_moved = 0;
    for (size_t s = 0; s < over.size(); ++s) n_moved += (n_real[s] = over[s].n_real);
    if (n_moved == 0) return;
    a_.upload_prices(p_);
    const std::vector<int64_t> arrivals = a_.rebid(seg, n_real, members, &arrival_min_);
    for (int64_t o = 0; o < m_; ++o) {
      real_[o] += arrivals[o];
      if (arrivals[o] > 0) lb_[o] = std::min(lb_[o], arrival_min_[o]);
    }
  }

  // Next phase: shrink eps and move every unit that violates it to its cheapest object.
  void next_phase() {
    eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
    a_.upload_prices(p_);
    a_.phase(eps_);
    real_ = a_.object_counts();
    std::fill(lb_.begin(), lb_.end(), -kInf);
    const int64_t cheapest = cheapest_dummy_object(p_, ob_, -1);
    for (int64_t o = 0; o < m_; ++o) {
      if (o != cheapest && dummies_[o] > 0 && p_[o] > p_[cheapest] + eps_) {
        dummies_[cheapest] += dummies_[o];
        dummies_[o] = 0;
      }
    }
  }
};

}  // namespace

int64_t AuctionGpu::assign(const double* D, const int64_t* lo, const int64_t* hi, AuctionState& state, int* labels,
                           const AuctionParams& ap) {
  D_ = D;
  span_known_ = false;
  if (ap.force_general) {
    state.used_general = true;
    return DummyAuction(*this, lo, hi, state.general_prices, ap).run(labels);
  }
  const int64_t rounds = FloorAuction(*this, hi, state.floor_prices, ap).run();
  const std::vector<int64_t> sizes = object_counts();
  bool lower_ok = true;
  for (int64_t j = 0; j < k_; ++j) lower_ok = lower_ok && sizes[j] >= lo[j];
  if (lower_ok) {
    // Optimal without the lower bounds and it meets them: optimal with them too.
    ctx_.copy(labels, obj_.data(), static_cast<size_t>(n_));
    state.used_general = false;
    return rounds;
  }
  state.used_general = true;
  return rounds + DummyAuction(*this, lo, hi, state.general_prices, ap).run(labels);
}

}  // namespace cuda
}  // namespace cluster_kernels
