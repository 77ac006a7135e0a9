// Exact CPU attention over an AttentionCall (see attention.hpp for the contract).
//
// Structure: one template over the accumulation type Acc (double for the oracle, float for the peer) and a
// rounding policy (identity for the oracle, round-to-dtype for the peer). Work is a flat list of tasks run with
// OpenMP; every output element is written by exactly one task, and each task runs in a fixed order, so the
// result does not depend on the thread count or the schedule.
//  - forward and dQ: task = (sequence, q head, block of row_block query rows inside one Q segment); the block's
//    visible key range is computed from positions, scores for it live in one [rows x keys] tile.
//  - dK, dV: task = (sequence, kv head, block of row_block key rows inside one KV segment); it walks the query
//    rows of every head of the group that can see the block, in row_block chunks, and accumulates in Acc.
#include "reference/attention.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "reference/input_error.hpp"

namespace cpgold {

void pin_eigen_blocking() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Fixed cache sizes make Eigen's GEMM blocking (and so its summation order) independent of the host.
    Eigen::setCpuCacheSizes(32 * 1024, 256 * 1024, 2 * 1024 * 1024);
    Eigen::setNbThreads(1);
  });
}

namespace {

template <class Acc>
using Matrix = Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class Acc>
using RowsMap = Eigen::Map<const Matrix<Acc>, 0, Eigen::OuterStride<>>;

// Rows [first_row, first_row + count) of one head of a [t, h, d] tensor, as a [count, d] matrix view.
template <class Acc>
RowsMap<Acc> head_rows(const Tensor3<Acc>& x, int64_t first_row, int64_t count, int64_t head) {
  return RowsMap<Acc>(x.at(first_row, head), count, x.dim, Eigen::OuterStride<>(x.row_stride()));
}

struct OracleRounding {
  double operator()(double x) const { return x; }
};
struct PeerRounding {
  DType dtype;
  float operator()(float x) const { return round_to(dtype, x); }
};

template <class Acc, class Round>
struct Arithmetic {
  Round round;
  KernelOptions options;
};

// A contiguous run of rows of one segment: rows [first_row, first_row + count) at positions [position, ...).
struct RowRun {
  int64_t first_row;
  int64_t count;
  int64_t position;
};

// Parts of the KV segments whose positions fall in [lo, hi] (inclusive), in segment order.
std::vector<RowRun> runs_in_range(const std::vector<RowSegment>& segments, int64_t lo, int64_t hi) {
  std::vector<RowRun> runs;
  for (const RowSegment& s : segments) {
    const int64_t a = std::max<int64_t>(lo, s.position);
    const int64_t b = std::min<int64_t>(hi, static_cast<int64_t>(s.position) + s.count - 1);
    if (a <= b) runs.push_back({s.first_row + (a - s.position), b - a + 1, a});
  }
  return runs;
}

// Positions of keys a query block with positions [p0, p1] can see.
std::pair<int64_t, int64_t> visible_key_range(const SequenceTile& seq, Window w, int64_t p0, int64_t p1) {
  const int64_t lo = w.left >= 0 ? p0 + seq.delta() - w.left : 0;
  const int64_t hi = w.right >= 0 ? p1 + seq.delta() + w.right : seq.length_kv - 1;
  return {std::max<int64_t>(lo, 0), std::min<int64_t>(hi, seq.length_kv - 1)};
}

// Positions of queries that can see a key block with positions [k0, k1].
std::pair<int64_t, int64_t> visible_query_range(const SequenceTile& seq, Window w, int64_t k0, int64_t k1) {
  const int64_t lo = w.right >= 0 ? k0 - seq.delta() - w.right : 0;
  const int64_t hi = w.left >= 0 ? k1 - seq.delta() + w.left : seq.length_q - 1;
  return {std::max<int64_t>(lo, 0), std::min<int64_t>(hi, seq.length_q - 1)};
}

struct QueryBlockTask {
  int seq;
  int head;
  RowRun rows;
};

std::vector<QueryBlockTask> query_block_tasks(const AttentionCall& call, int64_t heads, int row_block) {
  std::vector<QueryBlockTask> tasks;
  for (int b = 0; b < static_cast<int>(call.sequences.size()); ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (const RowSegment& s : call.sequences[b].q)
        for (int64_t i = 0; i < s.count; i += row_block)
          tasks.push_back({b, static_cast<int>(h),
                           {s.first_row + i, std::min<int64_t>(row_block, s.count - i), s.position + i}});
  return tasks;
}

std::vector<QueryBlockTask> key_block_tasks(const AttentionCall& call, int64_t kv_heads, int row_block) {
  std::vector<QueryBlockTask> tasks;
  for (int b = 0; b < static_cast<int>(call.sequences.size()); ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (const RowSegment& s : call.sequences[b].kv)
        for (int64_t i = 0; i < s.count; i += row_block)
          tasks.push_back({b, static_cast<int>(h),
                           {s.first_row + i, std::min<int64_t>(row_block, s.count - i), s.position + i}});
  return tasks;
}

void check_shapes(const AttentionCall& call, const auto& q, const auto& k, const auto& v) {
  if (q.rows != call.q_rows) fail_input("q", "has ", q.rows, " rows but the call addresses ", call.q_rows);
  if (k.rows != call.kv_rows) fail_input("k", "has ", k.rows, " rows but the call addresses ", call.kv_rows);
  if (v.rows != k.rows) fail_input("v", "has ", v.rows, " rows but k has ", k.rows);
  if (k.heads <= 0 || q.heads % k.heads != 0)
    fail_input("heads_kv", "value ", k.heads, " does not divide heads_q = ", q.heads);
  if (v.heads != k.heads) fail_input("v", "has ", v.heads, " heads but k has ", k.heads);
  if (q.dim != k.dim) fail_input("dim_qk", "q has dim ", q.dim, " but k has ", k.dim);
  call.check();
}

// Scores of a query block against the visible key runs: s = scale * q.k (or q.(round(scale*k)) with scale_on_k),
// masked entries -inf. Returns the tile [rows, keys] and fills key positions.
template <class Acc, class Round>
Matrix<Acc> score_tile(const Arithmetic<Acc, Round>& arith, const AttentionCall& call, const SequenceTile& seq,
                       const Tensor3<Acc>& q, const Tensor3<Acc>& k, int64_t q_head, int64_t kv_head,
                       const RowRun& rows, const std::vector<RowRun>& key_runs, std::vector<int64_t>& key_pos) {
  int64_t keys = 0;
  for (const RowRun& r : key_runs) keys += r.count;
  key_pos.resize(keys);
  Matrix<Acc> s(rows.count, keys);
  const auto q_rows = head_rows(q, rows.first_row, rows.count, q_head);
  const Acc scale = static_cast<Acc>(call.softmax_scale);
  int64_t col = 0;
  for (const RowRun& r : key_runs) {
    const auto k_rows = head_rows(k, r.first_row, r.count, kv_head);
    if (arith.options.scale_on_k) {
      Matrix<Acc> k_scaled = (k_rows * scale).unaryExpr(arith.round);
      s.middleCols(col, r.count).noalias() = q_rows * k_scaled.transpose();
    } else {
      s.middleCols(col, r.count).noalias() = q_rows * k_rows.transpose();
      s.middleCols(col, r.count) *= scale;
    }
    for (int64_t j = 0; j < r.count; ++j) key_pos[col + j] = r.position + j;
    col += r.count;
  }
  const int64_t delta = seq.delta();
  for (int64_t i = 0; i < rows.count; ++i)
    for (int64_t j = 0; j < keys; ++j)
      if (!visible(call.window, rows.position + i, key_pos[j], delta)) s(i, j) = -std::numeric_limits<Acc>::infinity();
  return s;
}

template <class Acc, class Round>
ForwardResult<Acc> forward_impl(const AttentionCall& call, const Tensor3<Acc>& q, const Tensor3<Acc>& k,
                                const Tensor3<Acc>& v, const Arithmetic<Acc, Round>& arith) {
  pin_eigen_blocking();
  check_shapes(call, q, k, v);
  const int64_t group = q.heads / k.heads;
  ForwardResult<Acc> out{Tensor3<Acc>(q.rows, q.heads, v.dim),
                         LseTensor<Acc>(q.heads, q.rows, -std::numeric_limits<Acc>::infinity())};
  const auto tasks = query_block_tasks(call, q.heads, arith.options.row_block);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
    const QueryBlockTask& task = tasks[t];
    const SequenceTile& seq = call.sequences[task.seq];
    const int64_t kv_head = task.head / group;
    const auto [lo, hi] = visible_key_range(seq, call.window, task.rows.position,
                                            task.rows.position + task.rows.count - 1);
    const auto key_runs = runs_in_range(seq.kv, lo, hi);
    std::vector<int64_t> key_pos;
    Matrix<Acc> s = score_tile(arith, call, seq, q, k, task.head, kv_head, task.rows, key_runs, key_pos);
    const int64_t keys = s.cols();
    std::vector<Acc> row_sum(task.rows.count, Acc(0));
    std::vector<Acc> row_max(task.rows.count, -std::numeric_limits<Acc>::infinity());
    for (int64_t i = 0; i < task.rows.count; ++i) {
      for (int64_t j = 0; j < keys; ++j) row_max[i] = std::max(row_max[i], s(i, j));
      if (row_max[i] == -std::numeric_limits<Acc>::infinity()) {
        s.row(i).setZero();  // no visible key: O = 0, LSE = -inf
        continue;
      }
      for (int64_t j = 0; j < keys; ++j) {
        const Acc p = std::exp(s(i, j) - row_max[i]);
        row_sum[i] += p;
        s(i, j) = arith.round(p);  // P rounded to the dtype before P.V (identity for the oracle)
      }
    }
    Matrix<Acc> o_acc = Matrix<Acc>::Zero(task.rows.count, v.dim);
    int64_t col = 0;
    for (const RowRun& r : key_runs) {
      o_acc.noalias() += s.middleCols(col, r.count) * head_rows(v, r.first_row, r.count, kv_head);
      col += r.count;
    }
    for (int64_t i = 0; i < task.rows.count; ++i) {
      if (row_sum[i] == Acc(0)) continue;
      Acc* o_row = out.o.at(task.rows.first_row + i, task.head);
      for (int64_t x = 0; x < v.dim; ++x) o_row[x] = arith.round(o_acc(i, x) / row_sum[i]);
      out.lse(task.head, task.rows.first_row + i) = row_max[i] + std::log(row_sum[i]);
    }
  }
  return out;
}

// D_i = sum_x dO[i, x] * O[i, x] for one row, in a fixed order.
template <class Acc>
Acc row_delta(const Tensor3<Acc>& o, const Tensor3<Acc>& dout, int64_t row, int64_t head) {
  const Acc* o_row = o.at(row, head);
  const Acc* d_row = dout.at(row, head);
  Acc sum = 0;
  for (int64_t x = 0; x < o.dim; ++x) sum += d_row[x] * o_row[x];
  return sum;
}

// P = exp(s - lse) and dS = P * (dP - D) over one tile; masked entries (s = -inf) give 0. On return `s` holds P
// and `dp` holds dS.
template <class Acc>
void softmax_gradient_tile(Matrix<Acc>& s, Matrix<Acc>& dp, const std::vector<Acc>& lse, const std::vector<Acc>& d) {
  for (int64_t i = 0; i < s.rows(); ++i) {
    const bool empty = lse[i] == -std::numeric_limits<Acc>::infinity();
    for (int64_t j = 0; j < s.cols(); ++j) {
      const Acc p = (empty || s(i, j) == -std::numeric_limits<Acc>::infinity()) ? Acc(0) : std::exp(s(i, j) - lse[i]);
      s(i, j) = p;
      dp(i, j) = p * (dp(i, j) - d[i]);
    }
  }
}

template <class Acc, class Round>
BackwardResult<Acc> backward_impl(const AttentionCall& call, const Tensor3<Acc>& q, const Tensor3<Acc>& k,
                                  const Tensor3<Acc>& v, const Tensor3<Acc>& o, const LseTensor<Acc>& lse,
                                  const Tensor3<Acc>& dout, const Arithmetic<Acc, Round>& arith) {
  pin_eigen_blocking();
  check_shapes(call, q, k, v);
  if (o.rows != q.rows || o.heads != q.heads || o.dim != v.dim)
    fail_input("o", "has shape [", o.rows, ", ", o.heads, ", ", o.dim, "], expected [", q.rows, ", ", q.heads, ", ",
               v.dim, "]");
  if (!dout.same_shape(o))
    fail_input("dout", "has shape [", dout.rows, ", ", dout.heads, ", ", dout.dim, "], expected that of o");
  if (lse.heads != q.heads || lse.rows != q.rows)
    fail_input("lse", "has shape [", lse.heads, ", ", lse.rows, "], expected [", q.heads, ", ", q.rows, "]");
  const int64_t group = q.heads / k.heads;
  const int block = arith.options.row_block;
  // dQ = scale * dS.K, dK = scale * dS^T.Q; with scale_on_k the scale of dQ already sits in the scaled K.
  const Acc dq_scale = arith.options.scale_on_k ? Acc(1) : static_cast<Acc>(call.softmax_scale);
  const Acc dk_scale = static_cast<Acc>(call.softmax_scale);
  BackwardResult<Acc> out{Tensor3<Acc>(q.rows, q.heads, q.dim), Tensor3<Acc>(k.rows, k.heads, k.dim),
                          Tensor3<Acc>(v.rows, v.heads, v.dim)};

  // dQ: one task per query block, over all keys the block sees.
  const auto q_tasks = query_block_tasks(call, q.heads, block);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < static_cast<int64_t>(q_tasks.size()); ++t) {
    const QueryBlockTask& task = q_tasks[t];
    const SequenceTile& seq = call.sequences[task.seq];
    const int64_t kv_head = task.head / group;
    const auto [lo, hi] = visible_key_range(seq, call.window, task.rows.position,
                                            task.rows.position + task.rows.count - 1);
    const auto key_runs = runs_in_range(seq.kv, lo, hi);
    std::vector<int64_t> key_pos;
    Matrix<Acc> s = score_tile(arith, call, seq, q, k, task.head, kv_head, task.rows, key_runs, key_pos);
    Matrix<Acc> dp(s.rows(), s.cols());
    const auto do_rows = head_rows(dout, task.rows.first_row, task.rows.count, task.head);
    int64_t col = 0;
    for (const RowRun& r : key_runs) {
      dp.middleCols(col, r.count).noalias() = do_rows * head_rows(v, r.first_row, r.count, kv_head).transpose();
      col += r.count;
    }
    std::vector<Acc> row_lse(task.rows.count), d(task.rows.count);
    for (int64_t i = 0; i < task.rows.count; ++i) {
      row_lse[i] = lse(task.head, task.rows.first_row + i);
      d[i] = row_delta(o, dout, task.rows.first_row + i, task.head);
    }
    softmax_gradient_tile(s, dp, row_lse, d);
    dp = dp.unaryExpr(arith.round);  // dS rounded to the dtype before dS.K
    Matrix<Acc> dq_acc = Matrix<Acc>::Zero(task.rows.count, q.dim);
    col = 0;
    for (const RowRun& r : key_runs) {
      const auto k_rows = head_rows(k, r.first_row, r.count, kv_head);
      if (arith.options.scale_on_k) {
        const Matrix<Acc> k_scaled = (k_rows * static_cast<Acc>(call.softmax_scale)).unaryExpr(arith.round);
        dq_acc.noalias() += dp.middleCols(col, r.count) * k_scaled;
      } else {
        dq_acc.noalias() += dp.middleCols(col, r.count) * k_rows;
      }
      col += r.count;
    }
    for (int64_t i = 0; i < task.rows.count; ++i) {
      Acc* dq_row = out.dq.at(task.rows.first_row + i, task.head);
      for (int64_t x = 0; x < q.dim; ++x) dq_row[x] = arith.round(dq_scale * dq_acc(i, x));
    }
  }

  // dK, dV: one task per key block, summing over the query heads of its group in a fixed order.
  const auto k_tasks = key_block_tasks(call, k.heads, block);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < static_cast<int64_t>(k_tasks.size()); ++t) {
    const QueryBlockTask& task = k_tasks[t];
    const SequenceTile& seq = call.sequences[task.seq];
    const int64_t kv_head = task.head;
    const RowRun key_run = task.rows;
    const std::vector<RowRun> key_runs{key_run};
    const auto [lo, hi] = visible_query_range(seq, call.window, key_run.position, key_run.position + key_run.count - 1);
    const auto query_runs = runs_in_range(seq.q, lo, hi);
    Matrix<Acc> dk_acc = Matrix<Acc>::Zero(key_run.count, k.dim);
    Matrix<Acc> dv_acc = Matrix<Acc>::Zero(key_run.count, v.dim);
    const auto v_rows = head_rows(v, key_run.first_row, key_run.count, kv_head);
    std::vector<int64_t> key_pos;
    for (int64_t q_head = kv_head * group; q_head < (kv_head + 1) * group; ++q_head) {
      for (const RowRun& run : query_runs) {
        for (int64_t i0 = 0; i0 < run.count; i0 += block) {
          const RowRun rows{run.first_row + i0, std::min<int64_t>(block, run.count - i0), run.position + i0};
          Matrix<Acc> s = score_tile(arith, call, seq, q, k, q_head, kv_head, rows, key_runs, key_pos);
          const auto do_rows = head_rows(dout, rows.first_row, rows.count, q_head);
          Matrix<Acc> dp = do_rows * v_rows.transpose();
          std::vector<Acc> row_lse(rows.count), d(rows.count);
          for (int64_t i = 0; i < rows.count; ++i) {
            row_lse[i] = lse(q_head, rows.first_row + i);
            d[i] = row_delta(o, dout, rows.first_row + i, q_head);
          }
          softmax_gradient_tile(s, dp, row_lse, d);
          s = s.unaryExpr(arith.round);    // P rounded before P^T.dO
          dp = dp.unaryExpr(arith.round);  // dS rounded before dS^T.Q
          dv_acc.noalias() += s.transpose() * do_rows;
          dk_acc.noalias() += dp.transpose() * head_rows(q, rows.first_row, rows.count, q_head);
        }
      }
    }
    for (int64_t j = 0; j < key_run.count; ++j) {
      Acc* dk_row = out.dk.at(key_run.first_row + j, kv_head);
      Acc* dv_row = out.dv.at(key_run.first_row + j, kv_head);
      for (int64_t x = 0; x < k.dim; ++x) dk_row[x] = arith.round(dk_scale * dk_acc(j, x));
      for (int64_t x = 0; x < v.dim; ++x) dv_row[x] = arith.round(dv_acc(j, x));
    }
  }
  return out;
}

}  // namespace

ForwardResult<double> attention_forward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                        const Tensor3<double>& v, const KernelOptions& options) {
  return forward_impl(call, q, k, v, Arithmetic<double, OracleRounding>{{}, options});
}

BackwardResult<double> attention_backward(const AttentionCall& call, const Tensor3<double>& q,
                                          const Tensor3<double>& k, const Tensor3<double>& v,
                                          const Tensor3<double>& o, const LseTensor<double>& lse,
                                          const Tensor3<double>& dout, const KernelOptions& options) {
  return backward_impl(call, q, k, v, o, lse, dout, Arithmetic<double, OracleRounding>{{}, options});
}

ForwardResult<float> attention_forward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                       const Tensor3<float>& v, DType dtype, const KernelOptions& options) {
  return forward_impl(call, q, k, v, Arithmetic<float, PeerRounding>{{dtype}, options});
}

BackwardResult<float> attention_backward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                         const Tensor3<float>& v, const Tensor3<float>& o,
                                         const LseTensor<float>& lse, const Tensor3<float>& dout, DType dtype,
                                         const KernelOptions& options) {
  return backward_impl(call, q, k, v, o, lse, dout, Arithmetic<float, PeerRounding>{{dtype}, options});
}

}  // namespace cpgold
