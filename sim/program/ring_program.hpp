#pragma once
// The ring family of the CP program (sim/program/cp_program.hpp): p2p, a2a+p2p, and a2a as a ring of one step. One
// rank's run, phase by phase: the a2a into its group (a2a and a2a+p2p), the forward ring with KV travelling and the
// merge of the step partials, the reverse a2a of O and LSE, then the backward: dO through the a2a, the reversed ring
// with KV and dKV travelling, and the reverse a2a of dQ, dK, dV. Every exchange is driven by the Plan's messages.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sim/program/cp_program_types.hpp"

namespace cpgold::sim {

template <class B>
class RingRank {
 public:
  using Tensor = typename B::Tensor;
  using Lse = typename B::Lse;

  RingRank(const Plan& plan, B& b)
      : plan_(plan), b_(b), g_(b.rank()), W_(plan.cp_size), A_(plan.comm == CommType::p2p ? 1 : plan.a2a_size),
        P_(W_ / A_), p_(g_ / A_), j_(g_ % A_), exchange_(plan.comm != CommType::p2p), qs_(plan.partition.q),
        ks_(plan.partition.kv), gq_(plan.group_partition.q), gk_(plan.group_partition.kv),
        group_rows_q_(plan.comm == CommType::a2a ? qs_.global().cu_seqlens_padded.back() : gq_.local_rows()),
        group_rows_kv_(plan.comm == CommType::a2a ? ks_.global().cu_seqlens_padded.back() : gk_.local_rows()),
        hq_(plan.heads_q), hk_(plan.heads_kv), kv_owner_(g_) {
    if (exchange_) {
      level_map_q_ = program_detail::group_side(qs_.global(), P_, A_, "q").rank_order_to_sequence_order();
      level_map_kv_ = program_detail::group_side(ks_.global(), P_, A_, "kv").rank_order_to_sequence_order();
    }
  }

  RankResult<B> run(bool with_backward) {
    take_inputs();
    forward_ring();
    RankResult<B> result;
    if (exchange_) {
      result.o = gather_from_group(plan_.forward, Payload::o, o_, level_map_q_, qs_, hq_, BufferKind::storage);
      result.lse = gather_lse_from_group(plan_.forward, lse_);
    } else {
      result.o = o_;
      result.lse = lse_;
    }
    if (!with_backward) return result;
    backward_ring();
    if (exchange_) {
      const PassPlan& bwd = plan_.backward;
      result.dq = gather_from_group(bwd, Payload::dq, dq_, level_map_q_, qs_, hq_, BufferKind::accumulator);
      result.dk = gather_from_group(bwd, Payload::dk, dk_, level_map_kv_, ks_, hk_, BufferKind::accumulator);
      result.dv = gather_from_group(bwd, Payload::dv, dv_, level_map_kv_, ks_, hk_, BufferKind::accumulator);
    } else {
      result.dq = std::move(dq_);
      result.dk = std::move(dk_);
      result.dv = std::move(dv_);
    }
    b_.finalize(result.dq);
    b_.finalize(result.dk);
    b_.finalize(result.dv);
    return result;
  }

 private:
  // Ring messages of one step for one payload (KV, or dKV in the backward): the two tensors held move to the next
  // rank's fresh buffers. The exchange is started before the attention it overlaps and finished before the received
  // shard is needed, so that a backend with a separate communication stream hides it behind that attention.
  struct Shift {
    Tensor first, second;  // receive buffers: K and V, or dK and dV
    int owner = -1;        // whose shard they carry (-1: this rank receives nothing)
    typename B::Pending pending{};
    bool started = false;
  };

  const Tensor& q() const { return exchange_ ? q_own_ : b_.input(Payload::q); }
  const Tensor& dout() const { return exchange_ ? dout_own_ : b_.input(Payload::dout); }

  // What the rank holds: group-local tensors (rank-local for p2p) of its a2a group's heads.
  void take_inputs() {
    if (exchange_) {
      q_own_ = scatter_to_group(plan_.forward, Payload::q, level_map_q_, group_rows_q_);
      k_ = scatter_to_group(plan_.forward, Payload::k, level_map_kv_, group_rows_kv_);
      v_ = scatter_to_group(plan_.forward, Payload::v, level_map_kv_, group_rows_kv_);
    } else {
      k_ = b_.input(Payload::k);
      v_ = b_.input(Payload::v);
    }
  }

