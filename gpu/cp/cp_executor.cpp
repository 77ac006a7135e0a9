// GPU CP executor: the device backend of the per-rank CP program (sim/cp_program.hpp) and the single-GPU driver.
#include "gpu/cp/cp_executor.hpp"

#include <cuda_runtime_api.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "gpu/kernels/cp_kernels.hpp"
#include "gpu/kernels/dtype_bits.hpp"
#include "gpu/comm/local_communicator.hpp"
#include "gpu/cp/device_tensor.hpp"
#include "gpu/cp/rank_memory.hpp"
#include "gpu/cp/rank_streams.hpp"
#include "gpu/cp/rank_timing.hpp"
#include "gpu/cp/timeline.hpp"
#include "sim/cp_program.hpp"

namespace cpgold::gpu {

namespace {

// Streams and their order: gpu/cp/rank_streams.hpp.
class DeviceRankBackend {
 public:
  using Tensor = DeviceTensor;
  using Lse = DeviceLse;
  struct Forward {
    DeviceTensor o;
    DeviceLse lse;
  };
  struct Backward {
    DeviceTensor dq, dk, dv;
  };

  DeviceRankBackend(int rank, Communicator& comm, DType dtype, const CpGpuOptions& options)
      : streams_(rank, static_cast<cudaStream_t>(comm.stream()), options.time_exchanges || options.timeline != nullptr),
        rank_(rank), comm_(comm), dtype_(dtype), storage_(storage_elem(dtype)), options_(options),
        timing_(streams_, options_), memory_(streams_, timing_) {}

  int rank() const { return rank_; }

  // A run: begin_run, the program, join_streams, the communicator's synchronize(), then times and collect_timeline
  // (gpu/cp/rank_timing.hpp).
  void begin_run() { timing_.begin_run(); }
  void join_streams() { timing_.end_run(streams_.join()); }
  RankTimes times() const { return timing_.times(); }
  void collect_timeline(const EventRef& ref) { timing_.collect_timeline(ref); }
  EventRef timing_event() { return timing_.timing_event(); }

  // Host float tensor holding dtype values -> device storage tensor.
  void upload_input(sim::Payload payload, const Tensor3<float>& x) {
    inputs_[static_cast<int>(payload)] = memory_.upload(x, dtype_, storage_);
  }

  const Tensor& input(sim::Payload payload) const {
    auto it = inputs_.find(static_cast<int>(payload));
    if (it == inputs_.end())
      throw std::logic_error("rank " + std::to_string(rank_) + ": no input " + std::string(sim::payload_name(payload)));
    return it->second;
  }
  Tensor zeros(int64_t rows, int64_t heads, int64_t dim, sim::BufferKind kind) {
    return memory_.zeros(rows, heads, dim, kind == sim::BufferKind::storage ? storage_ : Elem::f32);
  }
  Lse lse_empty(int64_t heads, int64_t rows) {
    DeviceLse l = memory_.alloc_lse(heads, rows);
    timing_.timed("lse", l.bytes(),
                  [&] { streams_.check(launch_fill(l.data(), l.count(), -INFINITY, streams_.compute()), "fill"); });
    return l;
  }
  sim::Shape shape(const Tensor& x) const { return {x.rows, x.heads, x.dim}; }

