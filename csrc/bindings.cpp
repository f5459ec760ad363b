// pybind11 bindings of cluster_kernels._C (no torch headers: numpy buffers on the CPU, raw device
// pointers and a CUDA stream handle for the CUDA path, so the extension does not depend on torch's ABI).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/auction.h"
#include "cpu/kmeans.h"
#include "cpu/thread_scope.h"
#ifdef CLUSTER_KERNELS_WITH_CUDA
#include "cuda/kmeans.cuh"
#endif

namespace py = pybind11;
namespace ck = cluster_kernels;

namespace {

template <typename T>
using carray = py::array_t<T, py::array::c_style>;

std::vector<int64_t> bounds_vec(const carray<int64_t>& a, int64_t k, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != k) throw std::invalid_argument(std::string(name) + " must have shape (k,)");
  return std::vector<int64_t>(a.data(), a.data() + k);
}

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// The BLAS of the distance tiles: None, or (address of cblas_sgemm, address of cblas_dgemm, ILP64) as
// cluster_kernels._blas.gemm() gives them (an address may be 0).
ck::Blas blas_of(const std::optional<std::tuple<uintptr_t, uintptr_t, bool>>& blas) {
  ck::Blas b;
  if (blas) std::tie(b.sgemm, b.dgemm, b.ilp64) = *blas;
  return b;
}

template <typename T>
py::dict kmeans_cpu(const carray<T>& x, int64_t k, const carray<int64_t>& lo, const carray<int64_t>& hi,
                    bool spherical, int n_init, int max_iter, double tol, uint64_t seed,
                    std::optional<carray<T>> init, int n_threads,
                    std::optional<std::tuple<uintptr_t, uintptr_t, bool>> blas) {
  if (x.ndim() != 2) throw std::invalid_argument("x must be 2-D");
  const int64_t n = x.shape(0), d = x.shape(1);
  if (init && (init->ndim() != 2 || init->shape(0) != k || init->shape(1) != d))
    throw std::invalid_argument("init must have shape (k, d)");
  auto lo_v = bounds_vec(lo, k, "lo");
  auto hi_v = bounds_vec(hi, k, "hi");
  ck::KMeansParams p;
  p.k = k;
  p.spherical = spherical;
  p.n_init = n_init;
  p.max_iter = max_iter;
  p.tol = tol;
  p.seed = seed;
  p.n_threads = n_threads;
  const ck::Blas gemm = blas_of(blas);
  p.blas = &gemm;
  const T* init_ptr = init ? init->data() : nullptr;
  ck::KMeansResult out;
  {
    py::gil_scoped_release release;
    out = ck::capacity_kmeans<T>(x.data(), n, d, lo_v.data(), hi_v.data(), init_ptr, p);
  }
  py::dict r;
  r["labels"] = to_numpy(out.labels, {n});
  r["centroids"] = to_numpy(out.centroids, {k, d});
  r["distances"] = to_numpy(out.distances, {n});
  r["inertia"] = out.inertia;
  r["history"] = out.history;
  r["n_iter"] = out.n_iter;
  r["converged"] = out.converged;
  r["auction_rounds"] = out.auction_rounds;
  r["auction_pulls"] = out.auction.pulls;
  r["auction_pull_scans"] = out.auction.pull_scans;
  r["auction_working_calls"] = out.auction.working_calls;
  r["auction_working_solves"] = out.auction.working_solves;
  r["auction_working_whole"] = out.auction.working_whole;
  r["auction_working_rows"] = out.auction.working_rows;
  const ck::PhaseTimes& ph = out.seconds;
  py::dict seconds;
  seconds["prepare"] = ph.prepare;
  seconds["init"] = ph.init;
  seconds["distance"] = ph.distance;
  seconds["auction"] = ph.auction;
  seconds["objective"] = ph.objective;
  seconds["update"] = ph.update;
  seconds["finish"] = ph.finish;
  r["seconds"] = seconds;
  return r;
}

