// CPU executor of a Plan. Two families:
//  - ring family (p2p, a2a+p2p, and a2a as a ring of one step): optional a2a inside groups of consecutive ranks,
//    then the ring steps with KV (forward) and KV + dKV (backward) travelling between rank buffers, then the reverse
//    a2a;
//  - all_gather: KV gathered to sequence order, two Q chunk steps, dK/dV reduce-scattered.
// Every exchange is driven by the Plan's messages: a rank only ever reads tensors it holds or has received.
#include "sim/executor.hpp"

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <omp.h>
#include <stdexcept>
#include <string>
#include <tuple>

#include "reference/attention.hpp"
#include "reference/lse_merge.hpp"

namespace cpgold::sim {

namespace {

template <class T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

[[noreturn]] void plan_error(const std::string& what) { throw std::logic_error("executor: " + what); }

// out: [rows.size(), h, d]; out[i] = x[rows[i]] (rows < 0 give zero rows).
template <class T>
Tensor3<T> take_rows(const Tensor3<T>& x, const std::vector<int64_t>& rows) {
  Tensor3<T> out(static_cast<int64_t>(rows.size()), x.heads, x.dim);
  const int64_t s = x.row_stride();
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i] >= 0) std::copy_n(x.values.begin() + rows[i] * s, s, out.values.begin() + static_cast<int64_t>(i) * s);
  return out;
}

// out: [rows.size(), heads] LSE rows gathered.
template <class T>
LseTensor<T> take_lse_rows(const LseTensor<T>& x, const std::vector<int64_t>& rows) {
  LseTensor<T> out(x.heads, static_cast<int64_t>(rows.size()), neg_inf<T>());
  for (int64_t h = 0; h < x.heads; ++h)
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i] >= 0) out(h, static_cast<int64_t>(i)) = x(h, rows[i]);
  return out;
}

// x: [t, h, d] -> [t, h1 - h0, d]
template <class T>
Tensor3<T> slice_heads(const Tensor3<T>& x, int h0, int h1, int64_t rows) {
  Tensor3<T> out(rows, h1 - h0, x.dim);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = h0; h < h1; ++h) std::copy_n(x.at(r, h), x.dim, out.at(r, h - h0));
  return out;
}

// dst: [t, H, d] gets src [t', h1-h0, d] at heads h0.. for rows [0, min(t, t')).
template <class T>
void put_heads(Tensor3<T>& dst, const Tensor3<T>& src, int h0) {
  const int64_t rows = std::min(dst.rows, src.rows);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < src.heads; ++h) std::copy_n(src.at(r, h), src.dim, dst.at(r, h0 + h));
}

template <class T>
void put_lse_heads(LseTensor<T>& dst, const LseTensor<T>& src, int h0) {
  const int64_t rows = std::min(dst.rows, src.rows);
  for (int64_t h = 0; h < src.heads; ++h)
    for (int64_t r = 0; r < rows; ++r) dst(h0 + h, r) = src(h, r);
}

std::vector<int64_t> identity_rows(int64_t n) {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows[static_cast<size_t>(i)] = i;
  return rows;
}

// Rows of the step tensor -> rows of the full tensor for a HalfSelect (read_half map).
std::vector<int64_t> half_rows(const SidePartition& side, HalfSelect half) {
  if (half == HalfSelect::full) return identity_rows(side.local_rows());
  return side.read_half_rows(half == HalfSelect::first ? 0 : 1);
}

