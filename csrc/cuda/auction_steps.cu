// The device steps both CUDA auctions take (auction_steps.cuh): argmins, phase starts, regrets and the selection of
// the members that leave, re-bids. The CPU counterpart is cpu/auction_steps.cpp.
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
#include "cuda/auction_steps.cuh"

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

namespace {

__global__ void argmin_kernel(const double* __restrict__ D, int64_t n, int64_t k, const int* __restrict__ cl,
                              const double* __restrict__ prices, int m, int* __restrict__ obj) {
  for (int64_t i = thread_index(); i < n; i += thread_stride()) {
    double bc;
    obj[i] = best_object(D + i * k, cl, prices, m, -1, &bc);
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

void AuctionGpu::write_labels(int* labels) {
  map_kernel<<<blocks_for(n_), kThreads, 0, ctx_.stream>>>(obj_.data(), cl_, n_, labels);
  CK_LAUNCH("map_kernel");
}


}  // namespace cuda
}  // namespace cluster_kernels
