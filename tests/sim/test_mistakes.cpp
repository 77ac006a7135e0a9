// The catalogue of modelled CP mistakes (sim/program/mistakes.hpp): which mistakes a plan admits, that each is one change of
// the Plan or of the run (rows held, merge rule) and moves the outputs, and that the run's variation plumbing leaves
// the correct run bit for bit as it was. Whether a mistake reproduces an implementation that makes it is proved
// against independent implementations (python/tests/test_replay.py).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "sim/case/case_inputs.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/program/executor.hpp"
#include "sim/program/mistakes.hpp"
#include "sim/plan/plan.hpp"

using namespace cpgold;
using namespace cpgold::sim;

namespace {

CaseSpec causal_case(int W, std::vector<int32_t> lengths, CommType comm = CommType::p2p) {
  CaseSpec s;
  s.seqlens_q = std::move(lengths);
  s.cp_size = W;
  s.comm = comm;
  s.causal = true;
  s.window = normalize_window(true, {-1, -1});
  s.heads_q = 4;
  s.heads_kv = 2;
  s.dim_qk = 8;
  s.dtype = DType::fp32;
  s.seed = 7;
  return s;
}

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Largest difference of two tensors' values; INFINITY where one is NaN or an infinity the other is not.
double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    if (std::isnan(x) && std::isnan(y)) continue;
    if (std::isfinite(x) && std::isfinite(y)) worst = std::max(worst, std::fabs(x - y));
    else if (x != y) return INFINITY;
  }
  return worst;
}

}  // namespace

TEST_CASE("mistakes: the catalogue holds what changes something for the plan") {
  const Plan p2p = make_plan(causal_case(2, {57, 13, 30}));
  const std::vector<std::string> names = mistake_names(p2p);
  for (const char* name : {"contiguous_chunks", "chunks_swapped", "ranks_reversed", "counts_cu_div_w", "counts_cu_div_2w",
                           "right_edge+1:every", "right_edge+1:diagonal", "right_edge-1:diagonal",
                           "running_o_not_rescaled", "step_o_not_rescaled", "double_rescale", "last_row_dropped"}) {
    CAPTURE(name);
    CHECK(has(names, name));
  }
  CHECK_FALSE(has(names, "left_edge+1:every"));  // causal: the left side is unbounded
  // Causal p2p: every row of every step sees a key (its own chunk on the diagonal, earlier chunks below it).
  CHECK_FALSE(has(names, "keyless_step_lse_0"));
  // The rescale rules act on the partials merged into a running result: steps after the first.
  const std::optional<Mistake> rescale = make_mistake(p2p, "running_o_not_rescaled");
  REQUIRE(rescale);
  REQUIRE(rescale->changed_tiles.size() == 2);
  for (const TileRef& t : rescale->changed_tiles) CHECK(t.step == 1);
  CHECK_FALSE(make_mistake(p2p, "no_such_mistake"));
  // last_row_dropped: every call that reads a rank's last valid query row of a sequence reads one row less.
  const std::optional<Mistake> dropped = make_mistake(p2p, "last_row_dropped");
  REQUIRE(dropped);
  int64_t rows_before = 0, rows_after = 0;
  for (size_t i = 0; i < p2p.forward.tiles.size(); ++i)
    for (size_t b = 0; b < p2p.forward.tiles[i].call.sequences.size(); ++b) {
      for (const RowSegment& s : p2p.forward.tiles[i].call.sequences[b].q) rows_before += s.count;
      for (const RowSegment& s : dropped->plan.forward.tiles[i].call.sequences[b].q) rows_after += s.count;
    }
  CHECK(rows_after < rows_before);
  CHECK(rows_before - rows_after <= static_cast<int64_t>(p2p.forward.tiles.size() * 3));  // at most one per call and sequence

  // Lengths that split evenly over the 2W chunks: the count shortcuts are the right counts.
  const std::vector<std::string> even = mistake_names(make_plan(causal_case(2, {8, 16, 4})));
  CHECK_FALSE(has(even, "counts_cu_div_w"));
  CHECK_FALSE(has(even, "counts_cu_div_2w"));

  // W = 1: no layout, no counts, no merge.
  const std::vector<std::string> one = mistake_names(make_plan(causal_case(1, {57, 13})));
  CHECK_FALSE(has(one, "contiguous_chunks"));
  CHECK_FALSE(has(one, "counts_cu_div_w"));
  CHECK_FALSE(has(one, "keyless_step_lse_0"));
  CHECK(has(one, "right_edge+1:every"));

  // a2a: one step (no merge), every sequence in order after the all-to-all (no count shortcut).
  CaseSpec a2a = causal_case(2, {57, 13, 30}, CommType::a2a);
  const std::vector<std::string> a2a_names = mistake_names(make_plan(a2a));
  CHECK_FALSE(has(a2a_names, "keyless_step_lse_0"));
  CHECK_FALSE(has(a2a_names, "counts_cu_div_w"));
  CHECK(has(a2a_names, "contiguous_chunks"));
}

