// CPU executor of a Plan: the one CP orchestration (sim/program/cp_program.hpp) over a host backend. Every simulated rank
// runs the per-rank program on its own thread with only its own shards; exchanges are host copies matched by a
// Rendezvous, so a wrong send/receive schedule shows up in the results (or as an error naming rank and operation).
// Results do not depend on the thread count: each rank's arithmetic is sequential in plan order, the traces are
// ordered by (step, rank) afterwards.
#include "sim/program/executor.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>

#include "reference/attention.hpp"
#include "reference/lse_merge.hpp"
#include "sim/program/cp_program.hpp"
#include "sim/program/host_backend.hpp"
#include "sim/program/rendezvous.hpp"

namespace cpgold::sim {

namespace {

template <class T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}


// Arithmetic policies: the oracle (float64) and the CP peer (reference peer per tile, float32 merges).
struct OracleArith {
  using T = double;
  KernelOptions kernel;
  const AttentionEngine& engine;
  ForwardResult<double> forward(const AttentionCall& c, const Tensor3<double>& q, const Tensor3<double>& k,
                                const Tensor3<double>& v) const {
    return engine.forward(c, q, k, v, kernel);
  }
  BackwardResult<double> backward(const AttentionCall& c, const Tensor3<double>& q, const Tensor3<double>& k,
                                  const Tensor3<double>& v, const Tensor3<double>& o, const LseTensor<double>& lse,
                                  const Tensor3<double>& dout) const {
    return engine.backward(c, q, k, v, o, lse, dout, kernel);
  }
  double round(double x) const { return x; }
};

struct PeerArith {
  using T = float;
  DType dtype;
  KernelOptions kernel;
  const AttentionEngine& engine;
  ForwardResult<float> forward(const AttentionCall& c, const Tensor3<float>& q, const Tensor3<float>& k,
                               const Tensor3<float>& v) const {
    return engine.forward(c, q, k, v, dtype, kernel);
  }
  BackwardResult<float> backward(const AttentionCall& c, const Tensor3<float>& q, const Tensor3<float>& k,
                                 const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                                 const Tensor3<float>& dout) const {
    return engine.backward(c, q, k, v, o, lse, dout, dtype, kernel);
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

// The online merge of a MergeRule other than lse_weighted (executor.hpp): parts in step order.
template <class T, class Arith>
void merge_forward_online(const std::vector<ForwardPart<T>>& parts, Tensor3<T>& o, LseTensor<T>& lse, MergeRule rule,
                          const Arith& arith) {
  const T inf = std::numeric_limits<T>::infinity();
  for (const auto& part : parts)
    for (size_t i = 0; i < part.rows.size(); ++i)
      for (int64_t h = 0; h < o.heads; ++h) {
        T li = (*part.lse)(h, static_cast<int64_t>(i));
        if (li == -inf && rule == MergeRule::keyless_step_lse_0) li = T(0);
        if (li == -inf && rule == MergeRule::keyless_step_lse_inf) li = inf;
        T& l = lse(h, part.rows[i]);
        const T merged = (l == inf || li == inf) ? inf : lse_merge(l, li);
        T a = l == -inf ? T(0) : std::exp(l - merged);
        T b = li == -inf ? T(0) : std::exp(li - merged);
        if (rule == MergeRule::running_o_not_rescaled && l != -inf) a = T(1);
        if (rule == MergeRule::step_o_not_rescaled && li != -inf) b = T(1);
        if (rule == MergeRule::double_rescale) a *= a;
        const T* src = part.o->at(static_cast<int64_t>(i), h);
        T* dst = o.at(part.rows[i], h);
        for (int64_t x = 0; x < o.dim; ++x) dst[x] = (a == T(0) ? T(0) : dst[x] * a) + (b == T(0) ? T(0) : src[x] * b);
        l = merged;
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

template <class T>
RankShards<T> shard_inputs(const Plan& plan, const CaseInputs& inputs, const RunVariation* variation) {
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  RankShards<T> shards;
  for (int r = 0; r < plan.cp_size; ++r) {
    const bool own_rows = variation && !variation->q_rows.empty();
    const std::vector<int64_t> rows_q = own_rows ? variation->q_rows[static_cast<size_t>(r)] : qs.gather_indices(r);
    const std::vector<int64_t> rows_kv = own_rows ? variation->kv_rows[static_cast<size_t>(r)] : ks.gather_indices(r);
    shards.q.push_back(gather_rows_as<T>(inputs.q, rows_q));
    shards.k.push_back(gather_rows_as<T>(inputs.k, rows_kv));
    shards.v.push_back(gather_rows_as<T>(inputs.v, rows_kv));
    shards.dout.push_back(gather_rows_as<T>(inputs.dout, rows_q));
  }
  return shards;
}

// The host backend of the per-rank program for one simulated rank: Tensor3 / LseTensor storage of the arithmetic's
// type (the accumulator kind is the same type), the arithmetic's attention per tile, memcpy exchanges.
template <class Arith>
class HostRankBackend : public HostBackend<HostRankBackend<Arith>, typename Arith::T> {
  using Base = HostBackend<HostRankBackend<Arith>, typename Arith::T>;

 public:
  using T = typename Arith::T;
  using Tensor = Tensor3<T>;
  using Lse = LseTensor<T>;
  using Forward = ForwardResult<T>;
  using Backward = BackwardResult<T>;

  HostRankBackend(int rank, const RankShards<T>& shards, const Arith& arith, Rendezvous<HostCopy>& rendezvous,
                  bool record_trace, bool by_rows, MergeRule merge, int kv_head_begin = 0, int kv_head_end = 0,
                  int group = 1,
                  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max())
      : Base(rank, shards, rendezvous, record_trace), arith_(arith), by_rows_(by_rows), merge_(merge),
        kv_begin_(kv_head_begin), kv_end_(kv_head_end), group_(group), deadline_(deadline) {}

  void scatter_add(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) const { add_rows(dst, src, rows); }

  Forward forward(const Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) const {
    stop_past(deadline_);
    const TileHeads h = tile_heads(t, q.heads, k.heads);
    if (h.all) return arith_.forward(t.call, q, k, v);
    Forward out{Tensor(q.rows, q.heads, v.dim), Lse(q.heads, q.rows, neg_inf<T>())};
    if (h.q0 >= h.q1) return out;
    const Forward part = arith_.forward(t.call, slice_heads(q, h.q0, h.q1), slice_heads(k, h.k0, h.k1),
                                        slice_heads(v, h.k0, h.k1));
    place_heads(out.o, h.q0, part.o);
    std::copy(part.lse.values.begin(), part.lse.values.end(), out.lse.values.begin() + h.q0 * q.rows);
    return out;
  }
  Backward backward(const Tile& t, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Lse& lse,
                    const Tensor& dout) const {
    stop_past(deadline_);
    const TileHeads h = tile_heads(t, q.heads, k.heads);
    if (h.all) return arith_.backward(t.call, q, k, v, o, lse, dout);
    Backward out{Tensor(q.rows, q.heads, q.dim), Tensor(k.rows, k.heads, k.dim), Tensor(v.rows, v.heads, v.dim)};
    if (h.q0 >= h.q1) return out;
    const Backward part = arith_.backward(t.call, slice_heads(q, h.q0, h.q1), slice_heads(k, h.k0, h.k1),
                                          slice_heads(v, h.k0, h.k1), slice_heads(o, h.q0, h.q1),
                                          slice_heads(lse, h.q0, h.q1), slice_heads(dout, h.q0, h.q1));
    place_heads(out.dq, h.q0, part.dq);
    place_heads(out.dk, h.k0, part.dk);
    place_heads(out.dv, h.k0, part.dv);
    return out;
  }
  // The program's optional paths (ExecutorOptions::by_rows): the halves are gathered here rather than by the program.
  bool reads_halves() const { return by_rows_; }
  bool sums_backward() const { return by_rows_ && !this->record_trace_; }
  Forward forward_rows(const Tile& t, const StepRows& rows, const Tensor& q, const Tensor& k, const Tensor& v) const {
    return forward(t, half(q, rows.q_half, rows.q), half(k, rows.kv_half, rows.kv), half(v, rows.kv_half, rows.kv));
  }
  void backward_sum(const Tile& t, const StepRows& rows, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& o, const Lse& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                    SumEnds ends) const {
    Backward res = backward(t, half(q, rows.q_half, rows.q), half(k, rows.kv_half, rows.kv),
                            half(v, rows.kv_half, rows.kv), half(o, rows.q_half, rows.q),
                            rows.q_half ? this->lse_gather(lse, rows.q) : lse, half(dout, rows.q_half, rows.q));
    scatter_add(dq, rows.q, res.dq);
    scatter_add(dk, rows.kv, res.dk);
    scatter_add(dv, rows.kv, res.dv);
    // A finished sum is rounded here, as the GPU backend writes it in the dtype; finalize rounds it again, which
    // changes nothing unless a later step still added to it (what the by_rows test would show).
    if (ends.dq) finalize(dq);
    if (ends.dkv) {
      finalize(dk);
      finalize(dv);
    }
  }
  void merge_forward(const std::vector<MergePart<HostRankBackend>>& parts, Tensor& o, Lse& lse) const {
    std::vector<ForwardPart<T>> host_parts;
    host_parts.reserve(parts.size());
    for (const auto& part : parts) host_parts.push_back({part.o, part.lse, part.rows});
    if (merge_ == MergeRule::lse_weighted) cpgold::sim::merge_forward(host_parts, o, lse, arith_);
    else merge_forward_online(host_parts, o, lse, merge_, arith_);
  }
  void finalize(Tensor& x) const { round_all(x, arith_); }

 private:
  // The heads of a tile inside the filter (ExecutorOptions::kv_head_begin/end), local to the tile's tensors.
  struct TileHeads {
    bool all = true;
    int64_t q0 = 0, q1 = 0, k0 = 0, k1 = 0;
  };
  TileHeads tile_heads(const Tile& t, int64_t q_heads, int64_t kv_heads) const {
    TileHeads h;
    if (kv_end_ <= kv_begin_) return h;
    const int64_t k0 = std::max<int64_t>(kv_begin_, t.kv_head_begin), k1 = std::min<int64_t>(kv_end_, t.kv_head_end);
    if (k0 <= t.kv_head_begin && k1 >= t.kv_head_end) return h;  // every head of the tile
    h.all = false;
    if (k1 <= k0) return h;  // none
    h.k0 = k0 - t.kv_head_begin, h.k1 = k1 - t.kv_head_begin;
    h.q0 = h.k0 * group_, h.q1 = h.k1 * group_;
    if (t.kv_head_end - t.kv_head_begin != kv_heads || (t.head_end - t.head_begin) != q_heads)
      program_error("tile heads do not match the rank's tensors");
    return h;
  }
  // dst[:, h0 + h] = src[:, h] for every head of src.
  static void place_heads(Tensor& dst, int64_t h0, const Tensor& src) {
    for (int64_t r = 0; r < src.rows; ++r) std::copy_n(src.at(r, 0), src.heads * src.dim, dst.at(r, h0));
  }

  // The step's rows of a rank tensor: the gathered half, or the whole tensor.
  Tensor half(const Tensor& x, bool is_half, const std::vector<int64_t>& rows) const {
    return is_half ? this->gather(x, rows, 0, static_cast<int>(x.heads)) : x;
  }

  const Arith& arith_;
  bool by_rows_;
  MergeRule merge_;
  int kv_begin_, kv_end_, group_;
  std::chrono::steady_clock::time_point deadline_;
};

template <class Arith>
CpRun<typename Arith::T> run_cp(const Plan& plan, const CaseInputs& inputs, const Arith& arith,
                                const ExecutorOptions& options) {
  using T = typename Arith::T;
  using Backend = HostRankBackend<Arith>;
  const int W = plan.cp_size;
  const RankShards<T> shards = shard_inputs<T>(plan, inputs, options.variation);
  // A simulated exchange never legitimately waits long: the peers are threads of this process.
  Rendezvous<HostCopy> rendezvous(W, std::chrono::minutes(10));
  std::vector<std::unique_ptr<Backend>> backends;
  for (int g = 0; g < W; ++g) backends.push_back(
        std::make_unique<Backend>(g, shards, arith, rendezvous, options.record_trace, options.by_rows,
                                  options.variation ? options.variation->merge : MergeRule::lse_weighted,
                                  options.kv_head_begin, options.kv_head_end,
                                  plan.heads_kv > 0 ? plan.heads_q / plan.heads_kv : 1, options.deadline));
  return run_backends<T>(plan, backends, rendezvous, options.backward, options.record_trace);
}

}  // namespace

template <class T>
Tensor3<T> shard_rows(const SidePartition& side, int rank, const Tensor3<T>& global) {
  return gather_rows(global, side.gather_indices(rank));
}

CpRun<double> run_cp_oracle(const Plan& plan, const CaseInputs& inputs, const ExecutorOptions& options) {
  return run_cp(plan, inputs, OracleArith{options.kernel, options.engine ? *options.engine : cpu_engine()}, options);
}

CpRun<float> run_cp_peer(const Plan& plan, const CaseInputs& inputs, DType dtype, const ExecutorOptions& options) {
  return run_cp(plan, inputs, PeerArith{dtype, options.kernel, options.engine ? *options.engine : cpu_engine()},
                options);
}

namespace {
// Copies rank r's outputs into their global rows.
template <class T>
void gather_rank(const std::vector<int64_t>& qi, const std::vector<int64_t>& ki, const RankOutputs<T>& x,
                 GlobalOutputs<T>& out) {
#pragma omp parallel for schedule(static) if (x.o.values.size() > (size_t{1} << 18))
  for (size_t i = 0; i < qi.size(); ++i) {
    std::copy_n(x.o.at(static_cast<int64_t>(i), 0), x.o.row_stride(), out.o.at(qi[i], 0));
    if (!x.dq.values.empty()) std::copy_n(x.dq.at(static_cast<int64_t>(i), 0), x.dq.row_stride(), out.dq.at(qi[i], 0));
    for (int64_t h = 0; h < x.lse.heads; ++h) out.lse(h, qi[i]) = x.lse(h, static_cast<int64_t>(i));
  }
  if (!x.dk.values.empty()) {
#pragma omp parallel for schedule(static) if (x.dk.values.size() > (size_t{1} << 18))
    for (size_t i = 0; i < ki.size(); ++i) {
      std::copy_n(x.dk.at(static_cast<int64_t>(i), 0), x.dk.row_stride(), out.dk.at(ki[i], 0));
      std::copy_n(x.dv.at(static_cast<int64_t>(i), 0), x.dv.row_stride(), out.dv.at(ki[i], 0));
    }
  }
}
template <class T>
GlobalOutputs<T> global_like(const Plan& plan, const RankOutputs<T>& r0) {
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  GlobalOutputs<T> out;
  out.o = Tensor3<T>(qs.global().total_rows, r0.o.heads, r0.o.dim);
  out.dq = Tensor3<T>(qs.global().total_rows, r0.dq.heads, r0.dq.dim);
  out.dk = Tensor3<T>(ks.global().total_rows, r0.dk.heads, r0.dk.dim);
  out.dv = Tensor3<T>(ks.global().total_rows, r0.dv.heads, r0.dv.dim);
  out.lse = LseTensor<T>(r0.lse.heads, qs.global().total_rows, neg_inf<T>());
  return out;
}
}  // namespace

template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, std::vector<RankOutputs<T>>&& ranks) {
  GlobalOutputs<T> out = global_like(plan, ranks.at(0));
  for (int r = 0; r < plan.cp_size; ++r) {
    gather_rank(plan.partition.q.gather_indices(r), plan.partition.kv.gather_indices(r), ranks[static_cast<size_t>(r)], out);
    ranks[static_cast<size_t>(r)] = RankOutputs<T>{};  // each rank freed once copied: one tensor set at a time
  }
  ranks.clear();
  return out;
}

template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, const std::vector<RankOutputs<T>>& ranks) {
  GlobalOutputs<T> out = global_like(plan, ranks.at(0));
  for (int r = 0; r < plan.cp_size; ++r)
    gather_rank(plan.partition.q.gather_indices(r), plan.partition.kv.gather_indices(r), ranks[static_cast<size_t>(r)],
                out);
  return out;
}

template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, const std::vector<RankOutputs<T>>& ranks,
                                const RunVariation& variation) {
  if (variation.q_rows.empty()) return gather_outputs(plan, ranks);
  GlobalOutputs<T> out = global_like(plan, ranks.at(0));
  for (int r = 0; r < plan.cp_size; ++r)
    gather_rank(variation.q_rows[static_cast<size_t>(r)], variation.kv_rows[static_cast<size_t>(r)],
                ranks[static_cast<size_t>(r)], out);
  return out;
}

template Tensor3<double> shard_rows(const SidePartition&, int, const Tensor3<double>&);
template Tensor3<float> shard_rows(const SidePartition&, int, const Tensor3<float>&);
template GlobalOutputs<double> gather_outputs(const Plan&, const std::vector<RankOutputs<double>>&);
template GlobalOutputs<float> gather_outputs(const Plan&, const std::vector<RankOutputs<float>>&);
template GlobalOutputs<double> gather_outputs(const Plan&, std::vector<RankOutputs<double>>&&);
template GlobalOutputs<double> gather_outputs(const Plan&, const std::vector<RankOutputs<double>>&, const RunVariation&);
template GlobalOutputs<float> gather_outputs(const Plan&, std::vector<RankOutputs<float>>&&);

}  // namespace cpgold::sim