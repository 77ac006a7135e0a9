#pragma once
// The all_gather family of the CP program (sim/program/cp_program.hpp): one rank's run.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sim/program/cp_program_types.hpp"

namespace cpgold::sim {

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

}  // namespace cpgold::sim