  Tensor gather(const Tensor& x, const std::vector<int64_t>& rows, int h0, int h1) {
    memory_.materialize(x);
    DeviceTensor out = memory_.alloc(static_cast<int64_t>(rows.size()), h1 - h0, x.dim, x.elem);
    const auto idx = memory_.upload_rows(rows);
    timing_.timed("gather", 2.0 * out.bytes(), [&] {
      streams_.check(launch_gather_rows(out.data(), x.data(), RankMemory::rows_ptr(idx), out.rows, x.heads, h0, h1 - h0,
                                        x.dim, x.elem, streams_.compute()),
                     "gather");
    });
    return out;
  }
  void scatter(Tensor& dst, const std::vector<int64_t>& rows, int h0, const Tensor& src) {
    if (dst.elem != src.elem) throw std::logic_error("rank " + std::to_string(rank_) + ": scatter between element types");
    memory_.materialize(dst);
    memory_.materialize(src);
    const auto idx = memory_.upload_rows(rows);
    timing_.timed("scatter", 2.0 * src.bytes(), [&] {
      streams_.check(
          launch_scatter_rows(dst.data(), src.data(), RankMemory::rows_ptr(idx), static_cast<int64_t>(rows.size()),
                              dst.heads, h0, src.heads, src.dim, src.elem, streams_.compute()),
          "scatter");
    });
  }
  void scatter_add(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) {
    if (dst.elem != Elem::f32) throw std::logic_error("rank " + std::to_string(rank_) + ": accumulation into 16-bit");
    if (src.heads * src.dim != dst.heads * dst.dim)
      throw std::logic_error("rank " + std::to_string(rank_) + ": scatter_add between row widths");
    // With accumulate_aside, both are only read and written on the accumulation stream from here on, in program
    // order there: no wait for an earlier accumulation, only for the zero fills (on the compute stream).
    const bool aside = options_.accumulate_aside;
    const cudaStream_t on = aside ? streams_.accumulation() : streams_.compute();
    memory_.fill_pending_zeros(src);
    const bool assign = memory_.start_sum(dst, rows);
    const auto idx = memory_.upload_rows(rows);
    // The accumulation stream starts after everything the compute stream has enqueued so far (the partial, the zero
    // fill, the upload of the rows, the exchange that delivered dst).
    if (aside)
      streams_.check(cudaStreamWaitEvent(on, streams_.record(streams_.compute())->event, 0),
                     "cudaStreamWaitEvent (accumulation)");
    timing_.timed(
        "scatter_add", src.bytes() + (assign ? 1.0 : 2.0) * src.count() * 4,
        [&] {
          streams_.check(
              launch_scatter_add(static_cast<float*>(dst.data()), src.data(), src.elem, RankMemory::rows_ptr(idx),
                                 static_cast<int64_t>(rows.size()), src.heads * src.dim, assign, on),
              "scatter_add");
        },
        on);
    if (!aside) return;
    const EventRef done = streams_.record(streams_.accumulation());
    for (const auto& m : {dst.mem, src.mem})
      if (m) m->side_use = done;
  }
  Lse lse_gather(const Lse& x, const std::vector<int64_t>& rows) {
    DeviceLse out = memory_.alloc_lse(x.heads, static_cast<int64_t>(rows.size()));
    const auto idx = memory_.upload_rows(rows);
    timing_.timed("lse", 2.0 * out.bytes(), [&] {
      streams_.check(launch_lse_gather(out.data(), x.data(), RankMemory::rows_ptr(idx), out.rows, x.heads, x.rows,
                                       streams_.compute()),
                     "lse_gather");
    });
    return out;
  }
  void lse_scatter(Lse& dst, const std::vector<int64_t>& rows, int h0, const Lse& src) {
    const auto idx = memory_.upload_rows(rows);
    timing_.timed("lse", 2.0 * src.bytes(), [&] {
      streams_.check(launch_lse_scatter(dst.data(), src.data(), RankMemory::rows_ptr(idx),
                                        static_cast<int64_t>(rows.size()), src.heads, dst.rows, h0, streams_.compute()),
                     "lse_scatter");
    });
  }

