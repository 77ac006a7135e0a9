#pragma once
// CPU executor of a Plan: W simulated ranks, each holding only its own shards; every message of the Plan is copied
// between rank buffers, so a wrong send/receive schedule shows up in the results. Two arithmetics:
//  - oracle: float64 tiles (reference/attention.hpp), merges and accumulations in float64;
//  - CP peer: the reference peer per tile (partials rounded to the dtype, LSE float32), merges and accumulations in
//    float32, final O / dQ / dK / dV rounded once to the dtype (docs/cp-plan.md, "Precision").
#include <algorithm>
#include <chrono>
#include <cstddef>  // size_t, used by reference/tensor.hpp
#include <stdexcept>
#include <vector>

#include "reference/attention.hpp"
#include "reference/attention_engine.hpp"
#include "reference/dtype.hpp"
#include "reference/tensor.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/plan/plan.hpp"
#include "sim/program/trace.hpp"

namespace cpgold::sim {

// Per-rank results in the rank-local layout (SidePartition::local_rows rows).
template <class T>
struct RankOutputs {
  Tensor3<T> o;      // [local_rows_q, heads_q, d_v]
  LseTensor<T> lse;  // [heads_q, local_rows_q]; -inf at pad rows and at valid rows with no visible key
  Tensor3<T> dq;     // [local_rows_q, heads_q, d_qk]
  Tensor3<T> dk;     // [local_rows_kv, heads_kv, d_qk]
  Tensor3<T> dv;     // [local_rows_kv, heads_kv, d_v]
};

template <class T>
struct CpRun {
  std::vector<RankOutputs<T>> ranks;  // [W]
  Trace<T> trace;
};

// How a merge of step partials combines them (sim/program/mistakes.hpp models the wrong ones). lse_weighted is the Plan's:
// LSE first, then O = sum O_i exp(lse_i - lse). The others run an online merge in step order,
// (o, lse) <- (o a + o_i b, logaddexp(lse, lse_i)) with a = exp(lse - lse_new), b = exp(lse_i - lse_new), and change
// one thing: a = 1 (running_o_not_rescaled), b = 1 (step_o_not_rescaled), a squared (double_rescale), or a partial
// whose lse_i is -inf (no key of the row in that step) taken as lse_i = 0 (keyless_step_lse_0) or +inf
// (keyless_step_lse_inf).
enum class MergeRule {
  lse_weighted,
  running_o_not_rescaled,
  step_o_not_rescaled,
  double_rescale,
  keyless_step_lse_0,
  keyless_step_lse_inf,
};

// A run that departs from the Plan the way a mistaken implementation does: which global rows each rank holds (inputs
// sharded and outputs held in that order), and the merge rule.
struct RunVariation {
  std::vector<std::vector<int64_t>> q_rows, kv_rows;  // [W][local row] -> global row; empty: the partition's
  MergeRule merge = MergeRule::lse_weighted;
};

struct ExecutorOptions {
  bool backward = true;
  bool record_trace = true;
  // Order of operations of every tile's attention call (the defaults are the reference's); `cpgold check --self`
  // runs the CP peer with another row block and the scale on K as an independent path.
  KernelOptions kernel{};
  // Takes the program's optional paths (sim/program/cp_program.hpp: forward_rows, and backward_sum unless record_trace), as
  // the GPU backend does: the host backend then gathers the halves itself and adds the step's dQ/dK/dV into the sums
  // at the rows given. The same bits as the default path; it lets the program's StepRows be tested without a GPU.
  bool by_rows = false;
  // A mistake to run (sim/program/mistakes.hpp); nullptr: the Plan as it is.
  const RunVariation* variation = nullptr;
  // Computes the attention of these KV heads [kv_head_begin, kv_head_end) and their query heads only (a fixture
  // generated in shards by head groups, fixtures/golden/golden_run.hpp): every tile's call runs on its heads inside the
  // range, with the same bits as a run of all heads (each head's arithmetic is its own); the other heads' tile results
  // are zeros (O, dQ, dK, dV) and -inf (LSE), so their outputs are not those of the case. Everything else (exchanges,
  // merges) runs as always. kv_head_end <= kv_head_begin: every head.
  int kv_head_begin = 0, kv_head_end = 0;
  // Computes every tile's attention (reference/attention_engine.hpp); nullptr: the CPU reference. Merges, exchanges
  // and the rounding of the sums stay the simulator's own.
  const AttentionEngine* engine = nullptr;
  // A run that must end by this time (the diagnosis replay's budget, check/diagnosis/replay.hpp): every rank checks it
  // before each tile's attention call, forward and backward, and the run ends with RunStopped once it has passed (a
  // tile already started runs to its end). The default never passes.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

// What a run whose ExecutorOptions::deadline passed throws (no results: the run is incomplete).
struct RunStopped : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Throws RunStopped when the deadline has passed (the executors' backends call it before every tile).
inline void stop_past(std::chrono::steady_clock::time_point deadline) {
  if (deadline != std::chrono::steady_clock::time_point::max() && std::chrono::steady_clock::now() > deadline)
    throw RunStopped("the run passed its deadline");
}

// Heads [h0, h1) of a tensor ([t, h, d]; LSE [h, t]) as a tensor of h1 - h0 heads.
template <class T>
Tensor3<T> slice_heads(const Tensor3<T>& x, int64_t h0, int64_t h1) {
  if (h0 == 0 && h1 == x.heads) return x;
  Tensor3<T> out(x.rows, h1 - h0, x.dim);
  for (int64_t r = 0; r < x.rows; ++r) std::copy_n(x.at(r, h0), (h1 - h0) * x.dim, out.at(r, 0));
  return out;
}
template <class T>
LseTensor<T> slice_heads(const LseTensor<T>& x, int64_t h0, int64_t h1) {
  LseTensor<T> out(h1 - h0, x.rows, T(0));
  std::copy(x.values.begin() + h0 * x.rows, x.values.begin() + h1 * x.rows, out.values.begin());
  return out;
}

// Global inputs are sharded with the partition's gather indices; each rank then sees only its shards.
CpRun<double> run_cp_oracle(const Plan& plan, const CaseInputs& inputs, const ExecutorOptions& options = {});
CpRun<float> run_cp_peer(const Plan& plan, const CaseInputs& inputs, DType dtype, const ExecutorOptions& options = {});

// Gathered back to the global layout (rows of the global tensors; tail and pad rows 0, LSE -inf there).
template <class T>
struct GlobalOutputs {
  Tensor3<T> o, dq, dk, dv;
  LseTensor<T> lse;
};
template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, const std::vector<RankOutputs<T>>& ranks);
// The same for outputs held in a variation's rows (the partition's when it states none).
template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, const std::vector<RankOutputs<T>>& ranks,
                                const RunVariation& variation);
// The same, freeing each rank's outputs once copied (memory: the global tensors plus one rank's, not all of them).
template <class T>
GlobalOutputs<T> gather_outputs(const Plan& plan, std::vector<RankOutputs<T>>&& ranks);

// local: [local_rows, h, d] of rank `rank` from a global [total_rows, h, d] (thd_get_partitioned_indices).
template <class T>
Tensor3<T> shard_rows(const SidePartition& side, int rank, const Tensor3<T>& global);

}  // namespace cpgold::sim