TEST_CASE("mistakes: a layout mistake moves whole chunks, every global row is held once") {
  const CaseSpec spec = causal_case(3, {57, 13, 30});
  const Plan plan = make_plan(spec);
  for (const char* name : {"contiguous_chunks", "chunks_swapped", "ranks_reversed"}) {
    CAPTURE(name);
    const std::optional<Mistake> m = make_mistake(plan, name);
    REQUIRE(m);
    CHECK(m->changed_tiles.empty());
    std::multiset<int64_t> held, expected;
    for (int r = 0; r < plan.cp_size; ++r) {
      const auto& rows = m->variation.q_rows[static_cast<size_t>(r)];
      const auto right = plan.partition.q.gather_indices(r);
      REQUIRE(rows.size() == right.size());
      held.insert(rows.begin(), rows.end());
      expected.insert(right.begin(), right.end());
    }
    CHECK(held == expected);
  }
  // contiguous: rank r's first local row of sequence 0 is the first row of chunk 2r.
  const std::optional<Mistake> c = make_mistake(plan, "contiguous_chunks");
  const int32_t C = plan.partition.q.chunk_size(0);
  for (int r = 0; r < 3; ++r) CHECK(c->variation.q_rows[static_cast<size_t>(r)][0] == 2 * r * C);
}

TEST_CASE("mistakes: the run's variation plumbing leaves the correct run bit for bit, every mistake moves the outputs") {
  CaseSpec spec = causal_case(2, {57, 13, 30});
  spec.seqlens_kv = {57, 13, 30};
  const Plan plan = make_plan(spec);
  const CaseInputs inputs = make_case_inputs(spec);
  ExecutorOptions plain;
  plain.record_trace = false;
  const CpRun<double> right = run_cp_oracle(plan, inputs, plain);
  RunVariation none;
  ExecutorOptions with_none = plain;
  with_none.variation = &none;
  const CpRun<double> same = run_cp_oracle(plan, inputs, with_none);
  for (int r = 0; r < 2; ++r) {
    CHECK(right.ranks[r].o.values == same.ranks[r].o.values);
    CHECK(right.ranks[r].dq.values == same.ranks[r].dq.values);
    CHECK(right.ranks[r].dk.values == same.ranks[r].dk.values);
  }
  const GlobalOutputs<double> global = gather_outputs(plan, right.ranks);
  for (const std::string& name : mistake_names(plan)) {
    CAPTURE(name);
    const std::optional<Mistake> m = make_mistake(plan, name);
    REQUIRE(m);
    ExecutorOptions options = plain;
    options.variation = &m->variation;
    const CpRun<double> run = run_cp_oracle(m->plan, inputs, options);
    const GlobalOutputs<double> wrong = gather_outputs(m->plan, run.ranks, m->variation);
    const double moved = std::max({max_difference(global.o.values, wrong.o.values),
                                   max_difference(global.lse.values, wrong.lse.values),
                                   max_difference(global.dq.values, wrong.dq.values),
                                   max_difference(global.dk.values, wrong.dk.values)});
    // A mask edge of the lower or upper section is listed because their calls change, but where those calls see
    // whole chunks (causal: keys of earlier chunks only) one key more or less on their far side changes nothing.
    if (name.find(":lower") != std::string::npos || name.find(":upper") != std::string::npos) continue;
    CHECK(moved > 1e-6);
  }
}

