#pragma once
// The device backend of the per-rank CP program (sim/program/cp_program.hpp, "Backend B"): one object per rank, on the
// current device, exchanging through the rank's Communicator. It composes the rank's parts and hands each call of the
// program to the part that does it, in the order the program makes them:
//   RankStreams   (rank_streams.hpp)    the compute and accumulation streams, the communicator's, the events between
//   RankTiming    (rank_timing.hpp)     phase table, timeline and exchange times, as CpGpuOptions asks
//   RankMemory    (rank_memory.hpp)     allocation, pending zeros, buffers handed back, row indices, host copies
//   RankRowOps    (rank_row_ops.hpp)    gathers, scatters, float32 accumulation, the forward merge, finalize
//   RankAttention (rank_attention.hpp)  the attention calls of the steps and their plans
//   RankExchange  (rank_exchange.hpp)   the exchanges through the communicator
// Numerics: attention partials in the case dtype with float32 LSE, merges and dQ/dK/dV/dKV accumulation in float32,
// outputs rounded once to the dtype.
#include <cstdint>
#include <map>
#include <vector>

#include "gpu/comm/communicator.hpp"
#include "gpu/cp/cp_options.hpp"
#include "gpu/cp/device_tensor.hpp"
#include "gpu/cp/rank_attention.hpp"
#include "gpu/cp/rank_exchange.hpp"
#include "gpu/cp/rank_memory.hpp"
#include "gpu/cp/rank_row_ops.hpp"
#include "gpu/cp/rank_streams.hpp"
#include "gpu/cp/rank_timing.hpp"
#include "reference/tensor.hpp"
#include "sim/program/cp_program.hpp"
#include "sim/plan/plan.hpp"
#include "sim/program/trace.hpp"

namespace cpgold::gpu {

class DeviceRankBackend {
 public:
  using Tensor = DeviceTensor;
  using Lse = DeviceLse;
  using Forward = RankAttention::Forward;
  using Backward = RankAttention::Backward;
  using Pending = RankExchange::Pending;

  // Creates the rank's streams; the storage type is the case's dtype (bf16 or fp16, otherwise std::invalid_argument).
  DeviceRankBackend(int rank, Communicator& comm, DType dtype, const CpGpuOptions& options);
  DeviceRankBackend(const DeviceRankBackend&) = delete;
  DeviceRankBackend& operator=(const DeviceRankBackend&) = delete;

  int rank() const { return streams_.rank(); }

  // A run: begin_run, the program (sim::run_rank), join_streams, the communicator's synchronize(), then times and
  // collect_timeline.
  void begin_run() { timing_.begin_run(); }
  void join_streams() { timing_.end_run(streams_.join()); }
  RankTimes times() const { return timing_.times(); }
  void collect_timeline(const EventRef& ref) { timing_.collect_timeline(ref); }
  EventRef timing_event() const { return timing_.timing_event(); }

  // Host float tensor holding dtype values -> the rank's input (device storage tensor).
  void upload_input(sim::Payload payload, const Tensor3<float>& x);

  // The program's calls (sim/program/cp_program.hpp says what each does).
  const Tensor& input(sim::Payload payload) const;
  Tensor zeros(int64_t rows, int64_t heads, int64_t dim, sim::BufferKind kind);
  Lse lse_empty(int64_t heads, int64_t rows) { return rows_.lse_empty(heads, rows); }
  sim::Shape shape(const Tensor& x) const { return {x.rows, x.heads, x.dim}; }
  Tensor gather(const Tensor& x, const std::vector<int64_t>& rows, int h0, int h1) {
    return rows_.gather(x, rows, h0, h1);
  }
  void scatter(Tensor& dst, const std::vector<int64_t>& rows, int h0, const Tensor& src) {
    rows_.scatter(dst, rows, h0, src);
  }
  void scatter_add(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) {
    rows_.scatter_add(dst, rows, src);
  }
  Lse lse_gather(const Lse& x, const std::vector<int64_t>& rows) { return rows_.lse_gather(x, rows); }
  void lse_scatter(Lse& dst, const std::vector<int64_t>& rows, int h0, const Lse& src) {
    rows_.lse_scatter(dst, rows, h0, src);
  }
  Forward forward(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) {
    return attention_.forward(t, q, k, v);
  }
  bool reads_halves() const { return options_.read_halves_in_place; }
  Forward forward_rows(const sim::Tile& t, const sim::StepRows& rows, const Tensor& q, const Tensor& k,
                       const Tensor& v) {
    return attention_.forward_rows(t, rows, q, k, v);
  }
  Backward backward(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                    const Lse& lse, const Tensor& dout) {
    return attention_.backward(t, q, k, v, o, lse, dout);
  }
  bool sums_backward() const { return options_.sum_in_backward && !options_.record_trace; }
  void backward_sum(const sim::Tile& t, const sim::StepRows& rows, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& o, const Lse& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                    sim::SumEnds ends) {
    attention_.backward_sum(t, rows, q, k, v, o, lse, dout, dq, dk, dv, ends);
  }
  void merge_forward(const std::vector<sim::MergePart<DeviceRankBackend>>& parts, Tensor& o, Lse& lse);
  void finalize(Tensor& x) { rows_.finalize(x); }
  Pending exchange_start(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                         const std::vector<sim::Incoming<DeviceRankBackend>>& recvs);
  void exchange_finish(Pending& p) { exchange_.finish(p); }
  void exchange(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                const std::vector<sim::Incoming<DeviceRankBackend>>& recvs);
  void record_forward(int step, const Forward& res);
  void record_backward(int step, Backward&& res, const Tensor* dk_in_flight, const Tensor* dv_in_flight);

  // Device -> host float (values of the element type); synchronises the rank's compute stream.
  Tensor3<float> to_host(const Tensor& x) { return memory_.to_host(x); }
  LseTensor<float> to_host(const Lse& x) { return memory_.to_host(x); }

  sim::Trace<float> trace;  // with options.record_trace: every step's partials of the last run

 private:
  RankStreams streams_;  // first member: destroyed after every tensor freed on its streams
  CpGpuOptions options_;
  DType dtype_;
  Elem storage_;
  RankTiming timing_;
  RankMemory memory_;
  RankRowOps rows_;
  RankAttention attention_;
  RankExchange exchange_;
  std::map<int, DeviceTensor> inputs_;
};

}  // namespace cpgold::gpu
