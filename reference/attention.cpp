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
#include <type_traits>
#include <utility>
#include <vector>

#include "reference/input_error.hpp"
#include "reference/isa_level.hpp"

namespace cpgold {

void pin_eigen_blocking() {
  static std::once_flag once;
  std::call_once(once, [] {
    // The results' bits depend on the instruction-set level too; naming it here links its CPU check
    // (reference/isa_level.cpp) into every program that computes attention.
    (void)isa_level();
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
  float operator()(float x) const { return dtype == DType::bf16 ? round_to_bf16(x) : round_to(dtype, x); }
  void in_place(float* values, int64_t n) const { round_in_place(dtype, values, n); }
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

struct BlockTask {
  int seq;
  int head;
  RowRun rows;
};

// Blocks of row_block rows inside the Q segments (side = &SequenceTile::q) or the KV segments (&SequenceTile::kv)
// of every sequence, for each of `heads` heads.
std::vector<BlockTask> block_tasks(const AttentionCall& call, std::vector<RowSegment> SequenceTile::*side,
                                        int64_t heads, int row_block) {
  std::vector<BlockTask> tasks;
  for (int b = 0; b < static_cast<int>(call.sequences.size()); ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (const RowSegment& s : call.sequences[b].*side)
        for (int64_t i = 0; i < s.count; i += row_block)
          tasks.push_back({b, static_cast<int>(h),
                           {s.first_row + i, std::min<int64_t>(row_block, s.count - i), s.position + i}});
  return tasks;
}

// The KV rows a query-block task's rows can see, as runs of consecutive positions in segment order.
std::vector<RowRun> visible_key_runs(const AttentionCall& call, const BlockTask& task) {
  const SequenceTile& seq = call.sequences[task.seq];
  const auto [lo, hi] =
      visible_key_range(seq, call.window, task.rows.position, task.rows.position + task.rows.count - 1);
  return runs_in_range(seq.kv, lo, hi);
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

// Visible columns of one tile row: for each key run, the half-open column range the window leaves visible.
// Key positions inside a run are consecutive, so a window cuts each run into at most one visible range.
std::vector<std::pair<int64_t, int64_t>> visible_columns(Window w, int64_t delta, int64_t q_pos,
                                                         const std::vector<RowRun>& key_runs) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t col = 0;
  for (const RowRun& r : key_runs) {
    int64_t lo = r.position, hi = r.position + r.count;  // positions [lo, hi)
    if (w.left >= 0) lo = std::max(lo, q_pos + delta - w.left);
    if (w.right >= 0) hi = std::min(hi, q_pos + delta + w.right + 1);
    if (lo < hi) ranges.emplace_back(col + lo - r.position, col + hi - r.position);
    else ranges.emplace_back(col, col);
    col += r.count;
  }
  return ranges;
}

// Sets every column outside the visible ranges of row i to `value` (begin <= end always; empty = [col, col)).
template <class Acc>
void fill_masked(Matrix<Acc>& tile, int64_t i, const std::vector<std::pair<int64_t, int64_t>>& visible,
                 const std::vector<RowRun>& key_runs, Acc value) {
  int64_t col = 0;
  for (size_t r = 0; r < key_runs.size(); ++r) {
    const auto [begin, end] = visible[r];
    const int64_t run_end = col + key_runs[r].count;
    if (begin > col) tile.row(i).segment(col, begin - col).setConstant(value);
    if (run_end > end) tile.row(i).segment(end, run_end - end).setConstant(value);
    col = run_end;
  }
}

// Scores of a query block against the key runs: s = scale * q.k (or q.(scale*k) with scale_on_k, the product
// kept in Acc), before masking. Returns the tile [rows, keys].
template <class Acc, class Round>
Matrix<Acc> score_tile(const Arithmetic<Acc, Round>& arith, const AttentionCall& call, const Tensor3<Acc>& q,
                       const Tensor3<Acc>& k, int64_t q_head, int64_t kv_head, const RowRun& rows,
                       const std::vector<RowRun>& key_runs) {
  int64_t keys = 0;
  for (const RowRun& r : key_runs) keys += r.count;
  if (arith.options.progress) arith.options.progress->advance(rows.count * keys);
  Matrix<Acc> s(rows.count, keys);
  const auto q_rows = head_rows(q, rows.first_row, rows.count, q_head);
  const Acc scale = static_cast<Acc>(call.softmax_scale);
  int64_t col = 0;
  for (const RowRun& r : key_runs) {
    const auto k_rows = head_rows(k, r.first_row, r.count, kv_head);
    if (arith.options.scale_on_k) {
      const Matrix<Acc> k_scaled = k_rows * scale;
      s.middleCols(col, r.count).noalias() = q_rows * k_scaled.transpose();
    } else {
      s.middleCols(col, r.count).noalias() = q_rows * k_rows.transpose();
      s.middleCols(col, r.count) *= scale;
    }
    col += r.count;
  }
  return s;
}

// A query block task's scores: its sequence, its KV head, the key runs its rows see and the score tile over them.
template <class Acc>
struct BlockScores {
  const SequenceTile& seq;
  int64_t kv_head;
  std::vector<RowRun> key_runs;
  Matrix<Acc> s;
};
template <class Acc, class Round>
BlockScores<Acc> block_scores(const Arithmetic<Acc, Round>& arith, const AttentionCall& call, const Tensor3<Acc>& q,
                              const Tensor3<Acc>& k, const BlockTask& task) {
  const int64_t kv_head = task.head / (q.heads / k.heads);
  std::vector<RowRun> key_runs = visible_key_runs(call, task);
  Matrix<Acc> s = score_tile(arith, call, q, k, task.head, kv_head, task.rows, key_runs);
  return {call.sequences[task.seq], kv_head, std::move(key_runs), std::move(s)};
}

template <class Acc, class Round>
ForwardResult<Acc> forward_impl(const AttentionCall& call, const Tensor3<Acc>& q, const Tensor3<Acc>& k,
                                const Tensor3<Acc>& v, const Arithmetic<Acc, Round>& arith) {
  pin_eigen_blocking();
  check_shapes(call, q, k, v);
  ForwardResult<Acc> out{Tensor3<Acc>(q.rows, q.heads, v.dim),
                         LseTensor<Acc>(q.heads, q.rows, -std::numeric_limits<Acc>::infinity())};
  const auto tasks = block_tasks(call, &SequenceTile::q, q.heads, arith.options.row_block);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
    const BlockTask& task = tasks[t];
    auto [seq, kv_head, key_runs, s] = block_scores(arith, call, q, k, task);
    std::vector<Acc> row_sum(task.rows.count, Acc(0));
    std::vector<Acc> row_max(task.rows.count, -std::numeric_limits<Acc>::infinity());
    for (int64_t i = 0; i < task.rows.count; ++i) {
      const auto visible = visible_columns(call.window, seq.delta(), task.rows.position + i, key_runs);
      for (const auto& [begin, end] : visible)
        if (end > begin) row_max[i] = std::max(row_max[i], s.row(i).segment(begin, end - begin).maxCoeff());
      if (row_max[i] == -std::numeric_limits<Acc>::infinity()) {
        s.row(i).setZero();  // no visible key: O = 0, LSE = -inf
        continue;
      }
      s.row(i).array() = (s.row(i).array() - row_max[i]).exp();
      fill_masked(s, i, visible, key_runs, Acc(0));  // masked scores may have overflowed: overwrite, never scale
      row_sum[i] = s.row(i).sum();
      if constexpr (!std::is_same_v<Round, OracleRounding>)
        arith.round.in_place(s.row(i).data(), s.cols());  // P rounded to the dtype before P.V
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

// P = exp(s - lse) and dS = P * (dP - D) over one tile whose rows start at position q_pos0; masked entries give 0.
// On return `s` holds P and `dp` holds dS.
template <class Acc>
void softmax_gradient_tile(Matrix<Acc>& s, Matrix<Acc>& dp, const std::vector<Acc>& lse, const std::vector<Acc>& d,
                           Window window, int64_t delta, int64_t q_pos0, const std::vector<RowRun>& key_runs) {
  for (int64_t i = 0; i < s.rows(); ++i) {
    if (lse[i] == -std::numeric_limits<Acc>::infinity()) {
      s.row(i).setZero();
      dp.row(i).setZero();
      continue;
    }
    s.row(i).array() = (s.row(i).array() - lse[i]).exp();
    fill_masked(s, i, visible_columns(window, delta, q_pos0 + i, key_runs), key_runs, Acc(0));
    dp.row(i).array() = s.row(i).array() * (dp.row(i).array() - d[i]);
  }
}

template <class Acc, class Round>
BackwardResult<Acc> backward_impl(const AttentionCall& call, const Tensor3<Acc>& q, const Tensor3<Acc>& k,
                                  const Tensor3<Acc>& v, const Tensor3<Acc>& o, const LseTensor<Acc>& lse,
                                  const Tensor3<Acc>& dout, const Arithmetic<Acc, Round>& arith) {
  pin_eigen_blocking();
  check_shapes(call, q, k, v);
  check_backward_shapes(q, v, o, lse, dout);
  const int64_t group = q.heads / k.heads;
  const int block = arith.options.row_block;
  // dQ = scale * dS.K, dK = scale * dS^T.Q; with scale_on_k the scale of dQ already sits in the scaled K.
  const Acc dq_scale = arith.options.scale_on_k ? Acc(1) : static_cast<Acc>(call.softmax_scale);
  const Acc dk_scale = static_cast<Acc>(call.softmax_scale);
  BackwardResult<Acc> out{Tensor3<Acc>(q.rows, q.heads, q.dim), Tensor3<Acc>(k.rows, k.heads, k.dim),
                          Tensor3<Acc>(v.rows, v.heads, v.dim)};

  // dQ: one task per query block, over all keys the block sees.
  const auto q_tasks = block_tasks(call, &SequenceTile::q, q.heads, block);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < static_cast<int64_t>(q_tasks.size()); ++t) {
    const BlockTask& task = q_tasks[t];
    auto [seq, kv_head, key_runs, s] = block_scores(arith, call, q, k, task);
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
    softmax_gradient_tile(s, dp, row_lse, d, call.window, seq.delta(), task.rows.position, key_runs);
    if constexpr (!std::is_same_v<Round, OracleRounding>) arith.round.in_place(dp.data(), dp.size());  // dS before dS.K
    Matrix<Acc> dq_acc = Matrix<Acc>::Zero(task.rows.count, q.dim);
    col = 0;
    for (const RowRun& r : key_runs) {
      const auto k_rows = head_rows(k, r.first_row, r.count, kv_head);
      if (arith.options.scale_on_k) {
        const Matrix<Acc> k_scaled = k_rows * static_cast<Acc>(call.softmax_scale);
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
  const auto k_tasks = block_tasks(call, &SequenceTile::kv, k.heads, block);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < static_cast<int64_t>(k_tasks.size()); ++t) {
    const BlockTask& task = k_tasks[t];
    const SequenceTile& seq = call.sequences[task.seq];
    const int64_t kv_head = task.head;
    const RowRun key_run = task.rows;
    const std::vector<RowRun> key_runs{key_run};
    const auto [lo, hi] = visible_query_range(seq, call.window, key_run.position, key_run.position + key_run.count - 1);
    const auto query_runs = runs_in_range(seq.q, lo, hi);
    Matrix<Acc> dk_acc = Matrix<Acc>::Zero(key_run.count, k.dim);
    Matrix<Acc> dv_acc = Matrix<Acc>::Zero(key_run.count, v.dim);
    const auto v_rows = head_rows(v, key_run.first_row, key_run.count, kv_head);
    for (int64_t q_head = kv_head * group; q_head < (kv_head + 1) * group; ++q_head) {
      for (const RowRun& run : query_runs) {
        for (int64_t i0 = 0; i0 < run.count; i0 += block) {
          const RowRun rows{run.first_row + i0, std::min<int64_t>(block, run.count - i0), run.position + i0};
          Matrix<Acc> s = score_tile(arith, call, q, k, q_head, kv_head, rows, key_runs);
          const auto do_rows = head_rows(dout, rows.first_row, rows.count, q_head);
          Matrix<Acc> dp = do_rows * v_rows.transpose();
          std::vector<Acc> row_lse(rows.count), d(rows.count);
          for (int64_t i = 0; i < rows.count; ++i) {
            row_lse[i] = lse(q_head, rows.first_row + i);
            d[i] = row_delta(o, dout, rows.first_row + i, q_head);
          }
          softmax_gradient_tile(s, dp, row_lse, d, call.window, seq.delta(), rows.position, key_runs);
          if constexpr (!std::is_same_v<Round, OracleRounding>) {
            arith.round.in_place(s.data(), s.size());    // P rounded before P^T.dO
            arith.round.in_place(dp.data(), dp.size());  // dS rounded before dS^T.Q
          }
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

double attention_workspace_bytes(int64_t max_keys, int64_t dim_qk, int64_t dim_v, int element_bytes,
                                 const KernelOptions& options) {
  // The dQ task holds the largest tiles: s and dp [rows x keys], with dq_acc [rows x d_qk]; the forward's s and
  // o_acc are smaller. Eigen's products pack blocks of at most the pinned cache sizes (2 MiB L3) for each operand.
  const double rows = options.row_block;
  const double tiles = 2 * rows * static_cast<double>(max_keys) + rows * static_cast<double>(std::max(dim_qk, dim_v));
  return tiles * element_bytes + 2 * 2 * 1024 * 1024;
}

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