template <typename T>
py::tuple assign_cpu(const carray<T>& x, const carray<T>& centroids, const carray<int64_t>& lo,
                     const carray<int64_t>& hi, bool spherical, int n_threads,
                     std::optional<std::tuple<uintptr_t, uintptr_t, bool>> blas) {
  if (x.ndim() != 2 || centroids.ndim() != 2 || centroids.shape(1) != x.shape(1))
    throw std::invalid_argument("x must be (n, d) and centroids (k, d)");
  const int64_t n = x.shape(0), d = x.shape(1), k = centroids.shape(0);
  auto lo_v = bounds_vec(lo, k, "lo");
  auto hi_v = bounds_vec(hi, k, "hi");
  py::array_t<int64_t> labels({n});
  py::array_t<double> dist({n});
  int64_t* lp = labels.mutable_data();
  double* dp = dist.mutable_data();
  {
    py::gil_scoped_release release;
    const ck::Blas gemm = blas_of(blas);
    ck::assign_with_capacity<T>(x.data(), n, d, centroids.data(), k, lo_v.data(), hi_v.data(), spherical,
                                n_threads, lp, dp, &gemm);
  }
  return py::make_tuple(labels, dist);
}

py::tuple auction(const carray<double>& dist, const carray<int64_t>& lo, const carray<int64_t>& hi,
                  bool force_general) {
  if (dist.ndim() != 2) throw std::invalid_argument("dist must be (n, k)");
  const int64_t n = dist.shape(0), k = dist.shape(1);
  auto lo_v = bounds_vec(lo, k, "lo");
  auto hi_v = bounds_vec(hi, k, "hi");
  ck::AuctionState state;
  ck::AuctionParams ap;
  ap.force_general = force_general;
  py::array_t<int64_t> labels({n});
  int64_t* lp = labels.mutable_data();
  int64_t rounds;
  {
    py::gil_scoped_release release;
    rounds = ck::auction_assign(dist.data(), n, k, lo_v.data(), hi_v.data(), state, lp, ap);
  }
  return py::make_tuple(labels, rounds, state.used_general);
}

// The collectives of a Python object for the auction of one rank of many: `distributed` (bool), `sum(a)`
// (int64 array -> its all-reduced sum), `max(a)` (float64 array -> its all-reduced max) and
// `select(grp, val, gid, t)` (-> thresholds (tv, tg), as ck::Collective::select). The auction runs without
// the GIL; each call takes it back.
class PyCollective : public ck::Collective {
 public:
  explicit PyCollective(py::object comm) : comm_(std::move(comm)), distributed_(comm_.attr("distributed").cast<bool>()) {}
  bool distributed() const override { return distributed_; }

  void sum(std::vector<int64_t>& v) override {
    py::gil_scoped_acquire gil;
    copy_back(comm_.attr("sum")(array_of(v)), v, "sum");
  }

  void max(std::vector<double>& v) override {
    py::gil_scoped_acquire gil;
    copy_back(comm_.attr("max")(array_of(v)), v, "max");
  }

  void select(const std::vector<int64_t>& grp, const std::vector<double>& val, const std::vector<int64_t>& gid,
              const std::vector<int64_t>& t, std::vector<double>& tv, std::vector<int64_t>& tg) override {
    py::gil_scoped_acquire gil;
    auto out = comm_.attr("select")(array_of(grp), array_of(val), array_of(gid), array_of(t)).cast<py::tuple>();
    tv.resize(t.size());
    tg.resize(t.size());
    copy_back(out[0], tv, "select");
    copy_back(out[1], tg, "select");
  }

 private:
  py::object comm_;
  bool distributed_;

  template <typename T>
  static py::array_t<T> array_of(const std::vector<T>& v) {
    return to_numpy(v, {static_cast<py::ssize_t>(v.size())});
  }

  template <typename T>
  static void copy_back(const py::handle& result, std::vector<T>& v, const char* what) {
    auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(result);
    if (!a || a.ndim() != 1 || a.shape(0) != static_cast<py::ssize_t>(v.size()))
      throw std::runtime_error(std::string("auction_block: comm.") + what + " returned an array of the wrong shape");
    std::copy(a.data(), a.data() + v.size(), v.begin());
  }
};

std::vector<double> prices_vec(const std::optional<carray<double>>& a) {
  if (!a) return {};
  return std::vector<double>(a->data(), a->data() + a->size());
}