  Forward forward(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) {
    return forward_with(plan_for(t, q, k, v), t, q, k, v);
  }
  bool reads_halves() const { return options_.read_halves_in_place; }
  // The step's Q half is gathered (its O and LSE are the step's rows); a K/V half is read in place, through a call
  // whose KV segments point into the rank's whole K/V.
  Forward forward_rows(const sim::Tile& t, const sim::StepRows& rows, const Tensor& q, const Tensor& k,
                       const Tensor& v) {
    const Tensor qx = rows.q_half ? gather(q, rows.q, 0, static_cast<int>(q.heads)) : q;
    if (!rows.kv_half) return forward(t, qx, k, v);
    return forward_with(plan_in_place(t, nullptr, &rows.kv, qx, k, v, {.leave_q = false, .leave_kv = true}), t, qx, k,
                        v);
  }
  Forward forward_with(const AttentionPlan& plan, const sim::Tile& t, const Tensor& q, const Tensor& k,
                       const Tensor& v) {
    for (const Tensor* x : {&q, &k, &v}) memory_.materialize(*x);
    Forward r{memory_.alloc(q.rows, q.heads, v.dim, storage_), memory_.alloc_lse(q.heads, q.rows)};
    Outcome out;
    timing_.timed(attention_phase(sim::PassKind::forward, t.section).c_str(), 0, [&] {
      out = attention_forward(plan, {q.data(), k.data(), v.data(), r.o.data(), r.lse.data()}, streams_.compute());
    });
    if (!out.ok()) fail_step(t, "attention_forward", out);
    if (options_.inject && options_.inject->rank == rank_ && options_.inject->step == t.step) corrupt(t, r.o);
    return r;
  }
  Backward backward(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                    const Lse& lse, const Tensor& dout) {
    for (const Tensor* x : {&q, &k, &v, &o, &dout}) memory_.materialize(*x);
    const AttentionPlan& plan = plan_for(t, q, k, v);
    Backward r{memory_.alloc(q.rows, q.heads, q.dim, storage_), memory_.alloc(k.rows, k.heads, k.dim, storage_),
               memory_.alloc(v.rows, v.heads, v.dim, storage_)};
    Outcome out;
    timing_.timed(attention_phase(sim::PassKind::backward, t.section).c_str(), 0, [&] {
      out = attention_backward(plan,
                               {q.data(), k.data(), v.data(), o.data(), dout.data(), lse.data(), r.dq.data(),
                                r.dk.data(), r.dv.data(), {}, {}, {}},
                               options_.mode, streams_.compute());
    });
    if (!out.ok()) fail_step(t, "attention_backward", out);
    return r;
  }
  bool sums_backward() const { return options_.sum_in_backward && !options_.record_trace; }
  // backward + scatter_add(dq, rows.q, .dq), (dk, rows.kv, .dk), (dv, rows.kv, .dv) in the attention kernels
  // themselves, with rowsum(dO * O) from one pass over the rank's O and dO. With reads_halves(), a half is read in
  // place: the call's segments point into the rank's tensors and the kernels add into the sums at the rows they read,
  // and nowhere else (OutsideRows) unless this is the first contribution to a fresh sum; otherwise the half's rows
  // (Q, O, dO, LSE, delta; or K, V) are gathered into step tensors first.
  //
  // A sum that ends in this step (SumEnds) over every one of its rows (a side read whole) is handed back in the dtype:
  // the kernels write dtype(sum + value) into a fresh storage tensor (RowSum::result) instead of the float32 sum, so
  // finalize has nothing left to convert.
  void backward_sum(const sim::Tile& t, const sim::StepRows& rows, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& o, const Lse& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                    sim::SumEnds ends) {
    for (const Tensor* x : {&q, &k, &v, &o, &dout}) memory_.materialize(*x);
    const DeviceLse& rank_delta = delta_of(o, dout, q, k);
    const bool q_in_place = rows.q_half && reads_halves(), kv_in_place = rows.kv_half && reads_halves();
    Tensor qx = q, ox = o, dox = dout, kx = k, vx = v;
    Lse lsex = lse, deltax = rank_delta;
    if (rows.q_half && !q_in_place) {
      qx = gather(q, rows.q, 0, static_cast<int>(q.heads));
      ox = gather(o, rows.q, 0, static_cast<int>(o.heads));
      dox = gather(dout, rows.q, 0, static_cast<int>(dout.heads));
      lsex = lse_gather(lse, rows.q);
      deltax = lse_gather(rank_delta, rows.q);
    }
    if (rows.kv_half && !kv_in_place) {
      kx = gather(k, rows.kv, 0, static_cast<int>(k.heads));
      vx = gather(v, rows.kv, 0, static_cast<int>(v.heads));
    }
    auto sum_of = [&](Tensor& dst, const std::vector<int64_t>& map, const Tensor& like) {
      if (dst.elem != Elem::f32 || dst.heads * dst.dim != like.heads * like.dim ||
          static_cast<int64_t>(map.size()) != like.rows)
        throw std::logic_error("rank " + std::to_string(rank_) + ": backward_sum into a sum of another shape");
      memory_.own(dst.mem);
      const bool assign = memory_.start_sum(dst, map);
      return RowSum{static_cast<float*>(dst.data()), RankMemory::rows_ptr(memory_.upload_rows(map)), assign};
    };
    const std::vector<int64_t>& q_map = q_in_place ? identity_rows(q.rows) : rows.q;
    const std::vector<int64_t>& kv_map = kv_in_place ? identity_rows(k.rows) : rows.kv;
    BackwardBuffers buffers{qx.data(), kx.data(), vx.data(), ox.data(), dox.data(), lsex.data(), nullptr, nullptr,
                            nullptr, sum_of(dq, q_map, qx), sum_of(dk, kv_map, kx), sum_of(dv, kv_map, vx),
                            deltax.data()};
    const bool end_q = ends.dq && !rows.q_half && options_.last_sum_in_dtype;
    const bool end_kv = ends.dkv && !rows.kv_half && options_.last_sum_in_dtype;
    Tensor dq_end, dk_end, dv_end;
    if (end_q) {
      dq_end = memory_.alloc(dq.rows, dq.heads, dq.dim, storage_);
      buffers.dq_sum.result = dq_end.data();
    }
    if (end_kv) {
      dk_end = memory_.alloc(dk.rows, dk.heads, dk.dim, storage_);
      dv_end = memory_.alloc(dv.rows, dv.heads, dv.dim, storage_);
      buffers.dk_sum.result = dk_end.data();
      buffers.dv_sum.result = dv_end.data();
    }
    const OutsideRows outside{.leave_q = q_in_place && !buffers.dq_sum.assign,
                              .leave_kv = kv_in_place && !buffers.dk_sum.assign && !buffers.dv_sum.assign};
    const AttentionPlan& plan = q_in_place || kv_in_place
                                    ? plan_in_place(t, q_in_place ? &rows.q : nullptr,
                                                    kv_in_place ? &rows.kv : nullptr, q, k, v, outside)
                                    : plan_for(t, qx, kx, vx);
    Outcome out;
    timing_.timed(attention_phase(sim::PassKind::backward, t.section).c_str(), 0,
                  [&] { out = attention_backward(plan, buffers, options_.mode, streams_.compute()); });
    if (!out.ok()) fail_step(t, "attention_backward", out);
    if (end_q) dq = std::move(dq_end);
    if (end_kv) {
      dk = std::move(dk_end);
      dv = std::move(dv_end);
    }
  }
  // One pass (launch_merge_forward): LSE merged in step order, O summed in float32 in step order and rounded once to
  // the dtype, written straight into a storage tensor that replaces the fresh zero accumulator `o`.
  void merge_forward(const std::vector<sim::MergePart<DeviceRankBackend>>& parts, Tensor& o, Lse& lse) {
    if (!o.mem || !o.mem->pending_zero)
      throw std::logic_error("rank " + std::to_string(rank_) + ": merge_forward expects a fresh zero accumulator");
    if (parts.size() > static_cast<size_t>(kMaxMergeSources))
      throw std::logic_error("rank " + std::to_string(rank_) + ": " + std::to_string(parts.size()) +
                             " forward partials, the merge takes at most " + std::to_string(kMaxMergeSources));
    std::vector<MergeSource> sources;
    std::vector<std::shared_ptr<DeviceMemory>> idx;
    double bytes = 0;
    for (const auto& part : parts) {
      memory_.materialize(*part.o);
      if (part.o->heads != o.heads || part.o->dim != o.dim || part.lse->heads != lse.heads)
        throw std::logic_error("rank " + std::to_string(rank_) + ": forward partial heads/dims differ from O");
      idx.push_back(memory_.upload_rows(source_rows(part.rows, o.rows)));
      sources.push_back(
          {part.o->data(), part.lse->data(), RankMemory::rows_ptr(idx.back()), part.lse->rows, part.o->elem});
      bytes += part.o->bytes() + part.lse->bytes() + o.rows * 8.0;
    }
    DeviceTensor out = memory_.alloc(o.rows, o.heads, o.dim, storage_);
    bytes += out.bytes() + lse.bytes();
    timing_.timed("merge", bytes, [&] {
      streams_.check(launch_merge_forward(out.data(), out.elem, lse.data(), sources.data(),
                                          static_cast<int>(sources.size()), o.rows, o.heads, o.dim, streams_.compute()),
                     "forward merge");
    });
    o = std::move(out);
  }
  void finalize(Tensor& x) {
    if (x.elem == storage_) return;
    memory_.own(x.mem);
    DeviceTensor out = memory_.alloc(x.rows, x.heads, x.dim, storage_);
    if (x.mem && x.mem->pending_zero) {
      out.mem->pending_zero = true;
      memory_.materialize(out);
    } else {
      timing_.timed("convert", x.bytes() + out.bytes(), [&] {
        streams_.check(launch_convert(out.data(), storage_, x.data(), x.elem, x.count(), streams_.compute()),
                       "convert");
      });
    }
    x = std::move(out);
  }

