#pragma once
// What the CPU backends of the CP program share (the executor's HostRankBackend, sim/program/executor.cpp, and the
// mistakes' HookBackend, sim/program/mistakes.cpp): host tensors of one type, the rank's input shards, row gathers
// and scatters, exchanges as host copies matched by a Rendezvous, the trace; and the run of W such backends, one
// thread a rank. Each backend adds its attention per tile, its merge, scatter_add and finalize (the backend contract
// is sim/program/cp_program_types.hpp).
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "reference/attention.hpp"
#include "reference/tensor.hpp"
#include "sim/plan/plan.hpp"
#include "sim/program/cp_program.hpp"
#include "sim/program/cp_program_types.hpp"
#include "sim/program/executor.hpp"
#include "sim/program/rendezvous.hpp"
#include "sim/program/trace.hpp"

namespace cpgold::sim {

struct HostCopy {};  // host exchanges carry no events

// Each rank starts with only its own rows of the global inputs: [W] shards of q, k, v, dout in the rank-local layout.
template <class T>
struct RankShards {
  std::vector<Tensor3<T>> q, k, v, dout;
};

// The shared part of a host backend of element type T_; Derived is the backend (the program's Outgoing, Incoming and
// MergePart name it).
template <class Derived, class T_>
class HostBackend {
 public:
  using T = T_;
  using Tensor = Tensor3<T>;
  using Lse = LseTensor<T>;
  using Forward = ForwardResult<T>;
  using Backward = BackwardResult<T>;

  HostBackend(int rank, const RankShards<T>& shards, Rendezvous<HostCopy>& rendezvous, bool record_trace)
      : rank_(rank), shards_(shards), rendezvous_(rendezvous), record_trace_(record_trace) {}

  int rank() const { return rank_; }
  const Tensor& input(Payload payload) const {
    const size_t r = static_cast<size_t>(rank_);
    switch (payload) {
      case Payload::q: return shards_.q[r];
      case Payload::k: return shards_.k[r];
      case Payload::v: return shards_.v[r];
      case Payload::dout: return shards_.dout[r];
      default: program_error("no input shard for payload " + std::string(payload_name(payload)));
    }
  }
  Tensor zeros(int64_t rows, int64_t heads, int64_t dim, BufferKind) const { return Tensor(rows, heads, dim); }
  Lse lse_empty(int64_t heads, int64_t rows) const { return Lse(heads, rows, -std::numeric_limits<T>::infinity()); }
  Shape shape(const Tensor& x) const { return {x.rows, x.heads, x.dim}; }

