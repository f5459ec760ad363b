// The eviction auction on a float64 cost block (auction.h): the floor auction (upper bounds only) and the
// general one (mandatory/optional objects and dummy units), written once for one process and for one rank
// of many. See cluster_kernels/kmeans.py (module docstring) for the algorithm; this is the native port of
// its float64 reference (_floor_auction_ref, _dummy_auction_ref, assign_ref).
#include "cpu/auction.h"

#include "cpu/auction_objects.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace cluster_kernels {

namespace {

using auction::cheapest_dummy_object;
using auction::EpsSchedule;
using auction::kMaxCost;
using auction::Objects;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kNoRow = std::numeric_limits<int64_t>::max();
// Largest cost block (entries) of which the floor auction keeps a column-major copy for its reverse steps
// (2^24 entries: 128 MiB, e.g. n = 262 144 at k = 64); above it they read the rows, so a distributed rank of
// n = 500 000 rows and one process of 10^6 hold no second n x k float64 array. Results are the same either way.
constexpr int64_t kMaxColumnCopy = int64_t{1} << 24;
// Rows a reverse step's scan keeps for the next reverse steps of the same cluster (FloorAuction::KeptPull): at
// first kKeptPull (most pull a handful of points, and a few hundred rows cost little to re-read), doubled up to
// kKeptPullMost each time they did not suffice.
constexpr int64_t kKeptPull = 256;
constexpr int64_t kKeptPullMost = 4096;
// A reverse step re-reads the rows moved since its cluster's last scan while they are at most 1/kMovedReread of
// the rows; beyond, it scans again.
constexpr int64_t kMovedReread = 16;

// Raised after a parallel loop that found a point with no finite cost: never expected once the costs are
// checked (eps_schedule), so an internal error rather than a memory error.
void check_bids(bool bad, const char* where) {
  if (bad) throw std::runtime_error(std::string(where) + ": a point has no finite cost (internal error)");
}

// This rank's part of the problem: its cost rows and how to reach the others. A block of a working set
// (WorkingSet) holds some of the rows of D only: its row i is row rows[i] of D (rows ascending, so that local
// and global row orders agree); the other blocks hold every row of D.
struct Block {
  const double* D;
  int64_t n, k;
  Collective& comm;
  int64_t offset, n_total;
  const int64_t* rows = nullptr;

  const double* row(int64_t i) const { return D + (rows ? rows[i] : i) * k; }
  // Row i's global row: the key of the selections, the same on every rank and for every thread count.
  int64_t gid(int64_t i) const { return offset + (rows ? rows[i] : i); }
};

// Places the caps leave free over all ranks: sum(hi) - n_total (0 under exact balance).
int64_t free_places(const Block& b, const int64_t* hi) {
  int64_t free = -b.n_total;
  for (int64_t j = 0; j < b.k; ++j) free += hi[j];
  return free;
}

// Keys (value, global row) in lexicographic order; rows are unique, so keys are distinct.
inline bool key_le(double v, int64_t g, double tv, int64_t tg) { return v < tv || (v == tv && g <= tg); }

// Rows a, c of this rank in the order of their keys (val[row], row).
struct KeyLess {
  const double* val;
  bool operator()(int64_t a, int64_t c) const { return val[a] < val[c] || (val[a] == val[c] && a < c); }
};

// This thread's index and the team's size (0 and 1 outside a parallel region or without OpenMP).
inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}
inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// The rows i in [0, n) with value(i, &v) true, reduced to a set that holds this rank's t smallest keys
// (v, row) among them (all of them when fewer); val[i] = v for each. One parallel pass: every thread keeps
// only what can still be among the t smallest of its own block, then the blocks are joined in order.
// Keys are distinct, so the t smallest are the same set whatever the thread count.
template <class Value>
void smallest_candidates(int64_t n, int64_t t, double* val, Value value, std::vector<int64_t>& out) {
  out.clear();
  if (t <= 0) return;
  const size_t cap = static_cast<size_t>(std::max<int64_t>(2 * t, 4096));
  std::vector<std::vector<int64_t>> part;
#pragma omp parallel
  {
#pragma omp single
    part.resize(team_size());
    std::vector<int64_t>& loc = part[thread_id()];
    double tv = kInf;  // the key (tv, tg) of the t-th smallest kept after the last pruning
    int64_t tg = kNoRow;
    const KeyLess less{val};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      double v;
      if (!value(i, &v) || !(v < tv || (v == tv && i < tg))) continue;
      val[i] = v;
      loc.push_back(i);
      if (loc.size() >= cap) {
        std::nth_element(loc.begin(), loc.begin() + (t - 1), loc.end(), less);
        loc.resize(t);
        tg = loc.back();  // the t-th smallest after nth_element
        tv = val[tg];
      }
    }
  }
  for (const auto& loc : part) out.insert(out.end(), loc.begin(), loc.end());
}

// members[s] = the rows i in [0, n) with slot(i) == s (s in [0, groups); -1: none), in one parallel pass; the
// order within a group depends on the thread count, so callers use each group as a set.
template <class Slot>
void group_rows(int64_t n, int64_t groups, Slot slot, std::vector<std::vector<int64_t>>& members) {
  members.resize(groups);
  for (auto& m : members) m.clear();
  std::vector<std::vector<std::vector<int64_t>>> part;
#pragma omp parallel
  {
#pragma omp single
    part.assign(team_size(), std::vector<std::vector<int64_t>>(groups));
    auto& loc = part[thread_id()];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = slot(i);
      if (s >= 0) loc[s].push_back(i);
    }
  }
  for (const auto& loc : part)
    for (int64_t s = 0; s < groups; ++s) members[s].insert(members[s].end(), loc[s].begin(), loc[s].end());
}

// Units per object. Every label is bounds-checked: a label comes from floating-point comparisons, and one out
// of [0, m) would otherwise write outside `local`.
std::vector<int64_t> count_objects(const int32_t* obj, int64_t n, int64_t m) {
  std::vector<int64_t> counts(m, 0);
  bool bad = false;
#pragma omp parallel reduction(|| : bad)
  {
    std::vector<int64_t> local(m, 0);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) {
      const int64_t o = obj[i];
      if (o < 0 || o >= m) {
        bad = true;
        continue;
      }
      ++local[o];
    }
#pragma omp critical
    for (int64_t o = 0; o < m; ++o) counts[o] += local[o];  // integers: order does not matter
  }
  if (bad) throw std::runtime_error("auction_assign: a label outside [0, k) (internal error)");
  return counts;
}

// Units of each object over all ranks; with `tally`, that per-rank count is summed over the ranks too, in the same
// collective.
std::vector<int64_t> global_counts(const Block& b, const int32_t* obj, int64_t m, int64_t* tally = nullptr) {
  std::vector<int64_t> counts = count_objects(obj, b.n, m);
  if (tally) counts.push_back(*tally);
  b.comm.sum(counts);
  if (tally) {
    *tally = counts.back();
    counts.pop_back();
  }
  return counts;
}

// The three cheapest options of a point: cost(o) for o in [0, m), in order (the lowest index first on equal
// costs; -1 and +inf where m is smaller). best and bc are what a best-of scan gives; second and sc the cheapest
// other than best.
struct Three {
  int64_t best = -1, second = -1, third = -1;
  double bc = kInf, sc = kInf, tc = kInf;
};
template <class Cost>
inline Three best_three(int64_t m, Cost cost) {
  Three t;
  for (int64_t o = 0; o < m; ++o) {
    const double c = cost(o);
    if (c < t.sc) {
      t.tc = t.sc;
      t.third = t.second;
      if (c < t.bc) {
        t.sc = t.bc;
        t.second = t.best;
        t.bc = c;
        t.best = o;
      } else {
        t.sc = c;
        t.second = o;
      }
    } else if (c < t.tc) {
      t.tc = c;
      t.third = o;
    }
  }
  return t;
}

// Per unit, the cheapest cost over the options other than its own (the "second cost" of a regret), with the
// option giving it (arg), the unit's option then and the tick it was taken at, plus a lower bound of the costs
// of the options other than those two (at first the third cheapest cost). Prices change by ticks. An entry is
// exact while the unit keeps its option, arg keeps its price and no price has dropped anywhere (a rise
// elsewhere cannot lower the minimum; a drop could). When only arg's price changed, arg's new cost still is the
// minimum if it lies below the bound, which holds while no price drops: one cost instead of a scan. The value
// given is then the very double a fresh scan gives (the same sums, the same minimum, the lowest index on equal
// costs), so the cache saves O(m) scans without changing any result.
class SecondCache {
 public:
  SecondCache(int64_t n, int64_t m)
      : sc_(n), sc3_(n), arg_(n, -1), own_(n, -1), stamp_(n, 0), changed_(m, 0) {}