  struct Pending {
    EventRef done;  // recorded on the communication stream after the exchange
    // The buffers the exchange reads and writes, held until the compute stream has waited for it: their memory is
    // freed (and may be reused) in the compute stream's order, so it must not be released while the communication
    // stream may still use it.
    std::vector<std::shared_ptr<DeviceMemory>> in_flight;
  };
  Pending exchange_start(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                         const std::vector<sim::Incoming<DeviceRankBackend>>& recvs) {
    Pending p;
    // A sent tensor the accumulation stream wrote last: the communication stream waits for that accumulation, not
    // the compute stream (the next step's attention runs meanwhile); exchange_finish hands it back.
    for (const auto& x : sends) {
      const auto& m = x.tensor ? x.tensor->mem : x.lse->mem;
      if (m && m->side_use)
        streams_.check(cudaStreamWaitEvent(streams_.comm(), m->side_use->event, 0),
                       "cudaStreamWaitEvent (accumulation sent)");
      else if (x.tensor)
        memory_.fill_pending_zeros(*x.tensor);
      p.in_flight.push_back(m);
    }
    // A receive overwrites its whole buffer (the communicator checks the sizes match).
    for (const auto& x : recvs) {
      if (x.tensor) memory_.own(x.tensor->mem);
      if (x.tensor && x.tensor->mem) x.tensor->mem->pending_zero = false;
      p.in_flight.push_back(x.tensor ? x.tensor->mem : x.lse->mem);
    }
    streams_.check(cudaStreamWaitEvent(streams_.comm(), streams_.record(streams_.compute())->event, 0),
                   "cudaStreamWaitEvent (exchange start)");
    const EventRef begin = timing_.spans() ? streams_.record(streams_.comm()) : nullptr;
    double bytes = 0;  // for the phase table
    for (const auto& x : recvs) bytes += 2.0 * static_cast<double>(x.tensor ? x.tensor->bytes() : x.lse->bytes());
    timing_.timed_exchange(bytes, [&] { send_recv(sends, recvs); });
    p.done = streams_.record(streams_.comm());
    if (begin) timing_.exchange_span(begin, p.done);
    return p;
  }
  // The compute stream waits for the exchange; with timing, the wait's span is the communication not hidden. The
  // buffers are released only after the wait is enqueued (see Pending::in_flight); the sent ones that the
  // accumulation stream wrote last are the compute stream's again (the exchange waited for that accumulation).
  void exchange_finish(Pending& p) {
    const EventRef before = timing_.spans() ? streams_.record(streams_.compute()) : nullptr;
    streams_.check(cudaStreamWaitEvent(streams_.compute(), p.done->event, 0), "cudaStreamWaitEvent (exchange finish)");
    if (before) timing_.wait_span(before, streams_.record(streams_.compute()));
    for (const auto& m : p.in_flight)
      if (m) m->side_use.reset();
    p.in_flight.clear();
  }
  void exchange(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                const std::vector<sim::Incoming<DeviceRankBackend>>& recvs) {
    Pending p = exchange_start(sends, recvs);
    exchange_finish(p);
  }