  // One exchange of an a2a: out_bufs[i] goes to rank out_peers[i], in_bufs[i] comes from in_msgs[i]'s sender.
  void exchange_messages(std::vector<Tensor>& out_bufs, const std::vector<int>& out_peers,
                         std::vector<Tensor>& in_bufs, const std::vector<const Message*>& in_msgs) {
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (size_t i = 0; i < out_bufs.size(); ++i) sends.push_back({out_peers[i], &out_bufs[i], nullptr});
    for (size_t i = 0; i < in_bufs.size(); ++i) recvs.push_back({in_msgs[i]->from_rank, &in_bufs[i], nullptr});
    b_.exchange(sends, recvs);
  }

  // a2a before the ring: send head slices of the local shard to the group, assemble rank order -> sequence order.
  Tensor scatter_to_group(const PassPlan& pass, Payload payload, const std::vector<int64_t>& level_map,
                          int64_t group_rows) {
    using program_detail::identity_rows;
    const Tensor& local = b_.input(payload);
    const Shape ls = b_.shape(local);
    const int h = static_cast<int>(ls.heads) / A_;
    std::vector<Tensor> out_bufs, in_bufs;
    std::vector<const Message*> in_msgs;
    std::vector<int> out_peers;
    for (const Message& m : pass.messages) {
      if (m.after_step != -1 || m.payload != payload) continue;
      if (m.from_rank == g_) {
        if (m.shard_owner != m.from_rank) program_error("a2a message sends a shard its sender does not hold");
        out_bufs.push_back(b_.gather(local, identity_rows(m.rows), m.head_begin, m.head_end));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == g_) {
        in_bufs.push_back(b_.zeros(m.rows, m.head_end - m.head_begin, ls.dim, BufferKind::storage));
        in_msgs.push_back(&m);
      }
    }
    exchange_messages(out_bufs, out_peers, in_bufs, in_msgs);
    Tensor seq = b_.zeros(group_rows, h, ls.dim, BufferKind::storage);
    const int64_t piece_rows = static_cast<int64_t>(level_map.size()) / A_;
    std::vector<int> have(static_cast<size_t>(A_), 0);
    for (size_t i = 0; i < in_msgs.size(); ++i) {
      const Message& m = *in_msgs[i];
      const int a = m.shard_owner - p_ * A_;
      if (a < 0 || a >= A_ || m.head_begin != j_ * h || m.head_end - m.head_begin != h)
        program_error("rank " + std::to_string(g_) + " received " + std::string(payload_name(payload)) + " of rank " +
                      std::to_string(m.shard_owner) + " outside its a2a group or head slice");
      std::vector<int64_t> rows(level_map.begin() + a * piece_rows, level_map.begin() + (a + 1) * piece_rows);
      b_.scatter(seq, rows, 0, in_bufs[i]);
      have[static_cast<size_t>(a)] = 1;
    }
    for (int a = 0; a < A_; ++a)
      if (!have[static_cast<size_t>(a)])
        program_error("rank " + std::to_string(g_) + " never received " + std::string(payload_name(payload)) +
                      " of rank " + std::to_string(p_ * A_ + a));
    return seq;
  }

  void start_shift(Shift& s, const PassPlan& pass, int step, Payload payload) {
    using program_detail::who;
    const bool is_kv = payload == Payload::kv;
    const Tensor& a = is_kv ? k_ : dk_;
    const Tensor& c = is_kv ? v_ : dv_;
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (const Message& m : pass.messages) {
      if (m.after_step != step || m.payload != payload) continue;
      if (m.from_rank == g_) {
        const int held = is_kv ? kv_owner_ : dkv_owner_;
        if (held != m.shard_owner)
          program_error(who(g_, step) + " sends " + (is_kv ? "KV" : "dKV") + " of " + std::to_string(m.shard_owner) +
                        " but holds " + (is_kv ? "KV" : "dKV") + " of " + std::to_string(held));
        sends.push_back({m.to_rank, &a, nullptr});
        sends.push_back({m.to_rank, &c, nullptr});
      }
      if (m.to_rank == g_) {
        const BufferKind kind = is_kv ? BufferKind::storage : BufferKind::accumulator;
        const Shape sa = b_.shape(a), sc = b_.shape(c);
        s.first = b_.zeros(sa.rows, sa.heads, sa.dim, kind);
        s.second = b_.zeros(sc.rows, sc.heads, sc.dim, kind);
        s.owner = m.shard_owner;
        recvs.push_back({m.from_rank, &s.first, nullptr});
        recvs.push_back({m.from_rank, &s.second, nullptr});
      }
    }
    s.pending = b_.exchange_start(sends, recvs);
    s.started = true;
  }