  // Option o's price goes from before to after (serial code only).
  void price(int64_t o, double before, double after) {
    if (after == before) return;
    changed_[o] = ++tick_;
    if (after < before) dropped_ = tick_;
  }
  // Unit i, in option own, with the three cheapest options t (at the current prices).
  void put(int64_t i, int64_t own, const Three& t) {
    if (t.best == own) {
      sc_[i] = t.sc;
      arg_[i] = static_cast<int32_t>(t.second);
      sc3_[i] = t.tc;
    } else {
      sc_[i] = t.bc;
      arg_[i] = static_cast<int32_t>(t.best);
      sc3_[i] = t.second == own ? t.tc : t.sc;
    }
    own_[i] = static_cast<int32_t>(own);
    stamp_[i] = tick_;
  }
  // The options `js` (distinct) had their prices lowered since the last call, and nothing read the cache in
  // between (serial code; cost(i, j): unit i's cost for option j at j's new price). The entries take those new
  // costs into account and stay usable: one pass for a whole batch of drops (a phase start's reverse steps)
  // instead of losing every entry. An exact entry whose arg is in `js` keeps arg as the cheapest of the others
  // (a drop only lowers it), so the fresh costs of `js` decide; an entry that was not exact only lowers its bound.
  template <class Cost>
  void lowered(const std::vector<int64_t>& js, Cost cost) {
    if (js.empty()) return;
    const int64_t t = ++tick_;
    const int64_t n = static_cast<int64_t>(sc_.size());
    const int64_t nj = static_cast<int64_t>(js.size());
    std::vector<char> dropped(changed_.size(), 0);
    for (int64_t j : js) dropped[j] = 1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t own = own_[i], a = arg_[i];
      if (own < 0 || stamp_[i] < dropped_) continue;  // no entry, or one a drop elsewhere has voided
      const bool exact = a < 0 || changed_[a] <= stamp_[i];
      int64_t arg = a;
      double best = exact ? (a >= 0 && dropped[a] ? cost(i, a) : sc_[i]) : kInf;
      double bound = sc3_[i];
      for (int64_t e = 0; e < nj; ++e) {
        const int64_t j = js[e];
        if (j == own || j == a) continue;
        const double v = cost(i, j);
        if (exact && (v < best || (v == best && j < arg))) {  // the lowest index among equal costs, as a scan
          bound = std::min(bound, best);
          best = v;
          arg = j;
        } else {
          bound = std::min(bound, v);
        }
      }
      sc3_[i] = bound;
      if (!exact) continue;
      sc_[i] = best;
      arg_[i] = static_cast<int32_t>(arg);
      stamp_[i] = t;
    }
    for (int64_t j : js) changed_[j] = t;
  }
  // Unit i's cached second cost while in option own, if it is known (cost(o): option o's cost at its price now).
  template <class Cost>
  bool get(int64_t i, int64_t own, double* sc, Cost cost) {
    if (own_[i] != own || stamp_[i] < dropped_) return false;
    const int64_t a = arg_[i];
    if (a >= 0 && changed_[a] > stamp_[i]) {
      const double v = cost(a);  // only arg's price changed: its cost now, the others are at least sc3_
      if (!(v < sc3_[i])) return false;
      sc_[i] = v;
      stamp_[i] = tick_;
    }
    *sc = sc_[i];
    return true;
  }
  // Unit i's exact cheapest cost(o) over the m options other than `own`: the cached value, or a scan (then cached).
  template <class Cost>
  double value(int64_t i, int64_t own, int64_t m, Cost cost) {
    double sc;
    if (!get(i, own, &sc, cost)) {
      put(i, own, best_three(m, cost));
      sc = sc_[i];
    }
    return sc;
  }

 private:
  std::vector<double> sc_, sc3_;
  std::vector<int32_t> arg_, own_;
  std::vector<int64_t> stamp_, changed_;
  int64_t tick_ = 0, dropped_ = 0;
};

// A row's smallest and largest cost so far, and whether every cost so far is usable (not NaN, not infinite, at
// most kMaxCost in magnitude). Fed one cost at a time, so that a pass doing other work per cost reads the row once.
struct RowRange {
  double lo = kInf, hi = -kInf;
  bool ok = true;
  void add(double v) {
    ok = ok && std::fabs(v) <= kMaxCost;  // false for NaN too
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  // The row (global row gid) into a pass's running span, largest |cost| and first bad row (-gid, a max); false
  // when the row is bad.
  bool fold(int64_t gid, double* span, double* amax, double* bad) const {
    if (!ok) {
      *bad = std::max(*bad, -static_cast<double>(gid));
      return false;
    }
    *span = std::max(*span, hi - lo);
    *amax = std::max(*amax, std::max(std::fabs(lo), std::fabs(hi)));
    return true;
  }
};

// The largest per-point cost range (span, 1 when every row is constant) and the largest |cost|, over all ranks.
struct CostRange {
  double span = 1.0, amax = 0.0;
};

// Every rank's view (span, amax, bad: -(first bad global row) or -inf) made global. It is also the check of the
// costs: the same all-reduce tells every rank alike whether some rank holds a bad cost, and then every rank
// refuses the problem.
CostRange agree_range(const Block& b, double span, double amax, double bad) {
  std::vector<double> global{span, amax, bad};
  b.comm.max(global);
  if (global[2] > -kInf) {
    char msg[200];
    std::snprintf(msg, sizeof msg,
                  "auction_assign: cost row %lld has a NaN, an Inf or a |cost| above %.3g; every cost must be finite "
                  "and in that range",
                  static_cast<long long>(-global[2]), kMaxCost);
    throw std::invalid_argument(msg);
  }
  return {global[0] > 0.0 ? global[0] : 1.0, global[1]};
}

// The cost range of the block's rows (one pass), checked.
CostRange cost_range(const Block& b) {
  double span = 0.0, amax = 0.0, bad = -kInf;
#pragma omp parallel for schedule(static) reduction(max : span, amax, bad)
  for (int64_t i = 0; i < b.n; ++i) {
    const double* Di = b.row(i);
    RowRange r;
    for (int64_t j = 0; j < b.k; ++j) r.add(Di[j]);
    r.fold(b.gid(i), &span, &amax, &bad);
  }
  return agree_range(b, span, amax, bad);
}

// First and final eps from the cost range (as the reference's _eps_schedule).
EpsSchedule eps_schedule(const CostRange& range, const std::vector<double>& prices, bool warm,
                         const AuctionParams& ap) {
  double pmax = 0.0;
  for (double p : prices) {
    if (!(std::fabs(p) <= kMaxCost))
      throw std::invalid_argument("auction_assign: a warm-start price is NaN, Inf or too large");
    pmax = std::max(pmax, std::fabs(p));
  }
  const double span = range.span;
  // Below a few ulps of the costs, eps increments would vanish and the auction would never end.
  const double eps_final = std::max(ap.eps_final * span, 64.0 * DBL_EPSILON * (range.amax + pmax + span));
  return {std::max((warm ? ap.eps_warm : ap.eps_start) * span, eps_final), eps_final, span};
}

// Per group g, the t[g]-th smallest key and how many local keys lie at or below it.
struct Threshold {
  std::vector<double> val;
  std::vector<int64_t> gid, count;
};

// Hands the local candidates of the wanted groups (the first count[g] members) to comm.select, then keeps
// in front the local ones at or below the global thresholds.
void exchange(const Block& b, const double* val, std::vector<std::vector<int64_t>>& members,
              const std::vector<int64_t>& t, Threshold& th) {
  std::vector<int64_t> grp, gid, want, wanted;
  std::vector<double> v;
  for (int64_t g = 0; g < static_cast<int64_t>(members.size()); ++g) {
    if (t[g] <= 0) continue;
    const int64_t w = static_cast<int64_t>(want.size());
    want.push_back(t[g]);
    wanted.push_back(g);
    for (int64_t e = 0; e < th.count[g]; ++e) {
      grp.push_back(w);
      v.push_back(val[members[g][e]]);
      gid.push_back(b.gid(members[g][e]));
    }
  }
  if (want.empty()) return;  // the same on every rank: t is global
  std::vector<double> tv;
  std::vector<int64_t> tg;
  b.comm.select(grp, v, gid, want, tv, tg);
  for (int64_t w = 0; w < static_cast<int64_t>(wanted.size()); ++w) {
    const int64_t g = wanted[w];
    th.val[g] = tv[w];
    th.gid[g] = tg[w];
    auto& mem = members[g];
    auto below = [&](int64_t i) { return key_le(val[i], b.gid(i), tv[w], tg[w]); };
    th.count[g] = std::partition(mem.begin(), mem.begin() + th.count[g], below) - mem.begin();
  }
}

// Per group g, the t[g]-th smallest key (val[i], gid(i)) over the members of every rank (t[g] = 0: none
// wanted; count 0). members[g] is reordered so that its first count[g] entries are the local keys at or
// below the threshold: the t[g] smallest when one process holds them all.
Threshold select_smallest(const Block& b, const double* val, std::vector<std::vector<int64_t>>& members,
                          const std::vector<int64_t>& t) {
  const int64_t groups = static_cast<int64_t>(members.size());
  Threshold th{std::vector<double>(groups, kInf), std::vector<int64_t>(groups, kNoRow),
               std::vector<int64_t>(groups, 0)};
  const bool local = !b.comm.distributed();
  const KeyLess less{val};
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t g = 0; g < groups; ++g) {
    auto& mem = members[g];
    const int64_t size = static_cast<int64_t>(mem.size());
    if (t[g] <= 0) continue;
    // This rank's t[g] smallest first: the only ones that can be the answer.
    if (size >= t[g]) std::nth_element(mem.begin(), mem.begin() + (t[g] - 1), mem.end(), less);
    th.count[g] = std::min(size, t[g]);
    if (local && size >= t[g]) {
      th.val[g] = val[mem[t[g] - 1]];
      th.gid[g] = b.gid(mem[t[g] - 1]);
    }
  }
  if (!local) exchange(b, val, members, t, th);
  return th;
}

