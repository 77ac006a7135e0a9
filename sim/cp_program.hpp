#pragma once
// The one CP orchestration: what ONE rank does (shard exchange, per-step attention, merge, reverse exchange) for
// every comm type, written over a backend that supplies storage, the attention call and the exchange. The CPU
// simulator (sim/executor.cpp) and the GPU executor (gpu/cp/cp_executor.*: W ranks on one device, or one rank per GPU
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

#include "sim/plan.hpp"
#include "sim/rendezvous.hpp"

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

// Ring family: p2p, a2a+p2p, and a2a as a ring of one step. Optional a2a inside groups of consecutive ranks, the ring
// steps with KV (forward) and KV + dKV (backward) travelling, then the reverse a2a.
template <class B>
RankResult<B> run_ring_rank(const Plan& plan, B& b, bool with_backward) {
  using namespace program_detail;
  using Tensor = typename B::Tensor;
  using Lse = typename B::Lse;
  const int g = b.rank();
  const int W = plan.cp_size, A = plan.comm == CommType::p2p ? 1 : plan.a2a_size;
  const int P = W / A, p = g / A, j = g % A;
  const bool exchange = plan.comm != CommType::p2p;
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  const SidePartition& gq = plan.group_partition.q;  // the ring's partition
  const SidePartition& gk = plan.group_partition.kv;
  const int64_t group_rows_q = plan.comm == CommType::a2a ? qs.global().cu_seqlens_padded.back() : gq.local_rows();
  const int64_t group_rows_kv = plan.comm == CommType::a2a ? ks.global().cu_seqlens_padded.back() : gk.local_rows();
  std::vector<int64_t> level_map_q, level_map_kv;
  if (exchange) {
    level_map_q = group_side(qs.global(), P, A, "q").rank_order_to_sequence_order();
    level_map_kv = group_side(ks.global(), P, A, "kv").rank_order_to_sequence_order();
  }
  const int hq = plan.heads_q, hk = plan.heads_kv;

  // a2a before the ring: send head slices of the local shard to the group, assemble rank order -> sequence order.
  auto scatter_to_group = [&](const PassPlan& pass, Payload payload, const std::vector<int64_t>& level_map,
                              int64_t group_rows) {
    const Tensor& local = b.input(payload);
    const Shape ls = b.shape(local);
    const int h = static_cast<int>(ls.heads) / A;
    std::vector<Tensor> out_bufs, in_bufs;
    std::vector<const Message*> in_msgs;
    std::vector<int> out_peers;
    for (const Message& m : pass.messages) {
      if (m.after_step != -1 || m.payload != payload) continue;
      if (m.from_rank == g) {
        if (m.shard_owner != m.from_rank) program_error("a2a message sends a shard its sender does not hold");
        out_bufs.push_back(b.gather(local, identity_rows(m.rows), m.head_begin, m.head_end));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == g) {
        in_bufs.push_back(b.zeros(m.rows, m.head_end - m.head_begin, ls.dim, BufferKind::storage));
        in_msgs.push_back(&m);
      }
    }
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (size_t i = 0; i < out_bufs.size(); ++i) sends.push_back({out_peers[i], &out_bufs[i], nullptr});
    for (size_t i = 0; i < in_bufs.size(); ++i) recvs.push_back({in_msgs[i]->from_rank, &in_bufs[i], nullptr});
    b.exchange(sends, recvs);
    Tensor seq = b.zeros(group_rows, h, ls.dim, BufferKind::storage);
    const int64_t piece_rows = static_cast<int64_t>(level_map.size()) / A;
    std::vector<int> have(static_cast<size_t>(A), 0);
    for (size_t i = 0; i < in_msgs.size(); ++i) {
      const Message& m = *in_msgs[i];
      const int a = m.shard_owner - p * A;
      if (a < 0 || a >= A || m.head_begin != j * h || m.head_end - m.head_begin != h)
        program_error("rank " + std::to_string(g) + " received " + std::string(payload_name(payload)) + " of rank " +
                      std::to_string(m.shard_owner) + " outside its a2a group or head slice");
      std::vector<int64_t> rows(level_map.begin() + a * piece_rows, level_map.begin() + (a + 1) * piece_rows);
      b.scatter(seq, rows, 0, in_bufs[i]);
      have[static_cast<size_t>(a)] = 1;
    }
    for (int a = 0; a < A; ++a)
      if (!have[static_cast<size_t>(a)])
        program_error("rank " + std::to_string(g) + " never received " + std::string(payload_name(payload)) +
                      " of rank " + std::to_string(p * A + a));
    return seq;
  };

  // What the rank holds: group-local tensors (rank-local for p2p) of its a2a group's heads.
  Tensor q_own, k, v, dout_own, dk, dv;
  int kv_owner = g, dkv_owner = -1;
  if (exchange) {
    q_own = scatter_to_group(plan.forward, Payload::q, level_map_q, group_rows_q);
    k = scatter_to_group(plan.forward, Payload::k, level_map_kv, group_rows_kv);
    v = scatter_to_group(plan.forward, Payload::v, level_map_kv, group_rows_kv);
  } else {
    k = b.input(Payload::k);
    v = b.input(Payload::v);
  }
  const Tensor& q = exchange ? q_own : b.input(Payload::q);

  // Ring messages of one step for one payload (KV, or dKV in the backward): the two tensors held move to the next
  // rank's fresh buffers. The exchange is started before the attention it overlaps and finished before the received
  // shard is needed, so that a backend with a separate communication stream hides it behind that attention.
  struct Shift {
    Tensor first, second;  // receive buffers: K and V, or dK and dV
    int owner = -1;        // whose shard they carry (-1: this rank receives nothing)
    typename B::Pending pending{};
    bool started = false;
  };
  auto start_shift = [&](Shift& s, const PassPlan& pass, int step, Payload payload) {
    const bool is_kv = payload == Payload::kv;
    const Tensor& a = is_kv ? k : dk;
    const Tensor& c = is_kv ? v : dv;
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (const Message& m : pass.messages) {
      if (m.after_step != step || m.payload != payload) continue;
      if (m.from_rank == g) {
        const int held = is_kv ? kv_owner : dkv_owner;
        if (held != m.shard_owner)
          program_error(who(g, step) + " sends " + (is_kv ? "KV" : "dKV") + " of " + std::to_string(m.shard_owner) +
                        " but holds " + (is_kv ? "KV" : "dKV") + " of " + std::to_string(held));
        sends.push_back({m.to_rank, &a, nullptr});
        sends.push_back({m.to_rank, &c, nullptr});
      }
      if (m.to_rank == g) {
        const BufferKind kind = is_kv ? BufferKind::storage : BufferKind::accumulator;
        const Shape sa = b.shape(a), sc = b.shape(c);
        s.first = b.zeros(sa.rows, sa.heads, sa.dim, kind);
        s.second = b.zeros(sc.rows, sc.heads, sc.dim, kind);
        s.owner = m.shard_owner;
        recvs.push_back({m.from_rank, &s.first, nullptr});
        recvs.push_back({m.from_rank, &s.second, nullptr});
      }
    }
    s.pending = b.exchange_start(sends, recvs);
    s.started = true;
  };
  auto finish_shift = [&](Shift& s, Payload payload) {
    if (!s.started) return;
    b.exchange_finish(s.pending);
    s.started = false;
    if (s.owner < 0) return;
    const bool is_kv = payload == Payload::kv;
    (is_kv ? kv_owner : dkv_owner) = s.owner;
    (is_kv ? k : dk) = std::move(s.first);
    (is_kv ? v : dv) = std::move(s.second);
    s.owner = -1;
  };
  auto check_owner = [&](const Tile& t) {
    if (t.kv_owner >= 0 && kv_owner != t.kv_owner)
      program_error(who(g, t.step) + " reads KV of " + std::to_string(t.kv_owner) + " but holds KV of " +
                    std::to_string(kv_owner));
  };

  // Forward ring.
  const PassPlan& fwd = plan.forward;
  std::vector<typename B::Forward> results;
  std::vector<std::vector<int64_t>> result_rows;
  results.reserve(static_cast<size_t>(fwd.steps));
  for (int i = 0; i < fwd.steps; ++i) {
    const Tile& t = fwd.tile(g, i);
    // The KV of the next step travels while this step's attention reads the KV held (both only read it).
    Shift next_kv;
    start_shift(next_kv, fwd, i, Payload::kv);
    if (t.computed) {
      check_owner(t);
      const bool qfull = t.q_half == HalfSelect::full, kfull = t.kv_half == HalfSelect::full;
      std::vector<int64_t> qrows = half_rows(gq, t.q_half, b.shape(q).rows);
      bool by_rows = false;
      if constexpr (HalfReadingBackend<B>) by_rows = !(qfull && kfull) && b.reads_halves();
      if (qfull && kfull) {
        results.push_back(b.forward(t, q, k, v));
      } else if (by_rows) {
        if constexpr (HalfReadingBackend<B>) {
          const std::vector<int64_t> krows = half_rows(gk, t.kv_half, b.shape(k).rows);
          results.push_back(b.forward_rows(t, StepRows{qrows, !qfull, krows, !kfull}, q, k, v));
        }
      } else {
        const std::vector<int64_t> krows = kfull ? std::vector<int64_t>{} : half_rows(gk, t.kv_half, 0);
        const Shape sq = b.shape(q), sk = b.shape(k), sv = b.shape(v);
        results.push_back(b.forward(t, qfull ? q : b.gather(q, qrows, 0, static_cast<int>(sq.heads)),
                                    kfull ? k : b.gather(k, krows, 0, static_cast<int>(sk.heads)),
                                    kfull ? v : b.gather(v, krows, 0, static_cast<int>(sv.heads))));
      }
      b.record_forward(i, results.back());
      result_rows.push_back(std::move(qrows));
    }
    finish_shift(next_kv, Payload::kv);
  }
  std::vector<MergePart<B>> parts;
  for (size_t s = 0; s < results.size(); ++s) parts.push_back({&results[s].o, &results[s].lse, std::move(result_rows[s])});
  const Shape sq = b.shape(q);
  Tensor o = b.zeros(sq.rows, hq / A, b.shape(b.input(Payload::v)).dim, BufferKind::accumulator);
  Lse lse = b.lse_empty(hq / A, sq.rows);
  b.merge_forward(parts, o, lse);
  parts.clear();
  results.clear();

  // Back to rank-local rows (reverse a2a driven by the messages).
  auto gather_from_group = [&](const PassPlan& pass, Payload payload, const Tensor& group,
                               const std::vector<int64_t>& level_map, const SidePartition& side, int heads,
                               BufferKind kind) {
    const Shape gs = b.shape(group);
    const int64_t piece_rows = static_cast<int64_t>(level_map.size()) / A;
    std::vector<Tensor> out_bufs, in_bufs;
    std::vector<int> out_peers;
    std::vector<const Message*> in_msgs;
    for (const Message& m : pass.messages) {
      if (m.after_step != pass.steps - 1 || m.payload != payload) continue;
      if (m.from_rank == g) {
        if (gs.heads != m.head_end - m.head_begin) program_error("a2a message heads do not match the sender's head group");
        const int a = m.to_rank % A;
        std::vector<int64_t> rows(level_map.begin() + a * piece_rows, level_map.begin() + (a + 1) * piece_rows);
        out_bufs.push_back(b.gather(group, rows, 0, static_cast<int>(gs.heads)));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == g) {
        in_bufs.push_back(b.zeros(piece_rows, m.head_end - m.head_begin, gs.dim, kind));
        in_msgs.push_back(&m);
      }
    }
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (size_t i = 0; i < out_bufs.size(); ++i) sends.push_back({out_peers[i], &out_bufs[i], nullptr});
    for (size_t i = 0; i < in_bufs.size(); ++i) recvs.push_back({in_msgs[i]->from_rank, &in_bufs[i], nullptr});
    b.exchange(sends, recvs);
    Tensor out = b.zeros(side.local_rows(), heads, gs.dim, kind);
    const std::vector<int64_t> rows = identity_rows(std::min(side.local_rows(), piece_rows));
    int seen = 0;
    for (size_t i = 0; i < in_bufs.size(); ++i) {
      b.scatter(out, rows, in_msgs[i]->head_begin, in_bufs[i]);
      seen += in_msgs[i]->head_end - in_msgs[i]->head_begin;
    }
    if (seen != heads)
      program_error("rank " + std::to_string(g) + " received " + std::to_string(seen) + " of " +
                    std::to_string(heads) + " heads of " + std::string(payload_name(payload)));
    return out;
  };
  auto gather_lse_from_group = [&](const PassPlan& pass, const Lse& group) {
    const int64_t piece_rows = static_cast<int64_t>(level_map_q.size()) / A;
    std::vector<Lse> out_bufs, in_bufs;
    std::vector<int> out_peers;
    std::vector<const Message*> in_msgs;
    for (const Message& m : pass.messages) {
      if (m.after_step != pass.steps - 1 || m.payload != Payload::lse) continue;
      if (m.from_rank == g) {
        const int a = m.to_rank % A;
        out_bufs.push_back(b.lse_gather(group, std::vector<int64_t>(level_map_q.begin() + a * piece_rows,
                                                                    level_map_q.begin() + (a + 1) * piece_rows)));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == g) {
        in_bufs.push_back(b.lse_empty(m.head_end - m.head_begin, piece_rows));
        in_msgs.push_back(&m);
      }
    }
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (size_t i = 0; i < out_bufs.size(); ++i) sends.push_back({out_peers[i], nullptr, &out_bufs[i]});
    for (size_t i = 0; i < in_bufs.size(); ++i) recvs.push_back({in_msgs[i]->from_rank, nullptr, &in_bufs[i]});
    b.exchange(sends, recvs);
    Lse out = b.lse_empty(hq, qs.local_rows());
    for (size_t i = 0; i < in_bufs.size(); ++i)
      b.lse_scatter(out, identity_rows(piece_rows), in_msgs[i]->head_begin, in_bufs[i]);
    return out;
  };

  RankResult<B> result;
  if (exchange) {
    result.o = gather_from_group(fwd, Payload::o, o, level_map_q, qs, hq, BufferKind::storage);
    result.lse = gather_lse_from_group(fwd, lse);
  } else {
    result.o = o;
    result.lse = lse;
  }
  if (!with_backward) return result;

  // Backward: dO through the a2a, then the reversed ring with dKV travelling with KV.
  const PassPlan& bwd = plan.backward;
  if (exchange) dout_own = scatter_to_group(bwd, Payload::dout, level_map_q, group_rows_q);
  const Tensor& dout = exchange ? dout_own : b.input(Payload::dout);
  Tensor dq = b.zeros(sq.rows, sq.heads, sq.dim, BufferKind::accumulator);
  // The last step that adds to dQ, and whether dKV leaves the rank after a step: with the reverse a2a (exchange) the
  // sums travel before finalize, so no step is their end here.
  int last_dq_step = -1;
  for (int i = 0; i < bwd.steps; ++i)
    if (bwd.tile(g, i).computed) last_dq_step = i;
  auto dkv_sent_after = [&](int step) {
    for (const Message& m : bwd.messages)
      if (m.payload == Payload::dkv && m.from_rank == g && m.after_step >= step) return true;
    return false;
  };
  // Step i: the KV for step i + 1 travels during step i's attention; the dKV finished by step i - 1 travels during
  // it too and is only needed for the accumulation after it.
  Shift incoming_dkv;
  for (int i = 0; i < bwd.steps; ++i) {
    const Tile& t = bwd.tile(g, i);
    if (dkv_owner < 0) {  // first step: a fresh zero dKV for the KV held
      dkv_owner = kv_owner;
      const Shape sk = b.shape(k), sv = b.shape(v);
      dk = b.zeros(sk.rows, sk.heads, sk.dim, BufferKind::accumulator);
      dv = b.zeros(sv.rows, sv.heads, sv.dim, BufferKind::accumulator);
    }
    Shift next_kv;
    start_shift(next_kv, bwd, i, Payload::kv);
    if (t.computed) {
      check_owner(t);
      const int dkv_for_step = incoming_dkv.started && incoming_dkv.owner >= 0 ? incoming_dkv.owner : dkv_owner;
      if (t.kv_owner >= 0 && dkv_for_step != t.kv_owner)
        program_error(who(g, i) + " holds dKV of " + std::to_string(dkv_for_step) + " but computes for " +
                      std::to_string(t.kv_owner));
      const bool qfull = t.q_half == HalfSelect::full, kfull = t.kv_half == HalfSelect::full;
      const std::vector<int64_t> qrows = half_rows(gq, t.q_half, sq.rows);
      const std::vector<int64_t> krows = half_rows(gk, t.kv_half, b.shape(k).rows);
      const int hh = static_cast<int>(sq.heads), hkk = static_cast<int>(b.shape(k).heads);
      bool summed = false;
      if constexpr (SummingBackend<B>) {
        if (b.sums_backward()) {
          finish_shift(incoming_dkv, Payload::dkv);  // the step adds into the dKV that arrives
          const SumEnds ends{.dq = !exchange && i == last_dq_step,
                             .dkv = !exchange && i == bwd.steps - 1 && !dkv_sent_after(i)};
          b.backward_sum(t, StepRows{qrows, !qfull, krows, !kfull}, q, k, v, o, lse, dout, dq, dk, dv, ends);
          summed = true;
        }
      }
      if (!summed) {
        // The step's inputs: whole tensors, or the halves the tile reads.
        typename B::Backward res =
            qfull && kfull
                ? b.backward(t, q, k, v, o, lse, dout)
                : b.backward(t, qfull ? q : b.gather(q, qrows, 0, hh), kfull ? k : b.gather(k, krows, 0, hkk),
                             kfull ? v : b.gather(v, krows, 0, hkk),
                             qfull ? o : b.gather(o, qrows, 0, static_cast<int>(b.shape(o).heads)),
                             qfull ? lse : b.lse_gather(lse, qrows),
                             qfull ? dout : b.gather(dout, qrows, 0, static_cast<int>(b.shape(dout).heads)));
        b.scatter_add(dq, qrows, res.dq);
        finish_shift(incoming_dkv, Payload::dkv);
        b.scatter_add(dk, krows, res.dk);
        b.scatter_add(dv, krows, res.dv);
        b.record_backward(i, std::move(res), P > 1 ? &dk : nullptr, P > 1 ? &dv : nullptr);
      }
    }
    finish_shift(incoming_dkv, Payload::dkv);  // a step without attention still passes the dKV on
    finish_shift(next_kv, Payload::kv);
    start_shift(incoming_dkv, bwd, i, Payload::dkv);
  }
  finish_shift(incoming_dkv, Payload::dkv);
  if (dkv_owner != g)
    program_error("after the backward ring rank " + std::to_string(g) + " holds the dKV of " +
                  std::to_string(dkv_owner));
  if (exchange) {
    result.dq = gather_from_group(bwd, Payload::dq, dq, level_map_q, qs, hq, BufferKind::accumulator);
    result.dk = gather_from_group(bwd, Payload::dk, dk, level_map_kv, ks, hk, BufferKind::accumulator);
    result.dv = gather_from_group(bwd, Payload::dv, dv, level_map_kv, ks, hk, BufferKind::accumulator);
  } else {
    result.dq = std::move(dq);
    result.dk = std::move(dk);
    result.dv = std::move(dv);
  }
  b.finalize(result.dq);
  b.finalize(result.dk);
  b.finalize(result.dv);
  return result;
}