  void record_forward(int step, const Forward& res) {
    if (options_.record_trace) trace.forward.push_back({rank_, step, to_host(res.o), to_host(res.lse)});
  }
  void record_backward(int step, Backward&& res, const Tensor* dk_in_flight, const Tensor* dv_in_flight) {
    if (!options_.record_trace) return;
    sim::BackwardStepTrace<float> rec{rank_, step, to_host(res.dq), to_host(res.dk), to_host(res.dv), {}, {}};
    if (dk_in_flight) rec.dk_in_flight = to_host(*dk_in_flight);
    if (dv_in_flight) rec.dv_in_flight = to_host(*dv_in_flight);
    trace.backward.push_back(std::move(rec));
  }

  // Device -> host float (values of the element type); synchronises the rank's stream.
  Tensor3<float> to_host(const Tensor& x) { return memory_.to_host(x); }
  LseTensor<float> to_host(const Lse& x) { return memory_.to_host(x); }

  sim::Trace<float> trace;

 private:
  // [n] for the merge: the partial's row holding merged row r, -1 where the partial has none. rows: [partial rows].
  std::vector<int64_t> source_rows(const std::vector<int64_t>& rows, int64_t n) const {
    std::vector<int64_t> src(static_cast<size_t>(n), -1);
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r = rows[i];
      if (r < 0 || r >= n || src[static_cast<size_t>(r)] >= 0)
        throw std::logic_error("rank " + std::to_string(rank_) + ": forward partial row " + std::to_string(i) +
                               " maps to row " + std::to_string(r) + " (outside 0.." + std::to_string(n - 1) +
                               " or taken twice)");
      src[static_cast<size_t>(r)] = static_cast<int64_t>(i);
    }
    return src;
  }