// ------------------------------------------------------------------------------------------------
// The floor auction: the relaxed problem size_j <= hi_j (no lower bounds) in the "floor" form of the
// dual: prices are >= 0 and a cluster with a positive price must be exactly full. Forward rounds keep
// that true (members leave only by eviction, exactly the excess); each eps phase starts from the argmin
// and reverse steps. No dummy units, so slack capacity costs nothing: an arrival at a cluster with room
// is simply absorbed.
// ------------------------------------------------------------------------------------------------

class FloorAuction {
 public:
  // eps_start > 0: the first eps (at least the final one) instead of the schedule's, for a warm start whose
  // prices are known to be close (WorkingSet's later solves).
  FloorAuction(const Block& b, const int64_t* hi, AuctionState& state, int32_t* obj, const AuctionParams& ap,
               const CostRange& range, double eps_start = 0.0)
      : b_(b), hi_(hi), p_(state.floor_prices), obj_(obj), ap_(ap), cols_(state.columns), stats_(state.stats),
        own_(b.n), gap_(b.n), regret_(b.n), second_(b.n, b.k), heap_(b.k), key_(b.n), kept_(b.k), seen_(b.n, 0) {
    const bool warm = static_cast<int64_t>(p_.size()) == b.k;
    if (!warm) p_.assign(b.k, 0.0);
    es_ = eps_schedule(range, p_, warm, ap);
    if (eps_start > 0.0) es_.eps = std::max(std::min(eps_start, es_.eps), es_.eps_final);
    eps_ = es_.eps;
    slack_ = free_places(b, hi);
  }