  // out: [rows.size(), h1 - h0, d]; out[i] = x[rows[i], h0:h1] (rows < 0 give zero rows).
  Tensor gather(const Tensor& x, const std::vector<int64_t>& rows, int h0, int h1) const {
    if (h0 == 0 && h1 == x.heads) return gather_rows(x, rows);
    Tensor out(static_cast<int64_t>(rows.size()), h1 - h0, x.dim);
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i] >= 0)
        for (int h = h0; h < h1; ++h) std::copy_n(x.at(rows[i], h), x.dim, out.at(static_cast<int64_t>(i), h - h0));
    return out;
  }
  // dst: [t, H, d]; dst[rows[i], h0 + h] = src[i, h] for i < rows.size().
  void scatter(Tensor& dst, const std::vector<int64_t>& rows, int h0, const Tensor& src) const {
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t h = 0; h < src.heads; ++h)
        std::copy_n(src.at(static_cast<int64_t>(i), h), src.dim, dst.at(rows[i], h0 + h));
  }
  // out: [heads, rows.size()] LSE rows gathered (rows < 0 give -inf).
  Lse lse_gather(const Lse& x, const std::vector<int64_t>& rows) const {
    Lse out = lse_empty(x.heads, static_cast<int64_t>(rows.size()));
    for (int64_t h = 0; h < x.heads; ++h)
      for (size_t i = 0; i < rows.size(); ++i)
        if (rows[i] >= 0) out(h, static_cast<int64_t>(i)) = x(h, rows[i]);
    return out;
  }
  // dst: [H, t]; dst(h0 + h, rows[i]) = src(h, i).
  void lse_scatter(Lse& dst, const std::vector<int64_t>& rows, int h0, const Lse& src) const {
    for (int64_t h = 0; h < src.heads; ++h)
      for (size_t i = 0; i < rows.size(); ++i) dst(h0 + h, rows[i]) = src(h, static_cast<int64_t>(i));
  }

  void exchange(const std::vector<Outgoing<Derived>>& sends, const std::vector<Incoming<Derived>>& recvs) {
    std::vector<PostedSend> posted;
    std::vector<WantedRecv> wanted;
    for (const auto& s : sends)
      posted.push_back(s.tensor ? PostedSend{s.peer, s.tensor->values.data(), s.tensor->values.size() * sizeof(T)}
                                : PostedSend{s.peer, s.lse->values.data(), s.lse->values.size() * sizeof(T)});
    for (const auto& r : recvs)
      wanted.push_back(r.tensor ? WantedRecv{r.peer, r.tensor->values.data(), r.tensor->values.size() * sizeof(T)}
                                : WantedRecv{r.peer, r.lse->values.data(), r.lse->values.size() * sizeof(T)});
    rendezvous_.exchange(
        rank_, "send_recv", posted, wanted, [] { return HostCopy{}; },
        [](void* dst, const void* src, size_t bytes, const HostCopy&) {
          if (bytes > 0) std::memcpy(dst, src, bytes);
          return HostCopy{};
        },
        [](const HostCopy&) {});
  }

  // A started exchange moves its data only when it is finished: a program that wrote a sent tensor or read a receive
  // buffer while the exchange is in flight (what a device backend overlaps with compute) would compute with other
  // values here, and the bit-exact golden checks would catch it.
  struct Pending {
    std::vector<Outgoing<Derived>> sends;
    std::vector<Incoming<Derived>> recvs;
  };
  Pending exchange_start(const std::vector<Outgoing<Derived>>& sends, const std::vector<Incoming<Derived>>& recvs) {
    return {sends, recvs};
  }
  void exchange_finish(Pending& p) { exchange(p.sends, p.recvs); }

  void record_forward(int step, const Forward& res) {
    if (record_trace_) trace.forward.push_back({rank_, step, res.o, res.lse});
  }
  void record_backward(int step, Backward&& res, const Tensor* dk_in_flight, const Tensor* dv_in_flight) {
    if (!record_trace_) return;
    BackwardStepTrace<T> rec{rank_, step, std::move(res.dq), std::move(res.dk), std::move(res.dv), {}, {}};
    if (dk_in_flight) rec.dk_in_flight = *dk_in_flight;
    if (dv_in_flight) rec.dv_in_flight = *dv_in_flight;
    trace.backward.push_back(std::move(rec));
  }

  Trace<T> trace;

 protected:
  int rank_;
  const RankShards<T>& shards_;
  Rendezvous<HostCopy>& rendezvous_;
  bool record_trace_;
};

// Runs rank g of the Plan on backends[g], every rank on its own thread; a failing rank aborts `rendezvous` so that
// the others leave their exchanges. Returns each rank's outputs and, with `record_trace`, the backends' traces
// ordered by (step, rank).
template <class T, class Backend>
CpRun<T> run_backends(const Plan& plan, std::vector<std::unique_ptr<Backend>>& backends,
                      Rendezvous<HostCopy>& rendezvous, bool with_backward, bool record_trace) {
  const int W = static_cast<int>(backends.size());
  CpRun<T> run;
  run.ranks.resize(static_cast<size_t>(W));
  // Ranks share the OpenMP threads: each rank's tiles use threads / W of them (results do not depend on the count).
  const int threads_per_rank = std::max(1, omp_get_max_threads() / W);
  run_rank_threads(
      W,
      [&](int g) {
        if (W > 1) omp_set_num_threads(threads_per_rank);
        RankResult<Backend> r = run_rank(plan, *backends[static_cast<size_t>(g)], with_backward);
        RankOutputs<T>& out = run.ranks[static_cast<size_t>(g)];
        out.o = std::move(r.o);
        out.lse = std::move(r.lse);
        out.dq = std::move(r.dq);
        out.dk = std::move(r.dk);
        out.dv = std::move(r.dv);
      },
      [&] { rendezvous.abort(); });
  if (record_trace) {
    std::vector<std::vector<ForwardStepTrace<T>>> fwd;
    std::vector<std::vector<BackwardStepTrace<T>>> bwd;
    for (auto& b : backends) {
      fwd.push_back(std::move(b->trace.forward));
      bwd.push_back(std::move(b->trace.backward));
    }
    run.trace.forward = by_step_then_rank(fwd);
    run.trace.backward = by_step_then_rank(bwd);
  }
  return run;
}

}  // namespace cpgold::sim