  void finish_shift(Shift& s, Payload payload) {
    if (!s.started) return;
    b_.exchange_finish(s.pending);
    s.started = false;
    if (s.owner < 0) return;
    const bool is_kv = payload == Payload::kv;
    (is_kv ? kv_owner_ : dkv_owner_) = s.owner;
    (is_kv ? k_ : dk_) = std::move(s.first);
    (is_kv ? v_ : dv_) = std::move(s.second);
    s.owner = -1;
  }

  void check_owner(const Tile& t) const {
    if (t.kv_owner >= 0 && kv_owner_ != t.kv_owner)
      program_error(program_detail::who(g_, t.step) + " reads KV of " + std::to_string(t.kv_owner) +
                    " but holds KV of " + std::to_string(kv_owner_));
  }

  // Forward ring: every step's attention while the next step's KV travels, then the merge of the partials into
  // o_ and lse_.
  void forward_ring() {
    using program_detail::half_rows;
    const PassPlan& fwd = plan_.forward;
    const Tensor& q = this->q();
    std::vector<typename B::Forward> results;
    std::vector<std::vector<int64_t>> result_rows;
    results.reserve(static_cast<size_t>(fwd.steps));
    for (int i = 0; i < fwd.steps; ++i) {
      const Tile& t = fwd.tile(g_, i);
      // The KV of the next step travels while this step's attention reads the KV held (both only read it).
      Shift next_kv;
      start_shift(next_kv, fwd, i, Payload::kv);
      if (t.computed) {
        check_owner(t);
        const bool qfull = t.q_half == HalfSelect::full, kfull = t.kv_half == HalfSelect::full;
        std::vector<int64_t> qrows = half_rows(gq_, t.q_half, b_.shape(q).rows);
        bool by_rows = false;
        if constexpr (HalfReadingBackend<B>) by_rows = !(qfull && kfull) && b_.reads_halves();
        if (qfull && kfull) {
          results.push_back(b_.forward(t, q, k_, v_));
        } else if (by_rows) {
          if constexpr (HalfReadingBackend<B>) {
            const std::vector<int64_t> krows = half_rows(gk_, t.kv_half, b_.shape(k_).rows);
            results.push_back(b_.forward_rows(t, StepRows{qrows, !qfull, krows, !kfull}, q, k_, v_));
          }
        } else {
          const std::vector<int64_t> krows = kfull ? std::vector<int64_t>{} : half_rows(gk_, t.kv_half, 0);
          const Shape sq = b_.shape(q), sk = b_.shape(k_), sv = b_.shape(v_);
          results.push_back(b_.forward(t, qfull ? q : b_.gather(q, qrows, 0, static_cast<int>(sq.heads)),
                                       kfull ? k_ : b_.gather(k_, krows, 0, static_cast<int>(sk.heads)),
                                       kfull ? v_ : b_.gather(v_, krows, 0, static_cast<int>(sv.heads))));
        }
        b_.record_forward(i, results.back());
        result_rows.push_back(std::move(qrows));
      }
      finish_shift(next_kv, Payload::kv);
    }
    std::vector<MergePart<B>> parts;
    for (size_t s = 0; s < results.size(); ++s)
      parts.push_back({&results[s].o, &results[s].lse, std::move(result_rows[s])});
    const Shape sq = b_.shape(q);
    o_ = b_.zeros(sq.rows, hq_ / A_, b_.shape(b_.input(Payload::v)).dim, BufferKind::accumulator);
    lse_ = b_.lse_empty(hq_ / A_, sq.rows);
    b_.merge_forward(parts, o_, lse_);
  }