  int64_t run() {
    start(true);
    for (;;) {
      if (settled()) break;
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
  // After a phase start that made no pull: every point at its exact argmin (ties count) and no cluster over its
  // cap, so every cluster with a positive price is exactly full. The assignment is then optimal for these
  // prices, and every later phase would move no point (none is above its best by any eps >= 0), pull nothing
  // and run no round: they are skipped. Cold starts with all prices 0 and no cluster over its cap end here at
  // once. Prices, counts and exact_ are global: every rank agrees.
  bool settled() const {
    if (!idle_) return false;
    for (int64_t j = 0; j < b_.k; ++j)
      if (counts_[j] > hi_[j]) return false;
    return true;
  }

  const Block& b_;
  const int64_t* hi_;
  std::vector<double>& p_;
  int32_t* obj_;
  const AuctionParams& ap_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t slack_ = 0, rounds_ = 0;
  bool exact_ = false;  // after the last bid_all: every point (all ranks) at its exact argmin
  bool idle_ = false;   // after the last phase start: exact_ and no pull
  std::vector<int64_t> counts_;
  // own_[i]: the cost row(i)[obj_[i]] (without price), kept with obj_; cols_: the costs column-major (k, n),
  // made at the first reverse step (empty before, or when the block is above kMaxColumnCopy entries). A
  // reverse step then reads two contiguous arrays instead of two entries of every cost row.
  RawVector<double>& cols_;  // the caller's buffer (AuctionState::columns), valid once have_cols_
  AuctionStats& stats_;
  bool have_cols_ = false;
  std::vector<double> own_, gap_, regret_;
  std::vector<std::vector<int64_t>> members_;
  SecondCache second_;
  std::vector<int64_t> lowered_;  // clusters whose price a reverse step lowered since the last flush_lowered
  // Per cluster j, a min-heap of its members keyed by (sc - own) at the time the key was taken (sc: the
  // cheapest other cluster's cost with price). Within a phase prices only rise, so a stored key is a lower
  // bound of the member's key now, and its regret now, sc - (own + p_j), is at least key - p_j less rounding
  // (margin_). A forward round pops members until no unpopped one can be among the `excess` smallest regrets,
  // reads only those, and pushes back the ones that stay: O(excess) rows per round instead of every member of
  // every over-full cluster. Built the first time a cluster is over-full in a phase; dropped at phase starts
  // (reverse steps lower prices, which can lower keys).
  struct Entry {
    double key;
    int64_t row;
  };
  // The heaps' order, as a type (not a function pointer) so that the heap operations inline it.
  struct EntryAfter {
    bool operator()(const Entry& a, const Entry& b) const { return a.key > b.key || (a.key == b.key && a.row > b.row); }
  };
  static constexpr EntryAfter entry_after{};
  std::vector<std::vector<Entry>> heap_;
  std::vector<char> built_;
  std::vector<double> key_;  // a popped candidate's fresh key

  Three cheapest_three(int64_t i) const {
    const double* Di = row(i);
    return best_three(b_.k, [&](int64_t j) { return Di[j] + p_[j]; });
  }

  void set_price(int64_t j, double v) {
    second_.price(j, p_[j], v);
    p_[j] = v;
  }

  const double* row(int64_t i) const { return b_.row(i); }
  // Rows are read in data-dependent order (heap pops, member and eviction lists): asking for one a few steps
  // ahead overlaps its memory latency with the work on the current one.
  static constexpr size_t kPrefetchAhead = 4;
  void prefetch_row(int64_t i) const {
    const char* r = reinterpret_cast<const char*>(row(i));
    for (int64_t off = 0; off < b_.k * static_cast<int64_t>(sizeof(double)); off += 64) __builtin_prefetch(r + off);
  }

  // Column j of the costs (null when there is no column-major copy).
  const double* column(int64_t j) {
    if (!have_cols_ && b_.n * b_.k <= kMaxColumnCopy && b_.n > 0) {
      have_cols_ = true;
      cols_.resize(static_cast<size_t>(b_.n) * b_.k);
      constexpr int64_t kBlock = 64;
#pragma omp parallel for schedule(static)
      for (int64_t i0 = 0; i0 < b_.n; i0 += kBlock) {
        const int64_t i1 = std::min(i0 + kBlock, b_.n);
        for (int64_t c = 0; c < b_.k; ++c)
          for (int64_t i = i0; i < i1; ++i) cols_[c * b_.n + i] = row(i)[c];
      }
    }
    return have_cols_ ? cols_.data() + j * b_.n : nullptr;
  }

  // Every point takes its cheapest cluster (only_violators: only those more than eps above it).
  void bid_all(bool only_violators) {
    if (!only_violators) forget_pulls();  // every point moves: nothing a reverse step kept still bounds anything
    bool bad = false;
    int64_t inexact = 0;  // points left above their exact best (within eps of it)
    const bool record = only_violators && any_kept_;
    std::vector<std::vector<int64_t>> moved;  // per thread, the points that changed cluster (when recorded)
#pragma omp parallel reduction(|| : bad) reduction(+ : inexact)
    {
#pragma omp single
      moved.resize(team_size());
      std::vector<int64_t>& mine = moved[thread_id()];
#pragma omp for schedule(static)
      for (int64_t i = 0; i < b_.n; ++i) {
        double sc;
        if (only_violators && second_.get(i, obj_[i], &sc, [&](int64_t c) { return row(i)[c] + p_[c]; })) {
          // The cheapest other cluster is known exactly: no scan unless the point moves.
          const double own = own_[i] + p_[obj_[i]];  // own_[i] is row(i)[obj_[i]]
          if (!(own > sc + eps_)) {
            inexact += own > sc;
            continue;
          }
        }
        const Three t = cheapest_three(i);
        const int64_t best = t.best;
        const double bc = t.bc;
        if (best < 0) {
          bad = true;
          continue;
        }
        if (!only_violators || row(i)[obj_[i]] + p_[obj_[i]] > bc + eps_) {
          if (record) mine.push_back(i);
          obj_[i] = static_cast<int32_t>(best);
          own_[i] = row(i)[best];
        } else {
          inexact += row(i)[obj_[i]] + p_[obj_[i]] > bc;
        }
        second_.put(i, obj_[i], t);
      }
    }
    for (const auto& m : moved) note_moved(m.data(), m.size());
    check_bids(bad, "floor_auction");
    counts_ = global_counts(b_, obj_, b_.k, &inexact);
    exact_ = inexact == 0;
  }

  // Phase start: the first phase from the exact argmin, later ones move only the points that violate the
  // new eps (everyone else already sits within it, which keeps most of the previous phase's work). A
  // cluster left below its cap with a positive price then lowers its price just enough to pull in its
  // deficit (reverse steps); a price that would go below 0 stops at 0, where being under-full is allowed.
  // Zeroing the price outright instead would throw away what earlier phases learnt.
  void start(bool first) {
    built_.assign(b_.k, 0);
    for (auto& h : heap_) h.clear();
    bid_all(!first);
    idle_ = exact_;
    if (slack_ <= 0) return;
    for (int64_t pass = 0;; ++pass) {
      bool changed = false;
      for (int64_t j = 0; j < b_.k; ++j) {
        if (counts_[j] >= hi_[j] || p_[j] <= 0.0) continue;
        changed = true;
        idle_ = false;
        if (pass >= 4 * b_.k) {  // safety net: plain zeroing always terminates
          set_price(j, 0.0);
          continue;
        }
        pull(j);
      }
      if (!changed) break;
      if (pass >= 4 * b_.k) bid_all(false);
    }
    flush_lowered();
  }

  // The price drops of this phase start's reverse steps reach the second-cost cache, in one pass over the
  // rows, before anything reads it again (the rounds, the certificate, the next phase start's bid_all). Reverse
  // steps are the only price drops, and they read the cache not at all; a bid_all among them rewrites every
  // entry at the current prices, which the pass then leaves as it is.
  void flush_lowered() {
    if (lowered_.empty()) return;
    if (have_cols_) {
      second_.lowered(lowered_, [&](int64_t i, int64_t j) { return cols_[j * b_.n + i] + p_[j]; });
    } else {
      second_.lowered(lowered_, [&](int64_t i, int64_t j) { return row(i)[j] + p_[j]; });
    }
    lowered_.clear();
  }

  // Reverse step of the under-full cluster j: the points with the smallest extra cost (gap) come, and
  // every other point stays within eps of its best.
  void pull(int64_t j) {
    const int64_t r = hi_[j] - counts_[j];
    const double pj = p_[j];
    const double* col = column(j);
    members_.resize(1);
    std::vector<int64_t>& cand = members_[0];
    auto gap = [&](int64_t i, double* v) {
      const int64_t o = obj_[i];
      if (o == j) return false;
      *v = ((col ? col[i] : row(i)[j]) + pj) - (own_[i] + p_[o]);
      return true;
    };
    ++stats_.pulls;
    // Only this rank's r smallest gaps can be among the r smallest of all ranks.
    if (!kept_candidates(j, r, gap, cand)) scan_candidates(j, r, gap, cand);
    const Threshold th = select_smallest(b_, gap_.data(), members_, {r});
    int64_t pulled = th.count[0];
    const double drop = th.val[0] + eps_;
    if (drop >= pj) {
      // The price stops at 0: only points that now strictly prefer j by more than eps move.
      p_[j] = 0.0;
      const double eps = eps_;
      pulled = std::partition(cand.begin(), cand.begin() + pulled, [&](int64_t i) { return gap_[i] - pj < -eps; })
               - cand.begin();
    } else {
      p_[j] -= drop;
    }
    if (!std::isfinite(p_[j])) throw std::runtime_error("floor_auction: infinite price (internal error)");
    std::vector<int64_t> left(b_.k, 0);
    for (int64_t e = 0; e < pulled; ++e) {
      ++left[obj_[cand[e]]];
      obj_[cand[e]] = static_cast<int32_t>(j);
      own_[cand[e]] = row(cand[e])[j];
    }
    note_moved(cand.data(), static_cast<size_t>(pulled));
    if (p_[j] < pj && std::find(lowered_.begin(), lowered_.end(), j) == lowered_.end())
      lowered_.push_back(j);  // the cache learns of the drop at flush_lowered
    b_.comm.sum(left);
    for (int64_t o = 0; o < b_.k; ++o) {
      counts_[o] -= left[o];
      counts_[j] += left[o];
    }
  }

  // The reverse steps pull from the same few full clusters again and again (a chain of clusters with positive
  // prices passing points along until one with room takes them), each time a few points, and so do the next
  // phase starts. A row that kept its cluster o since a scan for j has its gap changed by exactly the change of
  // p_j less that of p_o; so every row the scan did not keep still has a gap of at least the scan's bound plus
  // the change of p_j less the largest rise of another price (within one phase start prices only drop: no rise).
  // The kept rows, plus the rows moved since (read again), then hold this rank's r smallest gaps as long as the
  // r-th of them lies below that bound. Same candidates, same selection: the labels and prices of a scan.
  struct KeptPull {
    std::vector<int64_t> rows;   // rows outside j at the scan (or moved since), the smallest gaps then
    double bound = kInf;         // every other row's gap at the scan, at least (kInf: there were no others)
    std::vector<double> prices;  // p_ at the scan
    size_t mark = 0;             // moved_.size() at the scan: rows moved after it are read again
    bool valid = false;
    int64_t keep = kKeptPull;    // rows the next scan keeps, at least; grows each time the kept ones did not suffice
  };
  std::vector<KeptPull> kept_;
  // Rows that changed cluster while some scan was kept (any_kept_), in order, repeats allowed: a scan's mark lies
  // past every move before it, so no one reads the moves made while none was kept.
  std::vector<int64_t> moved_;
  bool any_kept_ = false;
  std::vector<int64_t> seen_;   // per row, the last pull (pull_tick_) that took it as a candidate
  int64_t pull_tick_ = 0;

  void forget_pulls() {
    for (auto& c : kept_) c.valid = false;
    any_kept_ = false;
    moved_.clear();
  }

  void note_moved(const int64_t* rows, size_t count) {
    if (any_kept_) moved_.insert(moved_.end(), rows, rows + count);
  }

  // Candidates for j from the scan kept for it, if they provably hold this rank's r smallest gaps (then true,
  // cand and gap_ as a scan would leave them, up to order and rows beyond the r smallest).
  template <class Gap>
  bool kept_candidates(int64_t j, int64_t r, Gap gap, std::vector<int64_t>& cand) {
    KeptPull& kp = kept_[j];
    // Past kMovedReread rows moved since, reading them costs more than a scan.
    if (!kp.valid || moved_.size() - kp.mark > static_cast<size_t>(b_.n / kMovedReread)) return false;
    double rise = 0.0;  // the largest rise of another cluster's price since the scan
    for (int64_t o = 0; o < b_.k; ++o)
      if (o != j) rise = std::max(rise, p_[o] - kp.prices[o]);
    const double bound = kp.bound + (p_[j] - kp.prices[j]) - rise - rounding_margin();
    if (!(bound > -kInf)) return false;
    cand.clear();
    ++pull_tick_;
    auto take = [&](int64_t i) {
      if (seen_[i] == pull_tick_) return;
      seen_[i] = pull_tick_;
      if (gap(i, &gap_[i])) cand.push_back(i);
    };
    for (int64_t i : kp.rows) take(i);
    for (size_t e = kp.mark; e < moved_.size(); ++e) take(moved_[e]);
    if (kp.bound < kInf) {
      // The r-th smallest gap among the candidates must lie below every other row's gap now.
      int64_t below = 0;
      for (int64_t i : cand) below += gap_[i] < bound;
      if (below < r) {
        kp.keep = std::min(2 * kp.keep, kKeptPullMost);  // the next scan keeps more
        return false;
      }
      // From here on `bound` is the bound and these prices its prices: the candidates at or above it go, like
      // the rows never kept, and the rows moved so far are read.
      kp.rows.clear();
      for (int64_t i : cand)
        if (gap_[i] < bound) kp.rows.push_back(i);
      kp.bound = bound;
      kp.prices = p_;
    } else {
      kp.rows = cand;
    }
    kp.mark = moved_.size();
    return true;
  }

  // Candidates for j from every row: this rank's r smallest gaps and more, kept for j's next reverse steps
  // (kept_candidates).
  template <class Gap>
  void scan_candidates(int64_t j, int64_t r, Gap gap, std::vector<int64_t>& cand) {
    ++stats_.pull_scans;
    KeptPull& kp = kept_[j];
    const int64_t keep = std::max<int64_t>(2 * r, kp.keep);
    smallest_candidates(b_.n, keep, gap_.data(), gap, cand);
    kp.bound = kInf;
    if (static_cast<int64_t>(cand.size()) >= keep) {  // else no thread pruned: cand holds every row outside j
      std::nth_element(cand.begin(), cand.begin() + (keep - 1), cand.end(), KeyLess{gap_.data()});
      kp.bound = gap_[cand[keep - 1]];
      cand.resize(keep);
    }
    kp.rows = cand;
    kp.prices = p_;
    kp.mark = moved_.size();
    kp.valid = true;
    any_kept_ = true;
  }

  // After a phase: whether the labels are already optimal, exactly (auction_objects.h, exact_prices); if so the
  // prices become the exact ones and the later phases, which could only confirm it, are skipped. Only the pairs
  // (own cluster, other cluster) with a reduced cost difference below the reach (certify_reach) can matter, so a
  // point whose cached regret is at least that reads no row.
  bool certified() {
    const int64_t k = b_.k;
    const double reach = auction::certify_reach(k, eps_);
    std::vector<double> slack(static_cast<size_t>(k * k), kInf);
#pragma omp parallel
    {
      std::vector<double> local(static_cast<size_t>(k * k), kInf);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < b_.n; ++i) {
        const int64_t a = obj_[i];
        const double* Di = row(i);
        const double own = own_[i] + p_[a];  // own_[i] is Di[a]
        double sc;
        if (second_.get(i, a, &sc, [&](int64_t c) { return Di[c] + p_[c]; }) && !(sc - own < reach)) continue;
        double* la = local.data() + a * k;
        for (int64_t c = 0; c < k; ++c) {
          const double g = (Di[c] + p_[c]) - own;
          if (c != a && g < reach && g < la[c]) la[c] = g;
        }
      }
#pragma omp critical
      for (size_t e = 0; e < slack.size(); ++e) slack[e] = std::min(slack[e], local[e]);  // a min: any order
    }
    if (b_.comm.distributed()) {  // the minimum over the ranks, as a maximum of the negated values
      for (double& v : slack) v = -v;
      b_.comm.max(slack);
      for (double& v : slack) v = -v;
    }
    std::vector<double> exact;
    if (!auction::exact_prices(k, slack, p_, counts_, hi_, reach, exact)) return false;
    p_ = exact;
    return true;
  }

  // Largest rounding difference between a member's regret sc - (own + p_j) and key - p_j, key = sc - own, over
  // this problem's magnitudes (eps_final >= 64 DBL_EPSILON (max |cost| + max |initial price| + span); prices
  // grow during rounds, hence the current largest price).
  double rounding_margin() const {
    double pmax = 0.0;
    for (double p : p_) pmax = std::max(pmax, std::fabs(p));
    return es_.eps_final / 4.0 + 16.0 * DBL_EPSILON * pmax;
  }

  // Row i's exact cheapest other cost sc (with prices) while it is in cluster j.
  double second_cost(int64_t i, int64_t j) {
    const double* Di = row(i);
    return second_.value(i, j, b_.k, [&](int64_t c) { return Di[c] + p_[c]; });
  }

  // The heaps of the clusters in `over` not built yet in this phase: their members (one pass over the
  // labels for all of them) keyed at the current prices.
  void build_heaps(const std::vector<int64_t>& over) {
    std::vector<int64_t> slot(b_.k, -1), fresh;
    for (int64_t j : over) {
      if (built_[j]) continue;
      slot[j] = static_cast<int64_t>(fresh.size());
      fresh.push_back(j);
      built_[j] = 1;
    }
    if (fresh.empty()) return;
    group_rows(b_.n, static_cast<int64_t>(fresh.size()), [&](int64_t i) { return slot[obj_[i]]; }, members_);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t f = 0; f < static_cast<int64_t>(fresh.size()); ++f) {
      const int64_t j = fresh[f];
      auto& h = heap_[j];
      h.clear();
      const auto& mem = members_[f];
      for (size_t e = 0; e < mem.size(); ++e) {
        if (e + kPrefetchAhead < mem.size()) prefetch_row(mem[e + kPrefetchAhead]);
        h.push_back({second_cost(mem[e], j) - own_[mem[e]], mem[e]});
      }
      std::make_heap(h.begin(), h.end(), entry_after);
    }
  }

