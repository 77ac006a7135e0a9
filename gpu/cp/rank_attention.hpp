#pragma once
// The attention calls of one rank's CP steps (gpu/kernels/attention/attention.hpp): the AttentionPlan of every tile, built once
// per tile and variant (with the call's segments moved into the rank's tensors where a step reads a half in place);
// forward and backward into fresh partials; the summing backward into the rank's float32 sums; rowsum(dO * O) once
// per rank; and the checkers' self-test (CpGpuOptions::inject).
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "gpu/cp/cp_options.hpp"
#include "gpu/cp/device_tensor.hpp"
#include "gpu/cp/rank_memory.hpp"
#include "gpu/cp/rank_row_ops.hpp"
#include "gpu/cp/rank_streams.hpp"
#include "gpu/cp/rank_timing.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "sim/program/cp_program.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::gpu {

class RankAttention {
 public:
  struct Forward {
    DeviceTensor o;
    DeviceLse lse;
  };
  struct Backward {
    DeviceTensor dq, dk, dv;
  };

  // The tiles' addresses key the plans: the sim::Plan must outlive this object. options: this rank's copy.
  RankAttention(const RankStreams& streams, RankTiming& timing, RankMemory& memory, RankRowOps& rows, DType dtype,
                Elem storage, const CpGpuOptions& options)
      : streams_(streams), timing_(timing), memory_(memory), rows_(rows), dtype_(dtype), storage_(storage),
        options_(options) {}
  RankAttention(const RankAttention&) = delete;
  RankAttention& operator=(const RankAttention&) = delete;

  // {o, lse} of tile.call over step tensors.
  Forward forward(const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k, const DeviceTensor& v);
  // The step's Q half is gathered (its O and LSE are the step's rows); a K/V half is read in place, through a call
  // whose KV segments point into the rank's whole K/V.
  Forward forward_rows(const sim::Tile& t, const sim::StepRows& rows, const DeviceTensor& q, const DeviceTensor& k,
                       const DeviceTensor& v);
  // {dq, dk, dv} of tile.call over step tensors.
  Backward backward(const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k, const DeviceTensor& v,
                    const DeviceTensor& o, const DeviceLse& lse, const DeviceTensor& dout);
  // backward + scatter_add(dq, rows.q, .dq), (dk, rows.kv, .dk), (dv, rows.kv, .dv) in the attention kernels
  // themselves, with rowsum(dO * O) from one pass over the rank's O and dO. With read_halves_in_place, a half is read
  // in place: the call's segments point into the rank's tensors and the kernels add into the sums at the rows they
  // read, and nowhere else (OutsideRows) unless this is the first contribution to a fresh sum; otherwise the half's
  // rows (Q, O, dO, LSE, delta; or K, V) are gathered into step tensors first.
  //
  // A sum that ends in this step (SumEnds) over every one of its rows (a side read whole) is handed back in the dtype:
  // the kernels write dtype(sum + value) into a fresh storage tensor (RowSum::result) instead of the float32 sum, so
  // finalize has nothing left to convert.
  void backward_sum(const sim::Tile& t, const sim::StepRows& rows, const DeviceTensor& q, const DeviceTensor& k,
                    const DeviceTensor& v, const DeviceTensor& o, const DeviceLse& lse, const DeviceTensor& dout,
                    DeviceTensor& dq, DeviceTensor& dk, DeviceTensor& dv, sim::SumEnds ends);

 private:
  Forward forward_with(const AttentionPlan& plan, const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k,
                       const DeviceTensor& v);
  // rowsum(dO * O) of every row of the rank's O and dO (attention_row_delta), computed once per pair of tensors and
  // kept (with them) until another pair asks.
  const DeviceLse& delta_of(const DeviceTensor& o, const DeviceTensor& dout, const DeviceTensor& q,
                            const DeviceTensor& k);
  const std::vector<int64_t>& identity_rows(int64_t n);
  // The plan of tile t reading its Q half (q_rows set) and/or K/V half (kv_rows set) in place: the call's segments
  // on that side moved to the rows of the rank's tensor that hold them (step row i is rank row rows[i]; each
  // segment's rows must stay consecutive), with the rank tensor's row count. Built once per tile and variant.
  const AttentionPlan& plan_in_place(const sim::Tile& t, const std::vector<int64_t>* q_rows,
                                     const std::vector<int64_t>* kv_rows, const DeviceTensor& q, const DeviceTensor& k,
                                     const DeviceTensor& v, OutsideRows outside);
  // The plan of tile t's own call, over the step tensors.
  const AttentionPlan& plan_for(const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k,
                                const DeviceTensor& v);
  // CpGpuOptions::inject: adds 1 to the first row of the tile's first Q segment of o.
  void corrupt(const sim::Tile& t, DeviceTensor& o);
  [[noreturn]] void fail_step(const sim::Tile& t, const char* what, const Outcome& out) const;

  const RankStreams& streams_;
  RankTiming& timing_;
  RankMemory& memory_;
  RankRowOps& rows_;
  DType dtype_;
  Elem storage_;
  const CpGpuOptions& options_;
  std::map<std::pair<const sim::Tile*, int>, AttentionPlan> plans_;  // plan_in_place, by tile and variant
  struct DeltaCache {
    // The tensors it was computed from, kept alive so that no other takes their place.
    std::shared_ptr<DeviceMemory> o, dout;
    DeviceLse delta;
  } delta_;
  std::map<int64_t, std::vector<int64_t>> identities_;
};

}  // namespace cpgold::gpu