// Runs f(rank) for every rank, ranks spread over OpenMP threads (the attention inside then runs on one thread;
// results are independent of the split). The first exception is rethrown after the loop.
template <class F>
void parallel_over_ranks(int W, F&& f) {
  std::exception_ptr error;
  // With fewer ranks than threads, ranks run one after another and each tile uses the threads itself.
  const bool by_rank = W > 1 && W >= omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) if (by_rank)
  for (int g = 0; g < W; ++g) {
    try {
      f(g);
    } catch (...) {
#pragma omp critical(cpgold_sim_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Arithmetic policies: the oracle (float64) and the CP peer (reference peer per tile, float32 merges).
struct OracleArith {
  using T = double;
  KernelOptions kernel;
  ForwardResult<double> forward(const AttentionCall& c, const Tensor3<double>& q, const Tensor3<double>& k,
                                const Tensor3<double>& v) const {
    return attention_forward(c, q, k, v, kernel);
  }
  BackwardResult<double> backward(const AttentionCall& c, const Tensor3<double>& q, const Tensor3<double>& k,
                                  const Tensor3<double>& v, const Tensor3<double>& o, const LseTensor<double>& lse,
                                  const Tensor3<double>& dout) const {
    return attention_backward(c, q, k, v, o, lse, dout, kernel);
  }
  double round(double x) const { return x; }
};

struct PeerArith {
  using T = float;
  DType dtype;
  KernelOptions kernel;
  ForwardResult<float> forward(const AttentionCall& c, const Tensor3<float>& q, const Tensor3<float>& k,
                               const Tensor3<float>& v) const {
    return attention_forward(c, q, k, v, dtype, kernel);
  }
  BackwardResult<float> backward(const AttentionCall& c, const Tensor3<float>& q, const Tensor3<float>& k,
                                 const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                                 const Tensor3<float>& dout) const {
    return attention_backward(c, q, k, v, o, lse, dout, dtype, kernel);
  }
  float round(float x) const { return round_to(dtype, x); }
};

template <class T, class Arith>
void round_all(Tensor3<T>& x, const Arith& arith) {
  for (T& e : x.values) e = arith.round(e);
}

// Merges the forward partials of one rank: LSE first (in step order), then O = sum_i O_i * exp(lse_i - lse).
// parts: (O_i [n_i, h, d], LSE_i [h, n_i], full row of each step row); o: [rows, h, d], lse: [h, rows].
template <class T>
struct ForwardPart {
  const Tensor3<T>* o;
  const LseTensor<T>* lse;
  std::vector<int64_t> rows;
};
template <class T, class Arith>
void merge_forward(const std::vector<ForwardPart<T>>& parts, Tensor3<T>& o, LseTensor<T>& lse, const Arith& arith) {
  for (const auto& part : parts)
    for (int64_t h = 0; h < lse.heads; ++h)
      for (size_t i = 0; i < part.rows.size(); ++i) {
        T& l = lse(h, part.rows[i]);
        l = lse_merge(l, (*part.lse)(h, static_cast<int64_t>(i)));
      }
  for (const auto& part : parts)
    for (size_t i = 0; i < part.rows.size(); ++i)
      for (int64_t h = 0; h < o.heads; ++h) {
        const T w = lse_weight((*part.lse)(h, static_cast<int64_t>(i)), lse(h, part.rows[i]));
        if (w == T(0)) continue;
        const T* src = part.o->at(static_cast<int64_t>(i), h);
        T* dst = o.at(part.rows[i], h);
        for (int64_t x = 0; x < o.dim; ++x)
          if (src[x] != T(0)) dst[x] += src[x] * w;
      }
  round_all(o, arith);
}

// dst[rows[i]] += src[i] (all heads).
template <class T>
void add_rows(Tensor3<T>& dst, const Tensor3<T>& src, const std::vector<int64_t>& rows) {
  const int64_t s = dst.row_stride();
  for (size_t i = 0; i < rows.size(); ++i) {
    T* d = dst.values.data() + rows[i] * s;
    const T* x = src.values.data() + static_cast<int64_t>(i) * s;
    for (int64_t e = 0; e < s; ++e) d[e] += x[e];
  }
}

// The a2a group geometry: the P-level sequences of ring rank p, partitioned A ways (rank order <-> sequence order).
SidePartition group_side(const PackedSequences& global, int P, int A, const std::string& side) {
  PackedSequences level;
  for (int32_t x : global.cu_seqlens_padded) level.cu_seqlens_padded.push_back(x / P);
  level.cu_seqlens = level.cu_seqlens_padded;  // only the padded geometry matters for the reorder
  level.total_rows = level.cu_seqlens_padded.back();
  return SidePartition(level, A, side);
}

using MailKey = std::tuple<int, Payload, int, int>;  // (to, payload, shard_owner, head_begin)

template <class T>
struct RingRank {
  // Group-local (or rank-local for p2p) tensors the ring reads; heads of this rank's a2a group.
  Tensor3<T> q, dout, o;
  LseTensor<T> lse;
  int kv_owner = -1;
  Tensor3<T> k, v;
  int dkv_owner = -1;
  Tensor3<T> dk, dv;
  Tensor3<T> dq;
};

// Each rank starts with only its own rows of the global inputs: [W] shards of q, k, v, dout in the rank-local layout.
template <class T>
struct RankShards {
  std::vector<Tensor3<T>> q, k, v, dout;
};

template <class T>
RankShards<T> shard_inputs(const Plan& plan, const CaseInputs& inputs) {
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  const Tensor3<T> q_g = tensor_cast<T>(inputs.q), k_g = tensor_cast<T>(inputs.k), v_g = tensor_cast<T>(inputs.v),
                   dout_g = tensor_cast<T>(inputs.dout);
  RankShards<T> shards;
  for (int r = 0; r < plan.cp_size; ++r) {
    shards.q.push_back(shard_rows(qs, r, q_g));
    shards.k.push_back(shard_rows(ks, r, k_g));
    shards.v.push_back(shard_rows(ks, r, v_g));
    shards.dout.push_back(shard_rows(qs, r, dout_g));
  }
  return shards;
}

template <class Arith>
CpRun<typename Arith::T> run_ring_family(const Plan& plan, const CaseInputs& inputs, const Arith& arith,
                                         const ExecutorOptions& options) {
  using T = typename Arith::T;
  const int W = plan.cp_size, A = plan.comm == CommType::p2p ? 1 : plan.a2a_size;
  const int P = W / A;
  const bool exchange = plan.comm != CommType::p2p;
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  const SidePartition& gq = plan.group_partition.q;  // the ring's partition
  const SidePartition& gk = plan.group_partition.kv;
  const int64_t group_rows_q = plan.comm == CommType::a2a ? qs.global().cu_seqlens_padded.back() : gq.local_rows();
  const int64_t group_rows_kv = plan.comm == CommType::a2a ? ks.global().cu_seqlens_padded.back() : gk.local_rows();
  const SidePartition level_q = group_side(qs.global(), P, A, "q"), level_kv = group_side(ks.global(), P, A, "kv");
  const std::vector<int64_t> level_map_q = level_q.rank_order_to_sequence_order();
  const std::vector<int64_t> level_map_kv = level_kv.rank_order_to_sequence_order();
  const int hq = plan.heads_q, hk = plan.heads_kv;

  // Shards: each rank starts with only its own rows.
  const RankShards<T> shards = shard_inputs<T>(plan, inputs);
  const auto &q_l = shards.q, &k_l = shards.k, &v_l = shards.v, &dout_l = shards.dout;

  // a2a before the ring: deliver the pieces named by the messages, then assemble rank order -> sequence order.
  auto scatter_to_groups = [&](const PassPlan& pass, Payload payload, const std::vector<Tensor3<T>>& local,
                               const std::vector<int64_t>& level_map, int64_t group_rows) {
    std::map<MailKey, Tensor3<T>> mail;
    for (const Message& m : pass.messages) {
      if (m.after_step != -1 || m.payload != payload) continue;
      if (m.shard_owner != m.from_rank) plan_error("a2a message sends a shard its sender does not hold");
      mail[{m.to_rank, payload, m.shard_owner, m.head_begin}] = slice_heads(local[m.from_rank], m.head_begin, m.head_end, m.rows);
    }
    std::vector<Tensor3<T>> out(W);
    for (int g = 0; g < W; ++g) {
      const int p = g / A, j = g % A;
      const int h = local[g].heads / A;
      Tensor3<T> seq(group_rows, h, local[g].dim);
      const int64_t piece_rows = static_cast<int64_t>(level_map.size()) / A;
      for (int a = 0; a < A; ++a) {
        auto it = mail.find({g, payload, p * A + a, j * h});
        if (it == mail.end())
          plan_error("rank " + std::to_string(g) + " never received " + std::string(payload_name(payload)) +
                     " of rank " + std::to_string(p * A + a));
        const int64_t s = seq.row_stride();
        for (int64_t i = 0; i < piece_rows; ++i) {
          const int64_t dst = level_map[static_cast<size_t>(a * piece_rows + i)];
          std::copy_n(it->second.values.begin() + i * s, s, seq.values.begin() + dst * s);
        }
      }
      out[g] = std::move(seq);
    }
    return out;
  };

  std::vector<RingRank<T>> ranks(W);
  if (exchange) {
    auto q_s = scatter_to_groups(plan.forward, Payload::q, q_l, level_map_q, group_rows_q);
    auto k_s = scatter_to_groups(plan.forward, Payload::k, k_l, level_map_kv, group_rows_kv);
    auto v_s = scatter_to_groups(plan.forward, Payload::v, v_l, level_map_kv, group_rows_kv);
    for (int g = 0; g < W; ++g) {
      ranks[g].q = std::move(q_s[g]);
      ranks[g].k = std::move(k_s[g]);
      ranks[g].v = std::move(v_s[g]);
      ranks[g].kv_owner = g;
    }
  } else {
    for (int g = 0; g < W; ++g) {
      ranks[g].q = q_l[g];
      ranks[g].k = k_l[g];
      ranks[g].v = v_l[g];
      ranks[g].kv_owner = g;
    }
  }

  CpRun<T> run;
  // Ring messages of one step: KV (and dKV) held by the sender move to the receiver's buffers.
  auto deliver_ring = [&](const PassPlan& pass, int step) {
    std::map<int, std::pair<int, std::pair<Tensor3<T>, Tensor3<T>>>> kv_in, dkv_in;
    for (const Message& m : pass.messages) {
      if (m.after_step != step || (m.payload != Payload::kv && m.payload != Payload::dkv)) continue;
      RingRank<T>& from = ranks[m.from_rank];
      if (m.payload == Payload::kv) {
        if (from.kv_owner != m.shard_owner)
          plan_error("rank " + std::to_string(m.from_rank) + " step " + std::to_string(step) + " sends KV of " +
                     std::to_string(m.shard_owner) + " but holds KV of " + std::to_string(from.kv_owner));
        kv_in[m.to_rank] = {m.shard_owner, {from.k, from.v}};
      } else {
        if (from.dkv_owner != m.shard_owner)
          plan_error("rank " + std::to_string(m.from_rank) + " step " + std::to_string(step) + " sends dKV of " +
                     std::to_string(m.shard_owner) + " but holds dKV of " + std::to_string(from.dkv_owner));
        dkv_in[m.to_rank] = {m.shard_owner, {from.dk, from.dv}};
      }
    }
    for (auto& [to, x] : kv_in) {
      ranks[to].kv_owner = x.first;
      ranks[to].k = std::move(x.second.first);
      ranks[to].v = std::move(x.second.second);
    }
    for (auto& [to, x] : dkv_in) {
      ranks[to].dkv_owner = x.first;
      ranks[to].dk = std::move(x.second.first);
      ranks[to].dv = std::move(x.second.second);
    }
  };
  auto check_owner = [&](const Tile& t) {
    if (t.kv_owner >= 0 && ranks[t.rank].kv_owner != t.kv_owner)
      plan_error("rank " + std::to_string(t.rank) + " step " + std::to_string(t.step) + " reads KV of " +
                 std::to_string(t.kv_owner) + " but holds KV of " + std::to_string(ranks[t.rank].kv_owner));
  };

  // Forward ring.
  const PassPlan& fwd = plan.forward;
  std::vector<std::vector<ForwardResult<T>>> results(W);
  std::vector<std::vector<ForwardPart<T>>> parts(W);
  for (int g = 0; g < W; ++g) results[g].reserve(fwd.steps);
  for (int i = 0; i < fwd.steps; ++i) {
    for (int g = 0; g < W; ++g)
      if (fwd.tile(g, i).computed) check_owner(fwd.tile(g, i));
    // The ranks of one step are independent: simulated concurrently (each tile's result does not depend on the
    // thread count), recorded in rank order afterwards.
    std::vector<ForwardResult<T>> step_results(static_cast<size_t>(W));
    std::vector<std::vector<int64_t>> step_rows(static_cast<size_t>(W));
    parallel_over_ranks(W, [&](int g) {
      const Tile& t = fwd.tile(g, i);
      if (!t.computed) return;
      const RingRank<T>& rk = ranks[g];
      const bool qfull = t.q_half == HalfSelect::full, kfull = t.kv_half == HalfSelect::full;
      std::vector<int64_t> qrows = qfull ? identity_rows(rk.q.rows) : half_rows(gq, t.q_half);
      const std::vector<int64_t> krows = kfull ? std::vector<int64_t>{} : half_rows(gk, t.kv_half);
      step_results[g] = qfull && kfull ? arith.forward(t.call, rk.q, rk.k, rk.v)
                                       : arith.forward(t.call, qfull ? rk.q : take_rows(rk.q, qrows),
                                                       kfull ? rk.k : take_rows(rk.k, krows),
                                                       kfull ? rk.v : take_rows(rk.v, krows));
      step_rows[g] = std::move(qrows);
    });
    for (int g = 0; g < W; ++g) {
      if (!fwd.tile(g, i).computed) continue;
      if (options.record_trace) run.trace.forward.push_back({g, i, step_results[g].o, step_results[g].lse});
      results[g].push_back(std::move(step_results[g]));
      parts[g].push_back({nullptr, nullptr, std::move(step_rows[g])});
    }
    deliver_ring(fwd, i);
  }
  for (int g = 0; g < W; ++g) {
    for (size_t s = 0; s < parts[g].size(); ++s) {
      parts[g][s].o = &results[g][s].o;
      parts[g][s].lse = &results[g][s].lse;
    }
    ranks[g].o = Tensor3<T>(ranks[g].q.rows, hq / A, plan.comm == CommType::p2p ? inputs.dout.dim : inputs.dout.dim);
    ranks[g].lse = LseTensor<T>(hq / A, ranks[g].q.rows, neg_inf<T>());
    merge_forward(parts[g], ranks[g].o, ranks[g].lse, arith);
  }
  results.clear();

  // Back to rank-local rows (reverse a2a driven by the messages).
  auto gather_from_groups = [&](const PassPlan& pass, Payload payload, const std::vector<Tensor3<T>>& group,
                                const std::vector<int64_t>& level_map, const SidePartition& side, int heads,
                                int after_step) {
    std::vector<Tensor3<T>> out(W);
    for (int g = 0; g < W; ++g) out[g] = Tensor3<T>(side.local_rows(), heads, group[0].dim);
    const int64_t piece_rows = static_cast<int64_t>(level_map.size()) / A;
    std::vector<int> seen(static_cast<size_t>(W), 0);
    for (const Message& m : pass.messages) {
      if (m.after_step != after_step || m.payload != payload) continue;
      const int a = m.to_rank % A;
      const Tensor3<T>& src = group[m.from_rank];
      if (src.heads != m.head_end - m.head_begin) plan_error("a2a message heads do not match the sender's head group");
      Tensor3<T> piece(piece_rows, src.heads, src.dim);
      const int64_t s = src.row_stride();
      for (int64_t i = 0; i < piece_rows; ++i)
        std::copy_n(src.values.begin() + level_map[static_cast<size_t>(a * piece_rows + i)] * s, s,
                    piece.values.begin() + i * s);
      put_heads(out[m.to_rank], piece, m.head_begin);
      seen[static_cast<size_t>(m.to_rank)] += src.heads;
    }
    for (int g = 0; g < W; ++g)
      if (seen[static_cast<size_t>(g)] != heads)
        plan_error("rank " + std::to_string(g) + " received " + std::to_string(seen[static_cast<size_t>(g)]) + " of " +
                   std::to_string(heads) + " heads of " + std::string(payload_name(payload)));
    return out;
  };
  auto gather_lse_from_groups = [&](const PassPlan& pass, int after_step) {
    std::vector<LseTensor<T>> out(W);
    for (int g = 0; g < W; ++g) out[g] = LseTensor<T>(hq, qs.local_rows(), neg_inf<T>());
    const int64_t piece_rows = static_cast<int64_t>(level_map_q.size()) / A;
    for (const Message& m : pass.messages) {
      if (m.after_step != after_step || m.payload != Payload::lse) continue;
      const int a = m.to_rank % A;
      const LseTensor<T>& src = ranks[m.from_rank].lse;
      for (int64_t h = 0; h < src.heads; ++h)
        for (int64_t i = 0; i < piece_rows; ++i)
          out[m.to_rank](m.head_begin + h, i) = src(h, level_map_q[static_cast<size_t>(a * piece_rows + i)]);
    }
    return out;
  };

  run.ranks.resize(W);
  if (exchange) {
    std::vector<Tensor3<T>> o_group(W);
    for (int g = 0; g < W; ++g) o_group[g] = ranks[g].o;
    auto o_local = gather_from_groups(fwd, Payload::o, o_group, level_map_q, qs, hq, fwd.steps - 1);
    auto lse_local = gather_lse_from_groups(fwd, fwd.steps - 1);
    for (int g = 0; g < W; ++g) {
      run.ranks[g].o = std::move(o_local[g]);
      run.ranks[g].lse = std::move(lse_local[g]);
    }
  } else {
    for (int g = 0; g < W; ++g) {
      run.ranks[g].o = ranks[g].o;
      run.ranks[g].lse = ranks[g].lse;
    }
  }
  if (!options.backward) return run;

  // Backward: dO through the a2a, then the reversed ring with dKV travelling with KV.
  const PassPlan& bwd = plan.backward;
  if (exchange) {
    auto dout_s = scatter_to_groups(bwd, Payload::dout, dout_l, level_map_q, group_rows_q);
    for (int g = 0; g < W; ++g) ranks[g].dout = std::move(dout_s[g]);
  } else {
    for (int g = 0; g < W; ++g) ranks[g].dout = dout_l[g];
  }
  for (int g = 0; g < W; ++g) {
    ranks[g].dq = Tensor3<T>(ranks[g].q.rows, ranks[g].q.heads, ranks[g].q.dim);
    ranks[g].dkv_owner = -1;
  }
  for (int i = 0; i < bwd.steps; ++i) {
    for (int g = 0; g < W; ++g) {
      const Tile& t = bwd.tile(g, i);
      RingRank<T>& rk = ranks[g];
      if (rk.dkv_owner < 0) {  // first step: a fresh zero dKV for the KV held
        rk.dkv_owner = rk.kv_owner;
        rk.dk = Tensor3<T>(rk.k.rows, rk.k.heads, rk.k.dim);
        rk.dv = Tensor3<T>(rk.v.rows, rk.v.heads, rk.v.dim);
      }
      if (!t.computed) continue;
      check_owner(t);
      if (t.kv_owner >= 0 && rk.dkv_owner != t.kv_owner)
        plan_error("rank " + std::to_string(g) + " step " + std::to_string(i) + " holds dKV of " +
                   std::to_string(rk.dkv_owner) + " but computes for " + std::to_string(t.kv_owner));
    }
    std::vector<BackwardStepTrace<T>> step_trace(static_cast<size_t>(W));
    parallel_over_ranks(W, [&](int g) {
      const Tile& t = bwd.tile(g, i);
      if (!t.computed) return;
      RingRank<T>& rk = ranks[g];
      const bool qfull = t.q_half == HalfSelect::full, kfull = t.kv_half == HalfSelect::full;
      const std::vector<int64_t> qrows = qfull ? identity_rows(rk.q.rows) : half_rows(gq, t.q_half);
      const std::vector<int64_t> krows = kfull ? identity_rows(rk.k.rows) : half_rows(gk, t.kv_half);
      BackwardResult<T> res = arith.backward(
          t.call, qfull ? rk.q : take_rows(rk.q, qrows), kfull ? rk.k : take_rows(rk.k, krows),
          kfull ? rk.v : take_rows(rk.v, krows), qfull ? rk.o : take_rows(rk.o, qrows),
          qfull ? rk.lse : take_lse_rows(rk.lse, qrows), qfull ? rk.dout : take_rows(rk.dout, qrows));
      add_rows(rk.dq, res.dq, qrows);
      add_rows(rk.dk, res.dk, krows);
      add_rows(rk.dv, res.dv, krows);
      if (options.record_trace) {
        BackwardStepTrace<T> rec{g, i, std::move(res.dq), std::move(res.dk), std::move(res.dv), {}, {}};
        if (P > 1) {
          rec.dk_in_flight = rk.dk;
          rec.dv_in_flight = rk.dv;
        }
        step_trace[g] = std::move(rec);
      }
    });
    if (options.record_trace)
      for (int g = 0; g < W; ++g)
        if (bwd.tile(g, i).computed) run.trace.backward.push_back(std::move(step_trace[g]));
    deliver_ring(bwd, i);
  }
  for (int g = 0; g < W; ++g) {
    if (ranks[g].dkv_owner != g)
      plan_error("after the backward ring rank " + std::to_string(g) + " holds the dKV of " +
                 std::to_string(ranks[g].dkv_owner));
  }
  if (exchange) {
    std::vector<Tensor3<T>> dq_g(W), dk_g(W), dv_g(W);
    for (int g = 0; g < W; ++g) {
      dq_g[g] = ranks[g].dq;
      dk_g[g] = ranks[g].dk;
      dv_g[g] = ranks[g].dv;
    }
    auto dq = gather_from_groups(bwd, Payload::dq, dq_g, level_map_q, qs, hq, bwd.steps - 1);
    auto dk = gather_from_groups(bwd, Payload::dk, dk_g, level_map_kv, ks, hk, bwd.steps - 1);
    auto dv = gather_from_groups(bwd, Payload::dv, dv_g, level_map_kv, ks, hk, bwd.steps - 1);
    for (int g = 0; g < W; ++g) {
      run.ranks[g].dq = std::move(dq[g]);
      run.ranks[g].dk = std::move(dk[g]);
      run.ranks[g].dv = std::move(dv[g]);
    }
  } else {
    for (int g = 0; g < W; ++g) {
      run.ranks[g].dq = std::move(ranks[g].dq);
      run.ranks[g].dk = std::move(ranks[g].dk);
      run.ranks[g].dv = std::move(ranks[g].dv);
    }
  }
  for (auto& r : run.ranks) {
    round_all(r.dq, arith);
    round_all(r.dk, arith);
    round_all(r.dv, arith);
  }
  return run;
}

template <class Arith>
CpRun<typename Arith::T> run_all_gather(const Plan& plan, const CaseInputs& inputs, const Arith& arith,
                                        const ExecutorOptions& options) {
  using T = typename Arith::T;
  const int W = plan.cp_size;
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  const std::vector<int64_t> kv_map = ks.rank_order_to_sequence_order();
  const int64_t rk = ks.local_sequence_rows();
  const RankShards<T> shards = shard_inputs<T>(plan, inputs);
  const auto &q = shards.q, &k = shards.k, &v = shards.v, &dout = shards.dout;
  // All-gather K and V (rank order, as the messages deliver them) and reorder to sequence order.
  auto all_gather = [&](const PassPlan& pass, Payload payload, const std::vector<Tensor3<T>>& local) {
    std::vector<Tensor3<T>> seq(W);
    for (int r = 0; r < W; ++r) {
      seq[r] = Tensor3<T>(static_cast<int64_t>(kv_map.size()), local[r].heads, local[r].dim);
      std::vector<int> have(static_cast<size_t>(W), 0);
      have[static_cast<size_t>(r)] = 1;
      auto place = [&](const Tensor3<T>& src, int owner) {
        const int64_t s = src.row_stride();
        for (int64_t i = 0; i < rk; ++i)
          std::copy_n(src.values.begin() + i * s, s, seq[r].values.begin() + kv_map[static_cast<size_t>(owner * rk + i)] * s);
      };
      place(local[r], r);
      for (const Message& m : pass.messages)
        if (m.after_step == -1 && m.payload == payload && m.to_rank == r) {
          place(local[m.from_rank], m.shard_owner);
          have[static_cast<size_t>(m.shard_owner)] = 1;
        }
      for (int o = 0; o < W; ++o)
        if (!have[static_cast<size_t>(o)])
          plan_error("rank " + std::to_string(r) + " never received " + std::string(payload_name(payload)) +
                     " of rank " + std::to_string(o));
    }
    return seq;
  };
  CpRun<T> run;
  run.ranks.resize(W);
  auto k_seq = all_gather(plan.forward, Payload::k, k);
  auto v_seq = all_gather(plan.forward, Payload::v, v);
  // Each step writes the rows of its Q segments (copy of valid tokens); no merge.
  auto segment_rows = [](const AttentionCall& call) {
    std::vector<int64_t> rows;
    for (const SequenceTile& s : call.sequences)
      for (const RowSegment& seg : s.q)
        for (int32_t j = 0; j < seg.count; ++j) rows.push_back(seg.first_row + j);
    return rows;
  };
  for (int r = 0; r < W; ++r) {
    run.ranks[r].o = Tensor3<T>(qs.local_rows(), plan.heads_q, inputs.v.dim);
    run.ranks[r].lse = LseTensor<T>(plan.heads_q, qs.local_rows(), neg_inf<T>());
  }
  for (int s = 0; s < plan.forward.steps; ++s)
    for (int r = 0; r < W; ++r) {
      const Tile& t = plan.forward.tile(r, s);
      ForwardResult<T> res = arith.forward(t.call, q[r], k_seq[r], v_seq[r]);
      for (int64_t row : segment_rows(t.call)) {
        std::copy_n(res.o.at(row, 0), res.o.row_stride(), run.ranks[r].o.at(row, 0));
        for (int h = 0; h < plan.heads_q; ++h) run.ranks[r].lse(h, row) = res.lse(h, row);
      }
      if (options.record_trace) run.trace.forward.push_back({r, s, std::move(res.o), std::move(res.lse)});
    }
  if (!options.backward) return run;
  auto k_seq_b = all_gather(plan.backward, Payload::k, k);
  auto v_seq_b = all_gather(plan.backward, Payload::v, v);
  std::vector<Tensor3<T>> dk_seq(W), dv_seq(W);
  for (int r = 0; r < W; ++r) {
    run.ranks[r].dq = Tensor3<T>(qs.local_rows(), plan.heads_q, inputs.q.dim);
    dk_seq[r] = Tensor3<T>(static_cast<int64_t>(kv_map.size()), plan.heads_kv, inputs.k.dim);
    dv_seq[r] = Tensor3<T>(static_cast<int64_t>(kv_map.size()), plan.heads_kv, inputs.v.dim);
  }
  for (int s = 0; s < plan.backward.steps; ++s)
    for (int r = 0; r < W; ++r) {
      const Tile& t = plan.backward.tile(r, s);
      BackwardResult<T> res =
          arith.backward(t.call, q[r], k_seq_b[r], v_seq_b[r], run.ranks[r].o, run.ranks[r].lse, dout[r]);
      for (int64_t row : segment_rows(t.call))
        std::copy_n(res.dq.at(row, 0), res.dq.row_stride(), run.ranks[r].dq.at(row, 0));
      add_rows(dk_seq[r], res.dk, identity_rows(res.dk.rows));
      add_rows(dv_seq[r], res.dv, identity_rows(res.dv.rows));
      if (options.record_trace)
        run.trace.backward.push_back({r, s, std::move(res.dq), std::move(res.dk), std::move(res.dv), {}, {}});
    }
  // Reduce-scatter: rank `to` sums, in rank order, the rows of its shard from every rank's sequence-order buffer.
  auto reduce_scatter = [&](Payload payload, const std::vector<Tensor3<T>>& seq) {
    std::vector<Tensor3<T>> out(W);
    for (int to = 0; to < W; ++to) {
      std::vector<const Tensor3<T>*> from(static_cast<size_t>(W), nullptr);
      from[static_cast<size_t>(to)] = &seq[to];
      for (const Message& m : plan.backward.messages)
        if (m.payload == payload && m.to_rank == to && m.after_step == plan.backward.steps - 1) {
          if (m.shard_owner != to) plan_error("reduce-scatter message for the wrong shard");
          from[static_cast<size_t>(m.from_rank)] = &seq[m.from_rank];
        }
      out[to] = Tensor3<T>(ks.local_rows(), seq[to].heads, seq[to].dim);
      std::vector<int64_t> rows(kv_map.begin() + to * rk, kv_map.begin() + (to + 1) * rk);
      for (int r = 0; r < W; ++r) {
        if (!from[static_cast<size_t>(r)])
          plan_error("rank " + std::to_string(to) + " misses the " + std::string(payload_name(payload)) +
                     " contribution of rank " + std::to_string(r));
        const Tensor3<T> piece = take_rows(*from[static_cast<size_t>(r)], rows);
        add_rows(out[to], piece, identity_rows(rk));
      }
    }
    return out;
  };
  auto dk = reduce_scatter(Payload::dk, dk_seq);
  auto dv = reduce_scatter(Payload::dv, dv_seq);
  for (int r = 0; r < W; ++r) {
    run.ranks[r].dk = std::move(dk[r]);
    run.ranks[r].dv = std::move(dv[r]);
    round_all(run.ranks[r].dq, arith);
    round_all(run.ranks[r].dk, arith);
    round_all(run.ranks[r].dv, arith);
  }
  return run;
}

template <class Arith>
CpRun<typename Arith::T> run_cp(const Plan& plan, const CaseInputs& inputs, const Arith& arith,
                                const ExecutorOptions& options) {
  if (plan.comm == CommType::all_gather) return run_all_gather(plan, inputs, arith, options);
  return run_ring_family(plan, inputs, arith, options);
}

}  // namespace

template <class T>
Tensor3<T> shard_rows(const SidePartition& side, int rank, const Tensor3<T>& global) {
  return take_rows(global, side.gather_indices(rank));
}

CpRun<double> run_cp_oracle(const Plan& plan, const CaseInputs& inputs, const ExecutorOptions& options) {
  return run_cp(plan, inputs, OracleArith{options.kernel}, options);
}

CpRun<float> run_cp_peer(const Plan& plan, const CaseInputs& inputs, DType dtype, const ExecutorOptions& options) {
  return run_cp(plan, inputs, PeerArith{dtype, options.kernel}, options);
}

template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, const std::vector<RankOutputs<T>>& ranks) {
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  GlobalOutputs<T> out;
  const auto& r0 = ranks.at(0);
  out.o = Tensor3<T>(qs.global().total_rows, r0.o.heads, r0.o.dim);
  out.dq = Tensor3<T>(qs.global().total_rows, r0.dq.heads, r0.dq.dim);
  out.dk = Tensor3<T>(ks.global().total_rows, r0.dk.heads, r0.dk.dim);
  out.dv = Tensor3<T>(ks.global().total_rows, r0.dv.heads, r0.dv.dim);
  out.lse = LseTensor<T>(r0.lse.heads, qs.global().total_rows, neg_inf<T>());
  for (int r = 0; r < plan.cp_size; ++r) {
    const std::vector<int64_t> qi = qs.gather_indices(r), ki = ks.gather_indices(r);
    const RankOutputs<T>& x = ranks[static_cast<size_t>(r)];
    for (size_t i = 0; i < qi.size(); ++i) {
      std::copy_n(x.o.at(static_cast<int64_t>(i), 0), x.o.row_stride(), out.o.at(qi[i], 0));
      if (!x.dq.values.empty()) std::copy_n(x.dq.at(static_cast<int64_t>(i), 0), x.dq.row_stride(), out.dq.at(qi[i], 0));
      for (int64_t h = 0; h < x.lse.heads; ++h) out.lse(h, qi[i]) = x.lse(h, static_cast<int64_t>(i));
    }
    if (!x.dk.values.empty())
      for (size_t i = 0; i < ki.size(); ++i) {
        std::copy_n(x.dk.at(static_cast<int64_t>(i), 0), x.dk.row_stride(), out.dk.at(ki[i], 0));
        std::copy_n(x.dv.at(static_cast<int64_t>(i), 0), x.dv.row_stride(), out.dv.at(ki[i], 0));
      }
  }
  return out;
}

template Tensor3<double> shard_rows(const SidePartition&, int, const Tensor3<double>&);
template Tensor3<float> shard_rows(const SidePartition&, int, const Tensor3<float>&);
template GlobalOutputs<double> gather_outputs(const Plan&, const std::vector<RankOutputs<double>>&);
template GlobalOutputs<float> gather_outputs(const Plan&, const std::vector<RankOutputs<float>>&);

}  // namespace cpgold::sim