  // Into `cand`: members of the over-full cluster j popped from its heap, with their regrets (regret_) and
  // fresh keys (key_), at least this rank's `t` smallest regrets among them and every member that could tie
  // or beat the t-th (the rest stay in the heap, their keys lower bounds of their regrets plus p_j).
  void candidates(int64_t j, int64_t t, double margin, std::vector<int64_t>& cand) {
    auto& h = heap_[j];
    cand.clear();
    std::vector<double> best;  // the t smallest regrets popped so far, a max-heap
    const double pj = p_[j];
    while (!h.empty()) {
      if (static_cast<int64_t>(best.size()) >= t && h.front().key - pj - margin > best.front()) break;
      std::pop_heap(h.begin(), h.end(), entry_after);
      const int64_t i = h.back().row;
      h.pop_back();
      if (!h.empty()) prefetch_row(h.front().row);  // the likely next pop: its row arrives while this one is read
      const double sc = second_cost(i, j);
      key_[i] = sc - own_[i];
      regret_[i] = sc - (own_[i] + pj);  // own_[i] is row(i)[j]
      cand.push_back(i);
      if (static_cast<int64_t>(best.size()) < t) {
        best.push_back(regret_[i]);
        std::push_heap(best.begin(), best.end());
      } else if (regret_[i] < best.front()) {
        std::pop_heap(best.begin(), best.end());
        best.back() = regret_[i];
        std::push_heap(best.begin(), best.end());
      }
    }
  }

  // One forward round: every over-full cluster evicts its `excess` members with the smallest (regret,
  // row) and raises its price past the last of them; evicted points re-bid. False when none is over-full.
  bool round() {
    std::vector<int64_t> over, slot(b_.k, -1);
    for (int64_t j = 0; j < b_.k; ++j) {
      if (counts_[j] > hi_[j]) {
        slot[j] = static_cast<int64_t>(over.size());
        over.push_back(j);
      }
    }
    if (over.empty()) return false;
    if (++rounds_ > ap_.max_rounds) throw std::runtime_error("floor_auction: no termination (internal error)");
    const int64_t nover = static_cast<int64_t>(over.size());
    build_heaps(over);
    std::vector<int64_t> excess(nover);
    for (int64_t s = 0; s < nover; ++s) excess[s] = counts_[over[s]] - hi_[over[s]];
    const double margin = rounding_margin();
    members_.resize(nover);
#pragma omp parallel for schedule(dynamic, 1) if (nover > 1)
    for (int64_t s = 0; s < nover; ++s) candidates(over[s], excess[s], margin, members_[s]);
    const Threshold th = select_smallest(b_, regret_.data(), members_, excess);
    std::vector<int64_t> moved;
    for (int64_t s = 0; s < nover; ++s) {
      set_price(over[s], p_[over[s]] + th.val[s] + eps_);
      if (!std::isfinite(p_[over[s]])) throw std::runtime_error("floor_auction: infinite price (internal error)");
      counts_[over[s]] = hi_[over[s]];
      moved.insert(moved.end(), members_[s].begin(), members_[s].begin() + th.count[s]);
      auto& h = heap_[over[s]];
      for (size_t e = th.count[s]; e < members_[s].size(); ++e) {  // the candidates that stay
        h.push_back({key_[members_[s][e]], members_[s][e]});
        std::push_heap(h.begin(), h.end(), entry_after);
      }
    }
    rebid(moved);
    return true;
  }