  // One grouped send/recv of whole tensors on the communication stream.
  void send_recv(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                 const std::vector<sim::Incoming<DeviceRankBackend>>& recvs) {
    std::vector<SendTo> s;
    std::vector<RecvFrom> r;
    for (const auto& x : sends)
      s.push_back(x.tensor ? SendTo{x.peer, x.tensor->data(), x.tensor->bytes()}
                           : SendTo{x.peer, x.lse->data(), x.lse->bytes()});
    for (const auto& x : recvs)
      r.push_back(x.tensor ? RecvFrom{x.peer, x.tensor->data(), x.tensor->bytes()}
                           : RecvFrom{x.peer, x.lse->data(), x.lse->bytes()});
    comm_.send_recv(s, r);
  }
  // rowsum(dO * O) of every row of the rank's O and dO (attention_row_delta), computed once per pair of tensors and
  // kept (with them) until another pair asks.
  const DeviceLse& delta_of(const Tensor& o, const Tensor& dout, const Tensor& q, const Tensor& k) {
    if (delta_.o == o.mem && delta_.dout == dout.mem && delta_.delta.mem) return delta_.delta;
    DeviceLse d = memory_.alloc_lse(o.heads, o.rows);
    const AttentionShape shape{dtype_, static_cast<int>(o.heads), static_cast<int>(k.heads), static_cast<int>(q.dim),
                               static_cast<int>(o.dim)};
    Outcome out;
    timing_.timed("delta", static_cast<double>(o.bytes() + dout.bytes() + d.bytes()), [&] {
      out = attention_row_delta(shape, o.data(), dout.data(), o.rows, d.data(), streams_.compute());
    });
    if (!out.ok())
      throw std::runtime_error("rank " + std::to_string(rank_) + " attention_row_delta: " +
                               std::string(status_name(out.status)) + ": " + out.message);
    delta_ = {o.mem, dout.mem, std::move(d)};
    return delta_.delta;
  }
  const std::vector<int64_t>& identity_rows(int64_t n) {
    auto it = identities_.find(n);
    if (it == identities_.end()) it = identities_.emplace(n, sim::program_detail::identity_rows(n)).first;
    return it->second;
  }
  // The plan of tile t reading its Q half (q_rows set) and/or K/V half (kv_rows set) in place: the call's segments
  // on that side moved to the rows of the rank's tensor that hold them (step row i is rank row rows[i]; each
  // segment's rows must stay consecutive), with the rank tensor's row count. Built once per tile and variant.
  const AttentionPlan& plan_in_place(const sim::Tile& t, const std::vector<int64_t>* q_rows,
                                     const std::vector<int64_t>* kv_rows, const Tensor& q, const Tensor& k,
                                     const Tensor& v, OutsideRows outside) {
    const int variant = (q_rows ? 1 : 0) | (kv_rows ? 2 : 0) | (outside.leave_q ? 4 : 0) | (outside.leave_kv ? 8 : 0);
    const auto key = std::make_pair(&t, variant);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    auto move_segments = [&](std::vector<RowSegment>& segments, const std::vector<int64_t>& map, const char* side) {
      for (RowSegment& seg : segments) {
        if (seg.count == 0) {
          seg.first_row = 0;
          continue;
        }
        const auto at = [&](int64_t i) {
          if (i < 0 || i >= static_cast<int64_t>(map.size()))
            throw std::logic_error("rank " + std::to_string(rank_) + " step " + std::to_string(t.step) + ": " + side +
                                   " segment row " + std::to_string(i) + " outside the half's " +
                                   std::to_string(map.size()) + " rows");
          return map[static_cast<size_t>(i)];
        };
        const int64_t first = at(seg.first_row);
        for (int32_t j = 1; j < seg.count; ++j)
          if (at(seg.first_row + j) != first + j)
            throw std::logic_error("rank " + std::to_string(rank_) + " step " + std::to_string(t.step) + ": the " +
                                   side + " half's rows of a segment are not consecutive in the rank's tensor");
        seg.first_row = first;
      }
    };
    AttentionCall call = t.call;
    if (q_rows) call.q_rows = q.rows;
    if (kv_rows) call.kv_rows = k.rows;
    for (SequenceTile& seq : call.sequences) {
      if (q_rows) move_segments(seq.q, *q_rows, "Q");
      if (kv_rows) move_segments(seq.kv, *kv_rows, "KV");
    }
    AttentionShape shape{dtype_, static_cast<int>(q.heads), static_cast<int>(k.heads), static_cast<int>(q.dim),
                         static_cast<int>(v.dim)};
    AttentionPlan plan;
    const Outcome built = plan.build(call, shape, outside);
    if (!built.ok()) fail_step(t, variant ? "AttentionPlan::build (halves in place)" : "AttentionPlan::build", built);
    return plans_.emplace(key, std::move(plan)).first->second;
  }
  // The plan of tile t's own call, over the step tensors.
  const AttentionPlan& plan_for(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) {
    return plan_in_place(t, nullptr, nullptr, q, k, v, {});
  }
  void corrupt(const sim::Tile& t, DeviceTensor& o) {
    for (const SequenceTile& s : t.call.sequences)
      for (const RowSegment& seg : s.q)
        if (seg.count > 0) {
          const size_t row_elems = static_cast<size_t>(o.heads * o.dim);
          streams_.check(launch_add_one(o.data(), o.elem, static_cast<size_t>(seg.first_row) * row_elems, row_elems,
                                        streams_.compute()),
                         "inject");
          return;
        }
  }
  [[noreturn]] void fail_step(const sim::Tile& t, const char* what, const Outcome& out) const {
    throw std::runtime_error("rank " + std::to_string(rank_) + " step " + std::to_string(t.step) + " " + what + ": " +
                             std::string(status_name(out.status)) + ": " + out.message);
  }
  RankStreams streams_;  // first member: destroyed after every tensor freed on its streams
  int rank_;
  Communicator& comm_;
  DType dtype_;
  Elem storage_;
  CpGpuOptions options_;
  RankTiming timing_;
  RankMemory memory_;
  std::map<int, DeviceTensor> inputs_;
  std::map<std::pair<const sim::Tile*, int>, AttentionPlan> plans_;  // plan_in_place, by tile and variant
  struct DeltaCache {
    std::shared_ptr<DeviceMemory> o, dout;  // the tensors it was computed from, kept alive so no other takes their place
    DeviceLse delta;
  } delta_;
  std::map<int64_t, std::vector<int64_t>> identities_;
};

// Each rank starts with only its own rows of the global inputs (thd_get_partitioned_indices).
void upload_shards(DeviceRankBackend& b, const sim::Plan& plan, const sim::CaseInputs& inputs) {
  const int r = b.rank();
  b.upload_input(sim::Payload::q, sim::shard_rows(plan.partition.q, r, inputs.q));
  b.upload_input(sim::Payload::k, sim::shard_rows(plan.partition.kv, r, inputs.k));
  b.upload_input(sim::Payload::v, sim::shard_rows(plan.partition.kv, r, inputs.v));
  b.upload_input(sim::Payload::dout, sim::shard_rows(plan.partition.q, r, inputs.dout));
}

// The ranks allocate their step buffers stream-ordered; with the default release threshold (0) the pool returns its
// memory to the driver at every synchronisation and each run pays for fresh physical pages. With accumulate_aside, a
// block freed on the accumulation stream is not handed to an allocation on the compute stream by making the compute
// stream wait for that free (the pool's internal dependencies would tie step i + 1's attention to step i's
// accumulation); the pool takes other memory instead, or the block once its free has completed. (The attribute is the
// device pool's, so it stays for the rest of the process.)
void keep_pool_memory(int device, bool accumulate_aside) {
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    if (accumulate_aside) {
      int no = 0;
      cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no);
    }
  }
}

}  // namespace