// The auction of one rank: dist holds rows [offset, offset + n) of the global (n_total, k) cost matrix.
py::dict auction_block(const carray<double>& dist, const carray<int64_t>& lo, const carray<int64_t>& hi,
                       py::object comm, int64_t offset, int64_t n_total, std::optional<carray<double>> floor_prices,
                       std::optional<carray<double>> general_prices, int n_threads,
                       std::optional<carray<int64_t>> working, bool working_set) {
  if (dist.ndim() != 2) throw std::invalid_argument("dist must be (n, k)");
  const int64_t n = dist.shape(0), k = dist.shape(1);
  auto lo_v = bounds_vec(lo, k, "lo");
  auto hi_v = bounds_vec(hi, k, "hi");
  ck::AuctionState state;
  state.floor_prices = prices_vec(floor_prices);
  state.general_prices = prices_vec(general_prices);
  if (working) {
    if (working->size() != 3) throw std::invalid_argument("working must be the (3,) array a previous call returned");
    state.working = {working->data()[0], working->data()[1], working->data()[2]};
  }
  ck::AuctionParams params;
  params.working_set = working_set;
  PyCollective collective(std::move(comm));
  py::array_t<int64_t> labels({n});
  int64_t* lp = labels.mutable_data();
  int64_t rounds;
  {
    py::gil_scoped_release release;
    ck::ThreadScope threads(n_threads);
    rounds = ck::auction_assign(dist.data(), n, k, lo_v.data(), hi_v.data(), state, lp, params, collective,
                                ck::RowBlock{offset, n_total});
  }
  py::dict r;
  r["labels"] = labels;
  r["rounds"] = rounds;
  r["used_general"] = state.used_general;
  r["floor_prices"] = to_numpy(state.floor_prices, {static_cast<py::ssize_t>(state.floor_prices.size())});
  r["general_prices"] = to_numpy(state.general_prices, {static_cast<py::ssize_t>(state.general_prices.size())});
  r["pulls"] = state.stats.pulls;
  r["pull_scans"] = state.stats.pull_scans;
  r["working"] = to_numpy(std::vector<int64_t>{state.working.rows, state.working.skip, state.working.pause}, {3});
  r["working_calls"] = state.stats.working_calls;
  r["working_solves"] = state.stats.working_solves;
  r["working_whole"] = state.stats.working_whole;
  return r;
}