  // Evicted points re-bid at the new prices, so no point sits more than eps from its best.
  void rebid(const std::vector<int64_t>& moved) {
    const int64_t nm = static_cast<int64_t>(moved.size());
    bool bad = false;
#pragma omp parallel for schedule(static) if (nm > 4096) reduction(|| : bad)
    for (int64_t e = 0; e < nm; ++e) {
      if (e + static_cast<int64_t>(kPrefetchAhead) < nm) prefetch_row(moved[e + kPrefetchAhead]);
      const Three t = cheapest_three(moved[e]);
      bad = bad || t.best < 0;
      obj_[moved[e]] = static_cast<int32_t>(t.best < 0 ? 0 : t.best);
      own_[moved[e]] = row(moved[e])[obj_[moved[e]]];
      second_.put(moved[e], obj_[moved[e]], t);
    }
    check_bids(bad, "floor_auction");
    note_moved(moved.data(), moved.size());
    std::vector<int64_t> came(b_.k, 0);
    for (int64_t e = 0; e < nm; ++e) {
      const int64_t i = moved[e], j = obj_[i];
      ++came[j];
      if (!built_[j]) continue;
      heap_[j].push_back({second_cost(i, j) - own_[i], i});
      std::push_heap(heap_[j].begin(), heap_[j].end(), entry_after);
    }
    b_.comm.sum(came);
    for (int64_t j = 0; j < b_.k; ++j) counts_[j] += came[j];
  }
};

// ------------------------------------------------------------------------------------------------
// A warm floor auction on a working set. Between two Lloyd iterations most points stay, by a wide margin, at the
// cluster that was cheapest at the previous prices p0. The floor auction then runs on the rows with the
// smallest margins only (the working set); every other row is held at its cheapest cluster at p0, and each
// cluster's cap loses the rows it holds. If every held row is still at a cheapest cluster at the prices p the
// auction ends with, the labels are optimal for the whole problem: at p every row is at its best (the working
// set's within the auction's eps, as a whole-problem auction leaves them) and every cluster with a positive
// price is full, which are the whole problem's optimality conditions. Held rows that are not join the working
// set and the auction runs again, until none is, or until the set holds a quarter of the rows: then the whole
// problem runs. The labels are those of the whole-problem auction wherever the optimum is unique; prices and rounds
// differ.
// ------------------------------------------------------------------------------------------------

// Below this many rows (all ranks), or below 3 clusters, the whole problem runs.
constexpr int64_t kWorkingSetMin = 4096;
// Nor does a working set run when the caps leave fewer than 1/kWorkingSetSlack of the rows free: with (nearly)
// exact balance every cluster is full, and the working set's problem takes about as many rounds as the whole one.
constexpr int64_t kWorkingSetSlack = 8;
// A working set that grows past 1/kWorkingSetMost of the rows costs about as much as the whole problem: the call
// solves the whole problem instead, and the next calls do so directly, 1, 2, 4, ... of them after each such call
// in a row (early Lloyd iterations move prices far; later ones, most of a run, little). The call after a cold
// start is one of them.
constexpr int64_t kWorkingSetMost = 4;
// The first working set: the rows with the smallest margins, 1/kWorkingSetFirst of them at least, and at least
// kWorkingSetGrow of the previous call's final set (most of that set was rows that joined).
constexpr int64_t kWorkingSetFirst = 32;
constexpr double kWorkingSetGrow = 0.625;
// A solve after more than 1/kWorkingSetRestart of the set joined starts again from p0; after fewer, from the last
// solve's prices with eps_warm / kWorkingSetCloseEps as its first eps.
constexpr int64_t kWorkingSetRestart = 10;
constexpr double kWorkingSetCloseEps = 8.0;

class WorkingSet {
 public:
  WorkingSet(const Block& b, const int64_t* hi, AuctionState& state, int32_t* obj, const AuctionParams& ap)
      : b_(b), hi_(hi), state_(state), obj_(obj), ap_(ap), p0_(state.floor_prices), best_(b.n), second_(b.n),
        gap_(b.n), gap3_(b.n), in_(b.n, 0) {}

  // Whether a call runs on a working set: the parameter on, warm prices, a problem large enough, caps with slack,
  // and no pause. A call in a pause counts it down; a cold call starts one (the first Lloyd step moves the centroids
  // far, so the call after it solves whole).
  static bool applies(const Block& b, const int64_t* hi, AuctionState& state, const AuctionParams& ap) {
    if (static_cast<int64_t>(state.floor_prices.size()) != b.k) {
      state.working = {0, 1, 1};
      return false;
    }
    if (!ap.working_set || b.rows != nullptr || b.k < 3 || b.n_total < kWorkingSetMin) return false;
    if (kWorkingSetSlack * free_places(b, hi) < b.n_total) return false;
    if (state.working.skip == 0) return true;
    --state.working.skip;
    return false;
  }

  // Labels into obj (every row of the block) and prices into the state, as FloorAuction::run; the rounds.
  int64_t run() {
    margins();
    first_set();
    ++state_.stats.working_calls;
    int64_t rounds = 0, joined = 0;
    for (int64_t solves = 0;; ++solves) {
      const std::vector<int64_t> caps = set_caps();
      rows_.clear();
      for (int64_t i = 0; i < b_.n; ++i)
        if (in_[i]) rows_.push_back(i);
      std::vector<int64_t> size{static_cast<int64_t>(rows_.size())};
      b_.comm.sum(size);
      if (kWorkingSetMost * size[0] > b_.n_total) return rounds + whole();
      double eps = 0.0;  // the schedule's
      if (solves > 0) {
        // Many rows joined: the set's prices were far from the whole problem's, start again from p0. A few: the
        // prices are close, and a smaller first eps keeps most of what the last solve found.
        if (kWorkingSetRestart * joined > size[0]) state_.floor_prices = p0_;
        else eps = ap_.eps_warm * range_.span / kWorkingSetCloseEps;
      }
      const Block set{b_.D, static_cast<int64_t>(rows_.size()), b_.k, b_.comm, b_.offset, size[0], rows_.data()};
      std::vector<int32_t> set_obj(rows_.size());
      rounds += FloorAuction(set, caps.data(), state_, set_obj.data(), ap_, range_, eps).run();
      ++state_.stats.working_solves;
      joined = join_violators();
      if (joined > 0) continue;
      state_.working = {size[0], 0, 0};
      state_.stats.working_rows += size[0];
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < b_.n; ++i) obj_[i] = best_[i];
      for (size_t e = 0; e < rows_.size(); ++e) obj_[rows_[e]] = set_obj[e];
      return rounds;
    }
  }

  // The cost range of every row (checked), for the auctions and the general auction after them.
  const CostRange& range() const { return range_; }

 private:
  const Block& b_;
  const int64_t* hi_;
  AuctionState& state_;
  int32_t* obj_;
  const AuctionParams& ap_;
  CostRange range_;
  const std::vector<double> p0_;
  std::vector<int32_t> best_, second_;  // per row, its cheapest and second cheapest cluster at p0_
  std::vector<double> gap_, gap3_;      // their cost differences: second less cheapest, third less cheapest
  std::vector<char> in_;                // whether the row is in the working set
  std::vector<int64_t> rows_;           // the working set's rows, ascending

  // The whole problem, from p0 (a working set's prices can lie far from the whole problem's), and a pause of the
  // working set: 1, 2, 4, ... calls for each such call in a row.
  int64_t whole() {
    ++state_.stats.working_whole;
    AuctionState::Working& w = state_.working;
    w.rows = 0;
    w.pause = std::max<int64_t>(1, 2 * w.pause);
    w.skip = w.pause;
    state_.floor_prices = p0_;
    return FloorAuction(b_, hi_, state_, obj_, ap_, range_).run();
  }

  // One pass over the rows: each one's three cheapest clusters at p0_, and the cost range (the check of the costs).
  void margins() {
    double span = 0.0, amax = 0.0, bad = -kInf;
    const int64_t k = b_.k;
#pragma omp parallel for schedule(static) reduction(max : span, amax, bad)
    for (int64_t i = 0; i < b_.n; ++i) {
      const double* Di = b_.row(i);
      RowRange r;
      const Three t = best_three(k, [&](int64_t j) {
        r.add(Di[j]);
        return Di[j] + p0_[j];
      });
      if (!r.fold(b_.gid(i), &span, &amax, &bad)) continue;
      best_[i] = static_cast<int32_t>(t.best);
      second_[i] = static_cast<int32_t>(t.second);
      gap_[i] = t.sc - t.bc;
      gap3_[i] = t.tc - t.bc;
    }
    range_ = agree_range(b_, span, amax, bad);
  }

  // The rows with the smallest margins (all ranks), as many as the previous call's final set and some more.
  void first_set() {
    const int64_t least = b_.n_total / kWorkingSetFirst;
    const auto grown = static_cast<int64_t>(kWorkingSetGrow * static_cast<double>(state_.working.rows));
    const int64_t want = std::min(b_.n_total, std::max(least, grown));
    std::vector<std::vector<int64_t>> cand(1);
    smallest_candidates(b_.n, want, gap_.data(), [&](int64_t i, double* v) { return *v = gap_[i], true; }, cand[0]);
    const Threshold th = select_smallest(b_, gap_.data(), cand, {want});
    for (int64_t e = 0; e < th.count[0]; ++e) in_[cand[0][e]] = 1;
  }

  // The caps of the working set: hi less the rows each cluster holds. A cluster that would hold more than its
  // cap first gives its held rows with the smallest margins to the working set.
  std::vector<int64_t> set_caps() {
    std::vector<int64_t> count(b_.k, 0);
    for (int64_t i = 0; i < b_.n; ++i) count[best_[i]] += !in_[i];
    b_.comm.sum(count);
    std::vector<int64_t> over(b_.k, 0);
    bool any = false;
    for (int64_t j = 0; j < b_.k; ++j) {
      over[j] = std::max<int64_t>(0, count[j] - hi_[j]);
      any = any || over[j] > 0;
    }
    if (any) {  // the same on every rank: the counts are global
      std::vector<std::vector<int64_t>> held;
      group_rows(b_.n, b_.k, [&](int64_t i) { return in_[i] || over[best_[i]] == 0 ? int64_t{-1} : best_[i]; }, held);
      const Threshold th = select_smallest(b_, gap_.data(), held, over);
      for (int64_t j = 0; j < b_.k; ++j) {
        for (int64_t e = 0; e < th.count[j]; ++e) in_[held[j][e]] = 1;
        count[j] -= over[j];
      }
    }
    std::vector<int64_t> caps(b_.k);
    for (int64_t j = 0; j < b_.k; ++j) caps[j] = hi_[j] - count[j];
    return caps;
  }

  // The held rows that are not at a cheapest cluster at the prices now join the working set; how many (all
  // ranks). A row's clusters other than its two cheapest at p0 stay at or above its own while its third margin
  // exceeds the rise of its own price less the largest drop of another (plus rounding): only the others read
  // their row.
  int64_t join_violators() {
    const std::vector<double>& p = state_.floor_prices;
    const int64_t k = b_.k;
    std::vector<double> dp(k);
    double least = kInf, pmax = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      dp[j] = p[j] - p0_[j];
      least = std::min(least, dp[j]);
      pmax = std::max(pmax, std::max(std::fabs(p[j]), std::fabs(p0_[j])));
    }
    const double margin = 16.0 * DBL_EPSILON * (range_.amax + pmax);
    int64_t joined = 0;