Outcome cp_capability(const sim::Plan& plan, DType dtype, const sim::CaseInputs& inputs) {
  if (dtype != DType::bf16 && dtype != DType::fp16)
    return {Status::unsupported, "dtype " + std::string(dtype_name(dtype)) + ": the GPU runs bf16 and fp16"};
  return check_capability({dtype, plan.heads_q, plan.heads_kv, static_cast<int>(inputs.q.dim),
                           static_cast<int>(inputs.v.dim)});
}

struct LocalCpExecutor::State {
  sim::Plan plan;  // the tiles' addresses key the attention plans
  DType dtype;
  CpGpuOptions options;
  int device = 0;
  std::vector<std::unique_ptr<Communicator>> comms;         // destroyed after the backends (their streams)
  std::vector<std::unique_ptr<DeviceRankBackend>> backends;
};

LocalCpExecutor::LocalCpExecutor(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype,
                                 const CpGpuOptions& options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.plan = plan;
  s.dtype = dtype;
  s.options = options;
  if (const Outcome cap = cp_capability(plan, dtype, inputs); !cap.ok())
    throw std::invalid_argument("GPU CP: " + std::string(status_name(cap.status)) + ": " + cap.message);
  if (cudaGetDevice(&s.device) != cudaSuccess) throw std::runtime_error("GPU CP: no CUDA device");
  keep_pool_memory(s.device, options.accumulate_aside);
  CommOptions comm_options;
  comm_options.timeout = options.timeout;
  const int W = plan.cp_size;
  s.comms = make_local_communicators(W, comm_options);
  for (int r = 0; r < W; ++r) {
    auto b = std::make_unique<DeviceRankBackend>(r, *s.comms[static_cast<size_t>(r)], dtype, options);
    upload_shards(*b, s.plan, inputs);
    s.backends.push_back(std::move(b));
  }
}

LocalCpExecutor::~LocalCpExecutor() = default;