#ifdef CLUSTER_KERNELS_WITH_CUDA
// The CUDA entry points take raw device pointers (tensor.data_ptr()) and the caller's stream handle
// (torch.cuda.current_stream().cuda_stream); outputs are preallocated by the caller.
void bind_cuda(py::module_& m) {
  m.def("cuda_device_count", &ck::cuda::device_count, "Number of CUDA devices the runtime sees (0 without a driver).");
  m.def(
      "kmeans_cuda",
      [](uintptr_t x, bool is_double, int64_t n, int64_t d, int64_t k, const carray<int64_t>& lo,
         const carray<int64_t>& hi, bool spherical, int n_init, int max_iter, double tol, uint64_t seed, uintptr_t init,
         uintptr_t labels, uintptr_t centroids, uintptr_t distances, uintptr_t stream, int device) {
        auto lo_v = bounds_vec(lo, k, "lo");
        auto hi_v = bounds_vec(hi, k, "hi");
        ck::KMeansParams p;
        p.k = k;
        p.spherical = spherical;
        p.n_init = n_init;
        p.max_iter = max_iter;
        p.tol = tol;
        p.seed = seed;
        ck::KMeansResult r;
        {
          py::gil_scoped_release release;
          r = ck::cuda::capacity_kmeans(x, is_double, n, d, lo_v.data(), hi_v.data(), init, p, labels, centroids,
                                        distances, stream, device);
        }
        py::dict out;
        out["history"] = r.history;
        out["n_iter"] = r.n_iter;
        out["converged"] = r.converged;
        out["inertia"] = r.inertia;
        out["auction_rounds"] = r.auction_rounds;
        return out;
      },
      py::arg("x"), py::arg("is_double"), py::arg("n"), py::arg("d"), py::arg("k"), py::arg("lo"), py::arg("hi"),
      py::arg("spherical"), py::arg("n_init"), py::arg("max_iter"), py::arg("tol"), py::arg("seed"), py::arg("init"),
      py::arg("labels"), py::arg("centroids"), py::arg("distances"), py::arg("stream"), py::arg("device"));
  m.def(
      "assign_cuda",
      [](uintptr_t x, bool is_double, int64_t n, int64_t d, uintptr_t centroids, int64_t k, const carray<int64_t>& lo,
         const carray<int64_t>& hi, bool spherical, uintptr_t labels, uintptr_t distances, uintptr_t stream,
         int device) {
        auto lo_v = bounds_vec(lo, k, "lo");
        auto hi_v = bounds_vec(hi, k, "hi");
        py::gil_scoped_release release;
        ck::cuda::assign_with_capacity(x, is_double, n, d, centroids, k, lo_v.data(), hi_v.data(), spherical,
                                       labels, distances, stream, device);
      },
      py::arg("x"), py::arg("is_double"), py::arg("n"), py::arg("d"), py::arg("centroids"), py::arg("k"),
      py::arg("lo"), py::arg("hi"), py::arg("spherical"), py::arg("labels"), py::arg("distances"), py::arg("stream"),
      py::arg("device"));
  m.def(
      "auction_assign_cuda",
      [](uintptr_t dist, int64_t n, int64_t k, const carray<int64_t>& lo, const carray<int64_t>& hi, uintptr_t labels,
         uintptr_t stream, int device) {
        auto lo_v = bounds_vec(lo, k, "lo");
        auto hi_v = bounds_vec(hi, k, "hi");
        py::gil_scoped_release release;
        return ck::cuda::auction_assign(dist, n, k, lo_v.data(), hi_v.data(), labels, stream, device);
      },
      py::arg("dist"), py::arg("n"), py::arg("k"), py::arg("lo"), py::arg("hi"), py::arg("labels"), py::arg("stream"),
      py::arg("device"));
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native kernels of cluster_kernels (C++/OpenMP, optional CUDA).";
  m.attr("openmp") = ck::openmp_enabled();
  m.def("max_threads", &ck::openmp_max_threads, "OpenMP's default thread count.");

  m.def("kmeans_cpu", &kmeans_cpu<float>, py::arg("x"), py::arg("k"), py::arg("lo"), py::arg("hi"),
        py::arg("spherical"), py::arg("n_init"), py::arg("max_iter"), py::arg("tol"), py::arg("seed"),
        py::arg("init") = py::none(), py::arg("n_threads") = 0, py::arg("blas") = py::none());
  m.def("kmeans_cpu", &kmeans_cpu<double>, py::arg("x"), py::arg("k"), py::arg("lo"), py::arg("hi"),
        py::arg("spherical"), py::arg("n_init"), py::arg("max_iter"), py::arg("tol"), py::arg("seed"),
        py::arg("init") = py::none(), py::arg("n_threads") = 0, py::arg("blas") = py::none());
  m.def("assign_cpu", &assign_cpu<float>, py::arg("x"), py::arg("centroids"), py::arg("lo"), py::arg("hi"),
        py::arg("spherical"), py::arg("n_threads") = 0, py::arg("blas") = py::none());
  m.def("assign_cpu", &assign_cpu<double>, py::arg("x"), py::arg("centroids"), py::arg("lo"), py::arg("hi"),
        py::arg("spherical"), py::arg("n_threads") = 0, py::arg("blas") = py::none());
  m.def("auction_assign", &auction, py::arg("dist"), py::arg("lo"), py::arg("hi"), py::arg("force_general") = false,
        "Capacity-constrained assignment for a float64 (n, k) cost matrix: (labels, rounds, used_general).");
  m.def("auction_block", &auction_block, py::arg("dist"), py::arg("lo"), py::arg("hi"), py::arg("comm"),
        py::arg("offset"), py::arg("n_total"), py::arg("floor_prices") = py::none(),
        py::arg("general_prices") = py::none(), py::arg("n_threads") = 0, py::arg("working") = py::none(),
        py::arg("working_set") = true,
        "auction_assign for one rank of many: dist holds rows [offset, offset + n) of the global (n_total, k) "
        "cost matrix and comm provides the collectives (distributed, sum, max, select). Warm-start prices and "
        "the working-set state in and out: {labels, rounds, used_general, floor_prices, general_prices, working, "
        "...}; working_set=False solves every warm call on all rows.");

#ifdef CLUSTER_KERNELS_WITH_CUDA
  m.attr("has_cuda") = true;
  bind_cuda(m);
#else
  m.attr("has_cuda") = false;
#endif
}