// all_gather: KV gathered to sequence order, two Q chunk steps writing their segment rows, dK/dV reduce-scattered
// (each rank sums the contributions to its shard in rank order).
template <class B>
RankResult<B> run_all_gather_rank(const Plan& plan, B& b, bool with_backward) {
  using namespace program_detail;
  using Tensor = typename B::Tensor;
  const int r = b.rank();
  const int W = plan.cp_size;
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  const std::vector<int64_t> kv_map = ks.rank_order_to_sequence_order();
  const int64_t rk = ks.local_sequence_rows();
  const int64_t seq_rows = static_cast<int64_t>(kv_map.size());
  auto shard_rows_of = [&](int owner) {
    return std::vector<int64_t>(kv_map.begin() + owner * rk, kv_map.begin() + (owner + 1) * rk);
  };
  // All-gather K or V (rank order, as the messages deliver them) and reorder to sequence order.
  auto all_gather = [&](const PassPlan& pass, Payload payload) {
    const Tensor& local = b.input(payload);
    const Shape ls = b.shape(local);
    std::vector<Outgoing<B>> sends;
    std::vector<Tensor> in_bufs;
    std::vector<const Message*> in_msgs;
    for (const Message& m : pass.messages) {
      if (m.after_step != -1 || m.payload != payload) continue;
      if (m.from_rank == r) {
        if (m.shard_owner != r) program_error("all-gather message sends a shard its sender does not hold");
        sends.push_back({m.to_rank, &local, nullptr});
      }
      if (m.to_rank == r) {
        in_bufs.push_back(b.zeros(ls.rows, ls.heads, ls.dim, BufferKind::storage));
        in_msgs.push_back(&m);
      }
    }
    std::vector<Incoming<B>> recvs;
    for (size_t i = 0; i < in_bufs.size(); ++i) recvs.push_back({in_msgs[i]->from_rank, &in_bufs[i], nullptr});
    b.exchange(sends, recvs);
    Tensor seq = b.zeros(seq_rows, ls.heads, ls.dim, BufferKind::storage);
    std::vector<int> have(static_cast<size_t>(W), 0);
    have[static_cast<size_t>(r)] = 1;
    b.scatter(seq, shard_rows_of(r), 0, local);
    for (size_t i = 0; i < in_bufs.size(); ++i) {
      b.scatter(seq, shard_rows_of(in_msgs[i]->shard_owner), 0, in_bufs[i]);
      have[static_cast<size_t>(in_msgs[i]->shard_owner)] = 1;
    }
    for (int o = 0; o < W; ++o)
      if (!have[static_cast<size_t>(o)])
        program_error("rank " + std::to_string(r) + " never received " + std::string(payload_name(payload)) +
                      " of rank " + std::to_string(o));
    return seq;
  };
  const Tensor& q = b.input(Payload::q);
  const int dv_dim = static_cast<int>(b.shape(b.input(Payload::v)).dim);
  RankResult<B> result;
  {
    const Tensor k_seq = all_gather(plan.forward, Payload::k);
    const Tensor v_seq = all_gather(plan.forward, Payload::v);
    // Each step writes the rows of its Q segments (copy of valid tokens); no merge.
    result.o = b.zeros(qs.local_rows(), plan.heads_q, dv_dim, BufferKind::storage);
    result.lse = b.lse_empty(plan.heads_q, qs.local_rows());
    for (int s = 0; s < plan.forward.steps; ++s) {
      const Tile& t = plan.forward.tile(r, s);
      typename B::Forward res = b.forward(t, q, k_seq, v_seq);
      const std::vector<int64_t> rows = segment_rows(t.call);
      b.scatter(result.o, rows, 0, b.gather(res.o, rows, 0, plan.heads_q));
      b.lse_scatter(result.lse, rows, 0, b.lse_gather(res.lse, rows));
      b.record_forward(s, res);
    }
  }
  if (!with_backward) return result;
  const Tensor k_seq = all_gather(plan.backward, Payload::k);
  const Tensor v_seq = all_gather(plan.backward, Payload::v);
  const Shape sq = b.shape(q), sk = b.shape(b.input(Payload::k));
  result.dq = b.zeros(qs.local_rows(), sq.heads, sq.dim, BufferKind::storage);
  Tensor dk_seq = b.zeros(seq_rows, plan.heads_kv, sk.dim, BufferKind::accumulator);
  Tensor dv_seq = b.zeros(seq_rows, plan.heads_kv, dv_dim, BufferKind::accumulator);
  for (int s = 0; s < plan.backward.steps; ++s) {
    const Tile& t = plan.backward.tile(r, s);
    typename B::Backward res = b.backward(t, q, k_seq, v_seq, result.o, result.lse, b.input(Payload::dout));
    const std::vector<int64_t> rows = segment_rows(t.call);
    b.scatter(result.dq, rows, 0, b.gather(res.dq, rows, 0, static_cast<int>(sq.heads)));
    b.scatter_add(dk_seq, identity_rows(b.shape(res.dk).rows), res.dk);
    b.scatter_add(dv_seq, identity_rows(b.shape(res.dv).rows), res.dv);
    b.record_backward(s, std::move(res), nullptr, nullptr);
  }
  // Reduce-scatter: rank r sums, in rank order, the rows of its shard from every rank's sequence-order buffer.
  auto reduce_scatter = [&](Payload payload, const Tensor& seq) {
    const Shape ss = b.shape(seq);
    std::vector<Tensor> out_bufs, in_bufs(static_cast<size_t>(W));
    std::vector<int> out_peers;
    std::vector<int> from(static_cast<size_t>(W), 0);
    std::vector<Incoming<B>> recvs;
    for (const Message& m : plan.backward.messages) {
      if (m.payload != payload || m.after_step != plan.backward.steps - 1) continue;
      if (m.from_rank == r) {
        out_bufs.push_back(b.gather(seq, shard_rows_of(m.to_rank), 0, static_cast<int>(ss.heads)));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == r) {
        if (m.shard_owner != r) program_error("reduce-scatter message for the wrong shard");
        in_bufs[static_cast<size_t>(m.from_rank)] = b.zeros(rk, ss.heads, ss.dim, BufferKind::accumulator);
        from[static_cast<size_t>(m.from_rank)] = 1;
      }
    }
    for (int x = 0; x < W; ++x)
      if (from[static_cast<size_t>(x)]) recvs.push_back({x, &in_bufs[static_cast<size_t>(x)], nullptr});
    std::vector<Outgoing<B>> sends;
    for (size_t i = 0; i < out_bufs.size(); ++i) sends.push_back({out_peers[i], &out_bufs[i], nullptr});
    b.exchange(sends, recvs);
    in_bufs[static_cast<size_t>(r)] = b.gather(seq, shard_rows_of(r), 0, static_cast<int>(ss.heads));
    from[static_cast<size_t>(r)] = 1;
    Tensor out = b.zeros(ks.local_rows(), ss.heads, ss.dim, BufferKind::accumulator);
    const std::vector<int64_t> rows = identity_rows(rk);
    for (int x = 0; x < W; ++x) {
      if (!from[static_cast<size_t>(x)])
        program_error("rank " + std::to_string(r) + " misses the " + std::string(payload_name(payload)) +
                      " contribution of rank " + std::to_string(x));
      b.scatter_add(out, rows, in_bufs[static_cast<size_t>(x)]);
    }
    return out;
  };
  result.dk = reduce_scatter(Payload::dk, dk_seq);
  result.dv = reduce_scatter(Payload::dv, dv_seq);
  b.finalize(result.dq);
  b.finalize(result.dk);
  b.finalize(result.dv);
  return result;
}