sim::CpRun<float> LocalCpExecutor::run(bool download) {
  State& s = *state_;
  const int W = s.plan.cp_size;
  sim::CpRun<float> out;
  out.ranks.resize(static_cast<size_t>(W));
  // One reference for every rank's timeline: recorded on rank 0's idle stream before any rank starts.
  const EventRef timeline_zero = s.options.timeline ? s.backends[0]->timing_event() : nullptr;
  sim::run_rank_threads(
      W,
      [&](int g) {
        cudaSetDevice(s.device);
        DeviceRankBackend& b = *s.backends[static_cast<size_t>(g)];
        b.trace = {};
        try {
          b.begin_run();
          sim::RankResult<DeviceRankBackend> r = sim::run_rank(s.plan, b, s.options.backward);
          b.join_streams();
          s.comms[static_cast<size_t>(g)]->synchronize();
          b.collect_timeline(timeline_zero);
          if (download) {
            sim::RankOutputs<float>& mine = out.ranks[static_cast<size_t>(g)];
            mine.o = b.to_host(r.o);
            mine.lse = b.to_host(r.lse);
            if (s.options.backward) {
              mine.dq = b.to_host(r.dq);
              mine.dk = b.to_host(r.dk);
              mine.dv = b.to_host(r.dv);
            }
          }
        } catch (const CommError& e) {
          // A rank that only saw another rank's fault reports it as secondary (the fault's own rank is reported).
          if (e.fault() == CommFault::aborted)
            throw sim::ExchangeError(e.rank(), std::string(comm_op_name(e.operation())), sim::ExchangeFault::aborted,
                                     e.what());
          throw;
        }
      },
      [&] {
        for (auto& c : s.comms) c->abort();
      });
  if (download && s.options.record_trace) {
    std::vector<std::vector<sim::ForwardStepTrace<float>>> fwd;
    std::vector<std::vector<sim::BackwardStepTrace<float>>> bwd;
    for (auto& b : s.backends) {
      fwd.push_back(std::move(b->trace.forward));
      bwd.push_back(std::move(b->trace.backward));
    }
    out.trace.forward = sim::by_step_then_rank(fwd);
    out.trace.backward = sim::by_step_then_rank(bwd);
  }
  return out;
}

struct RankCpExecutor::State {
  sim::Plan plan;  // the tiles' addresses key the attention plans
  Communicator* comm = nullptr;
  CpGpuOptions options;
  std::unique_ptr<DeviceRankBackend> backend;
};

RankCpExecutor::RankCpExecutor(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, Communicator& comm,
                               const CpGpuOptions& options)
    : state_(std::make_unique<State>()) {
  if (comm.size() != plan.cp_size)
    throw std::invalid_argument("GPU CP: communicator size " + std::to_string(comm.size()) + " != cp_size " +
                                std::to_string(plan.cp_size));
  if (const Outcome cap = cp_capability(plan, dtype, inputs); !cap.ok())
    throw std::invalid_argument("GPU CP: " + std::string(status_name(cap.status)) + ": " + cap.message);
  State& s = *state_;
  s.plan = plan;
  s.comm = &comm;
  s.options = options;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("GPU CP: no CUDA device");
  keep_pool_memory(device, options.accumulate_aside);
  s.backend = std::make_unique<DeviceRankBackend>(comm.rank(), comm, dtype, options);
  upload_shards(*s.backend, s.plan, inputs);
}

RankCpExecutor::~RankCpExecutor() = default;

RankRun RankCpExecutor::run(bool download) {
  State& s = *state_;
  DeviceRankBackend& b = *s.backend;
  b.trace = {};
  RankRun out;
  b.begin_run();
  sim::RankResult<DeviceRankBackend> res = sim::run_rank(s.plan, b, s.options.backward);
  b.join_streams();
  s.comm->synchronize();  // bounded: a peer that fails or never arrives ends the wait with a CommError
  b.collect_timeline(nullptr);
  if (download) {
    out.outputs.o = b.to_host(res.o);
    out.outputs.lse = b.to_host(res.lse);
    if (s.options.backward) {
      out.outputs.dq = b.to_host(res.dq);
      out.outputs.dk = b.to_host(res.dk);
      out.outputs.dv = b.to_host(res.dv);
    }
  }
  out.trace = std::move(b.trace);
  out.times = b.times();
  return out;
}

RankRun run_cp_rank(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, Communicator& comm,
                    const CpGpuOptions& options) {
  RankCpExecutor executor(plan, inputs, dtype, comm, options);
  return executor.run(true);
}

sim::CpRun<float> run_cp_local(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype,
                               const CpGpuOptions& options) {
  LocalCpExecutor executor(plan, inputs, dtype, options);
  return executor.run(true);
}

}  // namespace cpgold::gpu