#pragma omp parallel for schedule(static) reduction(+ : joined)
    for (int64_t i = 0; i < b_.n; ++i) {
      if (in_[i]) continue;
      const int64_t a = best_[i], s = second_[i];
      const double* Di = b_.row(i);
      const double own = Di[a] + p[a];
      double other = Di[s] + p[s];
      if (other >= own && !(gap3_[i] >= dp[a] - least + margin)) {
        for (int64_t j = 0; j < k; ++j)
          if (j != a) other = std::min(other, Di[j] + p[j]);
      }
      if (other < own) {
        in_[i] = 1;
        ++joined;
      }
    }
    std::vector<int64_t> total{joined};
    b_.comm.sum(total);
    return total[0];
  }
};

// ------------------------------------------------------------------------------------------------
// The general problem lo_j <= size_j <= hi_j: each cluster is split into a mandatory object (lo slots,
// real points only) and an optional one (hi - lo slots), and sum(hi) - n zero-cost dummy units fill the
// optional slots that real points leave free, so every object ends exactly full. A plain forward auction
// then applies; it is slower than the floor form when there is slack (the dummies trade places in eps
// steps), so it only runs when the lower bounds bind.
// ------------------------------------------------------------------------------------------------

class DummyAuction {
 public:
  DummyAuction(const Block& b, const int64_t* lo, const int64_t* hi, std::vector<double>& prices,
               const AuctionParams& ap, const CostRange& range)
      : b_(b), ob_(lo, hi, b.k), m_(ob_.size()), p_(prices), ap_(ap), obj_(b.n), own_(b.n), regret_(b.n),
        second_(b.n, m_) {
    const bool warm = static_cast<int64_t>(p_.size()) == m_;
    if (!warm) p_.assign(m_, 0.0);
    es_ = eps_schedule(range, p_, warm, ap);
    eps_ = es_.eps;
    // Cold and warm start alike: every unit takes its cheapest object.
    bool bad = false;
#pragma omp parallel for schedule(static) reduction(|| : bad)
    for (int64_t i = 0; i < b.n; ++i) {
      const Three t = cheapest_three(i);
      bad = bad || t.best < 0;
      obj_[i] = static_cast<int32_t>(t.best < 0 ? 0 : t.best);
      set_own(i);
      second_.put(i, obj_[i], t);
    }
    check_bids(bad, "auction_assign");
    real_ = global_counts(b, obj_.data(), m_);
    int64_t n_dummy = -b.n_total;
    for (int64_t j = 0; j < b.k; ++j) n_dummy += hi[j];
    dummies_ = auction::place_dummies(p_, ob_, real_, n_dummy);
    lb_.assign(m_, -kInf);
    exact_ = dummies_exact();
  }

  int64_t run(int64_t* labels) {
    for (;;) {
      if (settled()) break;
      while (round()) {
      }
      if (eps_ <= es_.eps_final) break;
      next_phase();
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < b_.n; ++i) labels[i] = ob_.cluster[obj_[i]];
    return rounds_;
  }

 private:
  // One object over capacity in this round.
  struct Over {
    int64_t o, excess;
    double rho;            // price step at which a dummy leaves for the cheapest other dummy object
    bool scan;             // whether real members may leave (their regrets are needed)
    int64_t n_real = 0, n_dum = 0;
    double last = -kInf;   // the price rise less eps: the last evicted unit's regret
    double rest = kInf;    // smallest regret among the local real members that stay
  };

  const Block& b_;
  const Objects ob_;
  const int64_t m_;
  bool exact_ = false;  // after the last phase start: every unit (all ranks) at its exact cheapest object
  std::vector<double>& p_;
  const AuctionParams& ap_;
  EpsSchedule es_{};
  double eps_ = 0.0;
  int64_t rounds_ = 0;
  std::vector<int32_t> obj_;
  std::vector<int64_t> real_, dummies_;
  // lb_[o]: lower bound on the smallest regret among o's real members (all ranks). It lets a round that
  // only evicts dummies skip the O(members * m) regret scan: rising prices elsewhere only raise regrets, a
  // raise of o's own price lowers them all by the same amount, and arrivals report theirs.
  std::vector<double> own_, lb_, regret_;  // own_[i]: unit i's cost entry D[i, cluster(obj_[i])], kept with obj_
  std::vector<std::vector<int64_t>> members_;
  SecondCache second_;

  double cost(int64_t i, int64_t o) const { return b_.row(i)[ob_.cluster[o]] + p_[o]; }
  void set_own(int64_t i) { own_[i] = b_.row(i)[ob_.cluster[obj_[i]]]; }

  Three cheapest_three(int64_t i) const {
    return best_three(m_, [&](int64_t o) { return cost(i, o); });
  }

  // Whether every dummy sits in an object priced exactly as the cheapest dummy-capable one.
  bool dummies_exact() const {
    const int64_t cheapest = cheapest_dummy_object(p_, ob_, -1);
    for (int64_t o = 0; o < m_; ++o)
      if (dummies_[o] > 0 && p_[o] > p_[cheapest]) return false;
    return true;
  }

  // At a phase start: every unit at its exact cheapest object (ties count) and no object over capacity. The
  // assignment is then optimal for these prices and every later phase would move no unit and run no round:
  // they are skipped (as FloorAuction::settled). exact_ and the counts are global: every rank agrees.
  bool settled() const {
    if (!exact_) return false;
    for (int64_t o = 0; o < m_; ++o)
      if (real_[o] + dummies_[o] > ob_.cap[o]) return false;
    return true;
  }

  std::vector<Over> over_objects() {
    std::vector<Over> over;
    for (int64_t o = 0; o < m_; ++o) {
      if (real_[o] + dummies_[o] <= ob_.cap[o]) continue;
      const int64_t excess = real_[o] + dummies_[o] - ob_.cap[o];
      const int64_t dst = cheapest_dummy_object(p_, ob_, o);
      const double rho = (dummies_[o] > 0 && dst >= 0) ? p_[dst] - p_[o] : kInf;
      over.push_back({o, excess, rho, !(excess <= dummies_[o] && rho <= lb_[o])});
    }
    return over;
  }