template <class B>
RankResult<B> run_rank(const Plan& plan, B& b, bool with_backward) {
  if (plan.comm == CommType::all_gather) return run_all_gather_rank(plan, b, with_backward);
  return run_ring_rank(plan, b, with_backward);
}

// The trace of a run: concatenates per-rank records and orders them by (step, rank) (stable: each rank's records
// are in step order).
template <class Record>
std::vector<Record> by_step_then_rank(std::vector<std::vector<Record>>& per_rank) {
  std::vector<Record> all;
  for (auto& records : per_rank)
    for (auto& rec : records) all.push_back(std::move(rec));
  std::stable_sort(all.begin(), all.end(), [](const Record& a, const Record& b) { return a.step < b.step; });
  return all;
}

// Runs body(rank) for every rank on its own thread (W = 1: on the caller's). When a rank fails, abort() is called
// so that the others leave their exchanges at once; the error rethrown is the lowest rank's own fault (an abort
// caused by another rank's fault is reported only when nothing else is).
template <class Body, class Abort>
void run_rank_threads(int W, Body&& body, Abort&& abort) {
  if (W == 1) {
    body(0);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(W));
  std::vector<int> secondary(static_cast<size_t>(W), 0);
  {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(W));
    for (int g = 0; g < W; ++g)
      threads.emplace_back([&, g] {
        try {
          body(g);
        } catch (const ExchangeError& e) {
          errors[static_cast<size_t>(g)] = std::current_exception();
          secondary[static_cast<size_t>(g)] = e.fault() == ExchangeFault::aborted;
          abort();
        } catch (...) {
          errors[static_cast<size_t>(g)] = std::current_exception();
          abort();
        }
      });
    for (std::thread& t : threads) t.join();
  }
  for (int g = 0; g < W; ++g)
    if (errors[static_cast<size_t>(g)] && !secondary[static_cast<size_t>(g)]) std::rethrow_exception(errors[static_cast<size_t>(g)]);
  for (int g = 0; g < W; ++g)
    if (errors[static_cast<size_t>(g)]) std::rethrow_exception(errors[static_cast<size_t>(g)]);
}

}  // namespace cpgold::sim