TEST_CASE("mistakes: the merge rules, on one row, as their definitions say") {
  // Two steps of a non-causal W = 2 case: every row merges two partials; the merged LSE is the logaddexp of both.
  CaseSpec spec = causal_case(2, {8});
  spec.causal = false;
  spec.window = normalize_window(false, {-1, -1});
  const Plan plan = make_plan(spec);
  const CaseInputs inputs = make_case_inputs(spec);
  ExecutorOptions options;
  options.backward = false;
  const CpRun<double> right = run_cp_oracle(plan, inputs, options);  // with the step partials (trace)
  REQUIRE(right.trace.forward.size() == 4);
  auto partial = [&](int rank, int step) -> const ForwardStepTrace<double>& {
    for (const auto& t : right.trace.forward)
      if (t.rank == rank && t.step == step) return t;
    FAIL("no partial");
    return right.trace.forward[0];
  };
  // Rank 0, local row 0, head 0, element 0: both steps read the whole shard (non-causal), rows line up.
  const auto& s0 = partial(0, 0);
  const auto& s1 = partial(0, 1);
  const double l0 = s0.lse(0, 0), l1 = s1.lse(0, 0), o0 = s0.o.at(0, 0)[0], o1 = s1.o.at(0, 0)[0];
  const double l = std::max(l0, l1) + std::log1p(std::exp(std::min(l0, l1) - std::max(l0, l1)));
  struct Expect {
    const char* name;
    double o;
  } expect[] = {{"running_o_not_rescaled", o0 + o1 * std::exp(l1 - l)},
                {"step_o_not_rescaled", o0 * std::exp(l0 - l) + o1},
                {"double_rescale", o0 * std::exp(2 * (l0 - l)) + o1 * std::exp(l1 - l)}};
  CHECK(right.ranks[0].o.at(0, 0)[0] == doctest::Approx(o0 * std::exp(l0 - l) + o1 * std::exp(l1 - l)).epsilon(1e-12));
  for (const Expect& e : expect) {
    CAPTURE(e.name);
    const std::optional<Mistake> m = make_mistake(plan, e.name);
    REQUIRE(m);
    ExecutorOptions o = options;
    o.variation = &m->variation;
    o.record_trace = false;
    const CpRun<double> run = run_cp_oracle(m->plan, inputs, o);
    CHECK(run.ranks[0].o.at(0, 0)[0] == doctest::Approx(e.o).epsilon(1e-12));
    CHECK(run.ranks[0].lse(0, 0) == doctest::Approx(l).epsilon(1e-12));
  }
}

TEST_CASE("mistakes: keyless steps merged with LSE 0 scale the row by S / (S + 1)") {
  // TransformerEngine's finding 2 shape: sequence 0 has one key, on rank 0's first chunk only; rank 1's step 0 and
  // rank 0's step 1 hold its queries and none of its keys.
  CaseSpec spec = causal_case(2, {4, 4});
  spec.causal = false;
  spec.window = normalize_window(false, {-1, -1});
  spec.seqlens_kv = {1, 4};
  const Plan plan = make_plan(spec);
  const CaseInputs inputs = make_case_inputs(spec);
  ExecutorOptions options;
  options.record_trace = false;
  options.backward = false;
  const CpRun<double> right = run_cp_oracle(plan, inputs, options);
  const std::optional<Mistake> m = make_mistake(plan, "keyless_step_lse_0");
  REQUIRE(m);
  // The partials with a keyless row: rank 0's step 1 and rank 1's step 0 (sequence 0's key is on rank 0).
  REQUIRE(m->changed_tiles.size() == 2);
  CHECK(((m->changed_tiles[0].rank == 0 && m->changed_tiles[0].step == 1) ||
         (m->changed_tiles[1].rank == 0 && m->changed_tiles[1].step == 1)));
  ExecutorOptions o = options;
  o.variation = &m->variation;
  const CpRun<double> run = run_cp_oracle(m->plan, inputs, o);
  // Rank 0, local row 0 (sequence 0, position 0): one visible key, S = exp(lse); the mistake gives O S / (S + 1).
  const double lse = right.ranks[0].lse(0, 0), S = std::exp(lse);
  CHECK(run.ranks[0].o.at(0, 0)[0] == doctest::Approx(right.ranks[0].o.at(0, 0)[0] * S / (S + 1)).epsilon(1e-12));
  CHECK(run.ranks[0].lse(0, 0) == doctest::Approx(std::log(S + 1)).epsilon(1e-12));
}