  // Regrets of the real members of the scanned objects, and those members per object.
  void scan(const std::vector<Over>& over) {
    std::vector<int64_t> slot(m_, -1);
    bool any = false;
    for (int64_t s = 0; s < static_cast<int64_t>(over.size()); ++s) {
      if (!over[s].scan) continue;
      slot[over[s].o] = s;
      any = true;
    }
    members_.resize(over.size());
    for (auto& m : members_) m.clear();
    if (!any) return;
    group_rows(b_.n, static_cast<int64_t>(over.size()), [&](int64_t i) {
      const int64_t o = obj_[i];
      if (slot[o] < 0) return int64_t{-1};
      const double sc = second_.value(i, o, m_, [&](int64_t q) { return cost(i, q); });
      regret_[i] = sc - (own_[i] + p_[o]);  // cost(i, o) without reading the scattered row
      return slot[o];
    }, members_);
  }

  // How many real units and dummies leave each object, and the last one's regret. The units leave in
  // the order of the reference: reals with regret < rho, then the dummies (first on equal regret), then
  // the other reals, each group by (regret, row).
  void split_evictions(std::vector<Over>& over) {
    const int64_t nover = static_cast<int64_t>(over.size());
    std::vector<int64_t> below(nover, 0);
    bool need = false;
    for (int64_t s = 0; s < nover; ++s) {
      if (!over[s].scan || dummies_[over[s].o] == 0) continue;
      need = true;
      for (int64_t i : members_[s]) below[s] += regret_[i] < over[s].rho;
    }
    if (need) b_.comm.sum(below);
    std::vector<int64_t> want(nover, 0);
    for (int64_t s = 0; s < nover; ++s) {
      Over& v = over[s];
      const int64_t d = dummies_[v.o];
      if (!v.scan) {
        v.n_dum = v.excess;  // only dummies leave: rho <= every real member's regret
        v.last = v.rho;
        continue;
      }
      v.n_real = d == 0 || v.excess <= below[s] ? v.excess : std::max(v.excess - d, below[s]);
      v.n_dum = v.excess - v.n_real;
      want[s] = v.n_real;
    }
    const Threshold th = select_smallest(b_, regret_.data(), members_, want);
    for (int64_t s = 0; s < nover; ++s) {
      Over& v = over[s];
      if (!v.scan) continue;
      v.last = v.n_dum > 0 && v.n_real <= below[s] ? v.rho : th.val[s];
      const auto& mem = members_[s];
      for (auto it = mem.begin() + th.count[s]; it != mem.end(); ++it) v.rest = std::min(v.rest, regret_[*it]);
      members_[s].resize(th.count[s]);  // the local reals that leave
    }
  }

  // One forward round over the objects above capacity; false when none is.
  bool round() {
    std::vector<Over> over = over_objects();
    if (over.empty()) return false;
    if (++rounds_ > ap_.max_rounds) throw std::runtime_error("auction_assign: no termination (internal error)");
    scan(over);
    split_evictions(over);
    std::vector<double> lb = lb_;  // the bounds after this round, this rank's view
    std::vector<int64_t> moved;
    int64_t dummy_total = 0;
    for (const Over& v : over) {
      const double delta = v.last + eps_;
      const double price = p_[v.o] + delta;
      if (!std::isfinite(price)) throw std::runtime_error("auction_assign: infinite price (internal error)");
      second_.price(v.o, p_[v.o], price);
      p_[v.o] = price;
      lb[v.o] = (v.scan ? v.rest : lb_[v.o]) - delta;
      real_[v.o] -= v.n_real;
      dummies_[v.o] -= v.n_dum;
      dummy_total += v.n_dum;
    }
    for (size_t s = 0; s < over.size(); ++s) moved.insert(moved.end(), members_[s].begin(), members_[s].end());
    rebid(moved, lb);
    if (dummy_total > 0) dummies_[cheapest_dummy_object(p_, ob_, -1)] += dummy_total;
    return true;
  }

  // Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best; arrivals
  // lower the bound of their new object to their regret. lb: the bounds before the arrivals.
  void rebid(const std::vector<int64_t>& moved, std::vector<double>& lb) {
    const int64_t nm = static_cast<int64_t>(moved.size());
    std::vector<double> arrival(nm);
    bool bad = false;
#pragma omp parallel for schedule(static) if (nm > 4096) reduction(|| : bad)
    for (int64_t e = 0; e < nm; ++e) {
      const int64_t i = moved[e];
      const Three t = cheapest_three(i);
      bad = bad || t.best < 0;
      obj_[i] = static_cast<int32_t>(t.best < 0 ? 0 : t.best);
      set_own(i);
      arrival[e] = t.sc - t.bc;
      second_.put(i, obj_[i], t);
    }
    check_bids(bad, "auction_assign");
    std::vector<int64_t> came(m_, 0);
    for (int64_t e = 0; e < nm; ++e) {
      const int64_t o = obj_[moved[e]];
      ++came[o];
      lb[o] = std::min(lb[o], arrival[e]);
    }
    if (b_.comm.distributed()) {
      b_.comm.sum(came);
      for (double& v : lb) v = -v;  // a min as a max
      b_.comm.max(lb);
      for (double& v : lb) v = -v;
    }
    for (int64_t o = 0; o < m_; ++o) real_[o] += came[o];
    lb_.swap(lb);
  }

  // Next phase: shrink eps and move every unit that violates it to its cheapest object.
  void next_phase() {
    eps_ = std::max(eps_ / ap_.eps_shrink, es_.eps_final);
    bool bad = false;
    int64_t inexact = 0;  // units left above their exact best (within eps of it)
#pragma omp parallel for schedule(static) reduction(|| : bad) reduction(+ : inexact)
    for (int64_t i = 0; i < b_.n; ++i) {
      const Three t = cheapest_three(i);
      if (t.best < 0) {
        bad = true;
        continue;
      }
      const double own = cost(i, obj_[i]);
      if (own > t.bc + eps_) {
        obj_[i] = static_cast<int32_t>(t.best);
        set_own(i);
      } else {
        inexact += own > t.bc;
      }
      second_.put(i, obj_[i], t);
    }
    check_bids(bad, "auction_assign");
    real_ = global_counts(b_, obj_.data(), m_, &inexact);
    exact_ = inexact == 0;
    std::fill(lb_.begin(), lb_.end(), -kInf);
    const int64_t cheapest = cheapest_dummy_object(p_, ob_, -1);
    for (int64_t o = 0; o < m_; ++o) {
      if (o != cheapest && dummies_[o] > 0 && p_[o] > p_[cheapest] + eps_) {
        dummies_[cheapest] += dummies_[o];
        dummies_[o] = 0;
      }
    }
    exact_ = exact_ && dummies_exact();
  }
};

}  // namespace

void Collective::select(const std::vector<int64_t>& grp, const std::vector<double>& val,
                        const std::vector<int64_t>& gid, const std::vector<int64_t>& t, std::vector<double>& tv,
                        std::vector<int64_t>& tg) {
  const int64_t groups = static_cast<int64_t>(t.size());
  std::vector<std::vector<int64_t>> by_group(groups);
  for (int64_t e = 0; e < static_cast<int64_t>(grp.size()); ++e) by_group[grp[e]].push_back(e);
  tv.assign(groups, kInf);
  tg.assign(groups, kNoRow);
  for (int64_t g = 0; g < groups; ++g) {
    auto& es = by_group[g];
    if (static_cast<int64_t>(es.size()) < t[g]) continue;
    auto less = [&](int64_t a, int64_t b) { return val[a] < val[b] || (val[a] == val[b] && gid[a] < gid[b]); };
    std::nth_element(es.begin(), es.begin() + (t[g] - 1), es.end(), less);
    tv[g] = val[es[t[g] - 1]];
    tg[g] = gid[es[t[g] - 1]];
  }
}

int64_t auction_assign(const double* D, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap, Collective& comm,
                       const RowBlock& rows) {
  const Block b{D, n, k, comm, rows.offset, rows.n_total};
  if (ap.force_general) {
    state.used_general = true;
    return DummyAuction(b, lo, hi, state.general_prices, ap, cost_range(b)).run(labels);
  }
  std::vector<int32_t> obj(n);
  CostRange range;
  int64_t rounds;
  if (WorkingSet::applies(b, hi, state, ap)) {
    WorkingSet ws(b, hi, state, obj.data(), ap);
    rounds = ws.run();
    range = ws.range();
  } else {
    range = cost_range(b);
    rounds = FloorAuction(b, hi, state, obj.data(), ap, range).run();
  }
  const std::vector<int64_t> sizes = global_counts(b, obj.data(), k);
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
  return rounds + DummyAuction(b, lo, hi, state.general_prices, ap, range).run(labels);
}

int64_t auction_assign(const double* D, int64_t n, int64_t k, const int64_t* lo, const int64_t* hi,
                       AuctionState& state, int64_t* labels, const AuctionParams& ap) {
  Collective one;
  return auction_assign(D, n, k, lo, hi, state, labels, ap, one, RowBlock{0, n});
}

}  // namespace cluster_kernels