  // Back to rank-local rows (reverse a2a driven by the messages).
  Tensor gather_from_group(const PassPlan& pass, Payload payload, const Tensor& group,
                           const std::vector<int64_t>& level_map, const SidePartition& side, int heads,
                           BufferKind kind) {
    const Shape gs = b_.shape(group);
    const int64_t piece_rows = static_cast<int64_t>(level_map.size()) / A_;
    std::vector<Tensor> out_bufs, in_bufs;
    std::vector<int> out_peers;
    std::vector<const Message*> in_msgs;
    for (const Message& m : pass.messages) {
      if (m.after_step != pass.steps - 1 || m.payload != payload) continue;
      if (m.from_rank == g_) {
        if (gs.heads != m.head_end - m.head_begin) program_error("a2a message heads do not match the sender's head group");
        const int a = m.to_rank % A_;
        std::vector<int64_t> rows(level_map.begin() + a * piece_rows, level_map.begin() + (a + 1) * piece_rows);
        out_bufs.push_back(b_.gather(group, rows, 0, static_cast<int>(gs.heads)));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == g_) {
        in_bufs.push_back(b_.zeros(piece_rows, m.head_end - m.head_begin, gs.dim, kind));
        in_msgs.push_back(&m);
      }
    }
    exchange_messages(out_bufs, out_peers, in_bufs, in_msgs);
    Tensor out = b_.zeros(side.local_rows(), heads, gs.dim, kind);
    const std::vector<int64_t> rows = program_detail::identity_rows(std::min(side.local_rows(), piece_rows));
    int seen = 0;
    for (size_t i = 0; i < in_bufs.size(); ++i) {
      b_.scatter(out, rows, in_msgs[i]->head_begin, in_bufs[i]);
      seen += in_msgs[i]->head_end - in_msgs[i]->head_begin;
    }
    if (seen != heads)
      program_error("rank " + std::to_string(g_) + " received " + std::to_string(seen) + " of " +
                    std::to_string(heads) + " heads of " + std::string(payload_name(payload)));
    return out;
  }

  Lse gather_lse_from_group(const PassPlan& pass, const Lse& group) {
    const int64_t piece_rows = static_cast<int64_t>(level_map_q_.size()) / A_;
    std::vector<Lse> out_bufs, in_bufs;
    std::vector<int> out_peers;
    std::vector<const Message*> in_msgs;
    for (const Message& m : pass.messages) {
      if (m.after_step != pass.steps - 1 || m.payload != Payload::lse) continue;
      if (m.from_rank == g_) {
        const int a = m.to_rank % A_;
        out_bufs.push_back(b_.lse_gather(group, std::vector<int64_t>(level_map_q_.begin() + a * piece_rows,
                                                                     level_map_q_.begin() + (a + 1) * piece_rows)));
        out_peers.push_back(m.to_rank);
      }
      if (m.to_rank == g_) {
        in_bufs.push_back(b_.lse_empty(m.head_end - m.head_begin, piece_rows));
        in_msgs.push_back(&m);
      }
    }
    std::vector<Outgoing<B>> sends;
    std::vector<Incoming<B>> recvs;
    for (size_t i = 0; i < out_bufs.size(); ++i) sends.push_back({out_peers[i], nullptr, &out_bufs[i]});
    for (size_t i = 0; i < in_bufs.size(); ++i) recvs.push_back({in_msgs[i]->from_rank, nullptr, &in_bufs[i]});
    b_.exchange(sends, recvs);
    Lse out = b_.lse_empty(hq_, qs_.local_rows());
    for (size_t i = 0; i < in_bufs.size(); ++i)
      b_.lse_scatter(out, program_detail::identity_rows(piece_rows), in_msgs[i]->head_begin, in_bufs[i]);
    return out;
  }

