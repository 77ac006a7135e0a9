#pragma once
// The CP program's vocabulary (the program itself: sim/program/cp_program.hpp). The one CP orchestration: what ONE rank does (shard exchange, per-step attention, merge, reverse exchange) for
// every comm type, written over a backend that supplies storage, the attention call and the exchange. The CPU
// simulator (sim/program/executor.cpp) and the GPU executor (gpu/cp/cp_executor.*: W ranks on one device, or one rank per GPU
// over NCCL; its backend is gpu/cp/device_rank_backend.hpp) instantiate it; every rank runs it on its own thread
// (run_rank_threads) or process. The Plan is the only source of the steps: tiles say what to compute, messages say
// what moves where, and a rank only ever reads tensors it holds or has received (ownership is checked against the
// messages).
//
// Backend B (one object per rank):
//   using Tensor, Lse;                   rows-major [rows, heads, dim] tensor; LSE [heads, rows]
//   int rank() const;
//   const Tensor& input(Payload p);      the rank's local shard of q, k, v or dout (rank-local layout)
//   Tensor zeros(rows, heads, dim, BufferKind);  Lse lse_empty(heads, rows) (-inf)
//   Shape shape(const Tensor&) const;
//   Tensor gather(x, rows, h0, h1)       [rows.size(), h1-h0, d]: out[i] = x[rows[i], h0:h1]
//   void scatter(dst, rows, h0, src)     dst[rows[i], h0:h0+src.heads] = src[i] for i < rows.size()
//   void scatter_add(dst, rows, src)     dst[rows[i]] += src[i] (all heads)
//   Lse lse_gather(x, rows); void lse_scatter(dst, rows, h0, src)
//   Forward forward(tile, q, k, v)       {o, lse} of tile.call
//   Backward backward(tile, q, k, v, o, lse, dout)  {dq, dk, dv}
//   void merge_forward(parts, o, lse)    LSE merge in step order, O = sum O_i exp(lse_i - lse), rounded to storage
//   void finalize(Tensor&)               accumulator -> the dtype's values (rounding)
//   void exchange(sends, recvs)          one grouped send/recv of whole tensors (a Communicator call); what is
//                                        received may be read right after the call
//   Pending exchange_start(sends, recvs) the same exchange, left in flight: the program computes meanwhile, never
//                                        writes the sent tensors nor reads the receive buffers until
//   void exchange_finish(Pending&)       after which the received tensors may be read and the sent ones reused
//   void record_forward(step, const Forward&); void record_backward(step, Backward&&, dk_in_flight*, dv_in_flight*)
// Optional (HalfReadingBackend): bool reads_halves() const; true lets the ring program give a step's forward the
//   rank's whole tensors and the rows it reads, forward_rows(tile, StepRows, q, k, v), instead of gathering the halves
//   first (the backend may read them in place).
// Optional (SummingBackend): bool sums_backward() const; true lets the ring program replace backward + scatter_add
//   with one backward_sum(tile, StepRows, q, k, v, o, lse, dout, dq, dk, dv, SumEnds) on the rank's whole tensors:
//   the step reads rows.q of q, o, lse, dout (rows.kv of k, v) where the tile reads a half, and adds
//   dq[rows.q[i]] += dQ_i, dk[rows.kv[i]] += dK_i, dv[rows.kv[i]] += dV_i (no per-step partials, so no
//   record_backward), issued once the step's dKV has arrived. Its SumEnds say which sums receive their last addition
//   in this step (nothing adds to them or sends them before finalize): the backend may then hand them back finalized
//   (a tensor finalize leaves as it is, with the bits finalize would give).
#include <cstdint>
#include <algorithm>
#include <concepts>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "sim/plan/plan.hpp"

namespace cpgold::sim {

template <class B>
concept SummingBackend = requires(const B& b) {
  { b.sums_backward() } -> std::convertible_to<bool>;
};
template <class B>
concept HalfReadingBackend = requires(const B& b) {
  { b.reads_halves() } -> std::convertible_to<bool>;
};

// The rows a ring step reads of the rank's tensors: row i of the step's Q (K/V) tensor is row q[i] (kv[i]); a side
// that is not a half reads every row (q / kv then hold the identity).
struct StepRows {
  const std::vector<int64_t>& q;
  bool q_half;
  const std::vector<int64_t>& kv;
  bool kv_half;
};

// The sums of a summing ring step (backward_sum) that receive their last addition there: dq, or dk and dv.
struct SumEnds {
  bool dq = false;
  bool dkv = false;
};

// storage: the case's dtype (attention inputs, O); accumulator: float32 sums (dQ, dK, dV, dKV in flight).
enum class BufferKind { storage, accumulator };

struct Shape {
  int64_t rows = 0, heads = 0, dim = 0;
};

template <class B>
struct Outgoing {
  int peer = 0;
  const typename B::Tensor* tensor = nullptr;  // exactly one of tensor / lse
  const typename B::Lse* lse = nullptr;
};
template <class B>
struct Incoming {
  int peer = 0;
  typename B::Tensor* tensor = nullptr;
  typename B::Lse* lse = nullptr;
};

template <class B>
struct MergePart {
  const typename B::Tensor* o = nullptr;  // [n_i, h, d]
  const typename B::Lse* lse = nullptr;   // [h, n_i]
  std::vector<int64_t> rows;              // row of the merged tensor of each partial row
};

// What one rank ends with, in its rank-local layout (SidePartition::local_rows rows).
template <class B>
struct RankResult {
  typename B::Tensor o, dq, dk, dv;
  typename B::Lse lse;
};

[[noreturn]] inline void program_error(const std::string& what) { throw std::logic_error("executor: " + what); }

namespace program_detail {

inline std::vector<int64_t> identity_rows(int64_t n) {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows[static_cast<size_t>(i)] = i;
  return rows;
}

// Rows of the step tensor -> rows of the full tensor for a HalfSelect (read_half map).
inline std::vector<int64_t> half_rows(const SidePartition& side, HalfSelect half, int64_t full_rows) {
  if (half == HalfSelect::full) return identity_rows(full_rows);
  return side.read_half_rows(half == HalfSelect::first ? 0 : 1);
}

// The a2a group geometry: the P-level sequences of ring rank p, partitioned A ways (rank order <-> sequence order).
inline SidePartition group_side(const PackedSequences& global, int P, int A, const std::string& side) {
  PackedSequences level;
  for (int32_t x : global.cu_seqlens_padded) level.cu_seqlens_padded.push_back(x / P);
  level.cu_seqlens = level.cu_seqlens_padded;  // only the padded geometry matters for the reorder
  level.total_rows = level.cu_seqlens_padded.back();
  return SidePartition(level, A, side);
}

inline std::vector<int64_t> segment_rows(const AttentionCall& call) {
  std::vector<int64_t> rows;
  for (const SequenceTile& s : call.sequences)
    for (const RowSegment& seg : s.q)
      for (int32_t j = 0; j < seg.count; ++j) rows.push_back(seg.first_row + j);
  return rows;
}

inline std::string who(int rank, int step) { return "rank " + std::to_string(rank) + " step " + std::to_string(step); }

}  // namespace program_detail

}  // namespace cpgold::sim