  // Backward: dO through the a2a, then the reversed ring with dKV travelling with KV, summing into dq_, dk_, dv_.
  void backward_ring() {
    using program_detail::half_rows;
    using program_detail::who;
    const PassPlan& bwd = plan_.backward;
    if (exchange_) dout_own_ = scatter_to_group(bwd, Payload::dout, level_map_q_, group_rows_q_);
    const Tensor& q = this->q();
    const Tensor& dout = this->dout();
    const Shape sq = b_.shape(q);
    dq_ = b_.zeros(sq.rows, sq.heads, sq.dim, BufferKind::accumulator);
    // The last step that adds to dQ, and whether dKV leaves the rank after a step: with the reverse a2a (exchange) the
    // sums travel before finalize, so no step is their end here.
    int last_dq_step = -1;
    for (int i = 0; i < bwd.steps; ++i)
      if (bwd.tile(g_, i).computed) last_dq_step = i;
    auto dkv_sent_after = [&](int step) {
      for (const Message& m : bwd.messages)
        if (m.payload == Payload::dkv && m.from_rank == g_ && m.after_step >= step) return true;
      return false;
    };
    // Step i: the KV for step i + 1 travels during step i's attention; the dKV finished by step i - 1 travels during
    // it too and is only needed for the accumulation after it.
    Shift incoming_dkv;
    for (int i = 0; i < bwd.steps; ++i) {
      const Tile& t = bwd.tile(g_, i);
      if (dkv_owner_ < 0) {  // first step: a fresh zero dKV for the KV held
        dkv_owner_ = kv_owner_;
        const Shape sk = b_.shape(k_), sv = b_.shape(v_);
        dk_ = b_.zeros(sk.rows, sk.heads, sk.dim, BufferKind::accumulator);
        dv_ = b_.zeros(sv.rows, sv.heads, sv.dim, BufferKind::accumulator);
      }
      Shift next_kv;
      start_shift(next_kv, bwd, i, Payload::kv);
      if (t.computed) {
        check_owner(t);
        const int dkv_for_step = incoming_dkv.started && incoming_dkv.owner >= 0 ? incoming_dkv.owner : dkv_owner_;
        if (t.kv_owner >= 0 && dkv_for_step != t.kv_owner)
          program_error(who(g_, i) + " holds dKV of " + std::to_string(dkv_for_step) + " but computes for " +
                        std::to_string(t.kv_owner));
        const bool qfull = t.q_half == HalfSelect::full, kfull = t.kv_half == HalfSelect::full;
        const std::vector<int64_t> qrows = half_rows(gq_, t.q_half, sq.rows);
        const std::vector<int64_t> krows = half_rows(gk_, t.kv_half, b_.shape(k_).rows);
        const int hh = static_cast<int>(sq.heads), hkk = static_cast<int>(b_.shape(k_).heads);
        bool summed = false;
        if constexpr (SummingBackend<B>) {
          if (b_.sums_backward()) {
            finish_shift(incoming_dkv, Payload::dkv);  // the step adds into the dKV that arrives
            const SumEnds ends{.dq = !exchange_ && i == last_dq_step,
                               .dkv = !exchange_ && i == bwd.steps - 1 && !dkv_sent_after(i)};
            b_.backward_sum(t, StepRows{qrows, !qfull, krows, !kfull}, q, k_, v_, o_, lse_, dout, dq_, dk_, dv_, ends);
            summed = true;
          }
        }
        if (!summed) {
          // The step's inputs: whole tensors, or the halves the tile reads.
          typename B::Backward res =
              qfull && kfull
                  ? b_.backward(t, q, k_, v_, o_, lse_, dout)
                  : b_.backward(t, qfull ? q : b_.gather(q, qrows, 0, hh), kfull ? k_ : b_.gather(k_, krows, 0, hkk),
                                kfull ? v_ : b_.gather(v_, krows, 0, hkk),
                                qfull ? o_ : b_.gather(o_, qrows, 0, static_cast<int>(b_.shape(o_).heads)),
                                qfull ? lse_ : b_.lse_gather(lse_, qrows),
                                qfull ? dout : b_.gather(dout, qrows, 0, static_cast<int>(b_.shape(dout).heads)));
          b_.scatter_add(dq_, qrows, res.dq);
          finish_shift(incoming_dkv, Payload::dkv);
          b_.scatter_add(dk_, krows, res.dk);
          b_.scatter_add(dv_, krows, res.dv);
          b_.record_backward(i, std::move(res), P_ > 1 ? &dk_ : nullptr, P_ > 1 ? &dv_ : nullptr);
        }
      }
      finish_shift(incoming_dkv, Payload::dkv);  // a step without attention still passes the dKV on
      finish_shift(next_kv, Payload::kv);
      start_shift(incoming_dkv, bwd, i, Payload::dkv);
    }
    finish_shift(incoming_dkv, Payload::dkv);
    if (dkv_owner_ != g_)
      program_error("after the backward ring rank " + std::to_string(g_) + " holds the dKV of " +
                    std::to_string(dkv_owner_));
  }

  const Plan& plan_;
  B& b_;
  const int g_, W_, A_, P_, p_, j_;  // rank, ranks, a2a size, ring size, ring rank, rank in the a2a group
  const bool exchange_;              // a2a around the ring (a2a, a2a+p2p)
  const SidePartition& qs_;
  const SidePartition& ks_;
  const SidePartition& gq_;  // the ring's partition
  const SidePartition& gk_;
  const int64_t group_rows_q_, group_rows_kv_;
  const int hq_, hk_;
  std::vector<int64_t> level_map_q_, level_map_kv_;
  Tensor q_own_, k_, v_, dout_own_, dk_, dv_, o_, dq_;
  Lse lse_;
  int kv_owner_, dkv_owner_ = -1;
};

// Ring family: p2p, a2a+p2p, and a2a as a ring of one step (RingRank's phases).
template <class B>
RankResult<B> run_ring_rank(const Plan& plan, B& b, bool with_backward) {
  return RingRank<B>(plan, b).run(with_backward);
}

}  // namespace cpgold::sim
