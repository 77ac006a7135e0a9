// The float64 CP executor against the non-CP reference: O, LSE, dQ, dK, dV within 1e-12 relative, pad rows 0.
#include <doctest/doctest.h>

#include "cp_check.hpp"
#include "tests/reference/input_error_check.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::sim::testing;
using namespace cpgold::testing;

namespace {

struct MaskCase {
  const char* name;
  bool causal;
  Window window;
};
const MaskCase kMasks[] = {{"causal", true, {-1, 0}}, {"none", false, {-1, -1}}, {"causal window (3,0)", true, {3, 0}},
                           {"window (2,3)", false, {2, 3}}, {"window wider than the sequences", false, {100, 100}}};

CaseSpec base_case(CommType comm, int W, const MaskCase& m, uint64_t seed) {
  CaseSpec s;
  s.comm = comm;
  s.cp_size = W;
  s.causal = m.causal;
  s.window = normalize_window(m.causal, m.window);
  s.seed = seed;
  s.dim_qk = 8;
  s.dim_v = 8;
  s.pad_fill = PadFill::nan;
  s.dtype = DType::fp32;
  // GQA everywhere: 2 query heads per kv head; a2a splits heads over W, a2a+p2p over a2a_size.
  const int split = comm == CommType::a2a ? W : (comm == CommType::a2a_p2p ? std::min(W, 2) : 1);
  s.heads_kv = split;
  s.heads_q = 2 * split;
  if (comm == CommType::a2a_p2p) s.a2a_size = W >= 2 ? 2 : 1;
  return s;
}

}  // namespace

TEST_CASE("float64 CP executor matches the non-CP reference: every comm type, W, mask") {
  const CommType comms[] = {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p};
  for (CommType comm : comms)
    for (int W : {1, 2, 3, 4, 8}) {
      if (comm == CommType::a2a_p2p && W == 3) continue;  // a2a_size 2 must divide W
      for (const MaskCase& m : kMasks) {
        CAPTURE(std::string(comm_name(comm)));
        CAPTURE(W);
        CAPTURE(std::string(m.name));
        TestRng rng{static_cast<uint64_t>(W * 131 + static_cast<int>(comm) * 7)};
        CaseSpec s = base_case(comm, W, m, rng.next());
        s.seqlens_q = random_lengths(rng, W, 3, 6 * W);
        check_case(s);
      }
    }
}

TEST_CASE("edge layouts: tail padding only, padding between every sequence, no padding, partial chunk r") {
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p})
    for (int W : {2, 4}) {
      CAPTURE(std::string(comm_name(comm)));
      CAPTURE(W);
      CaseSpec s = base_case(comm, W, kMasks[0], 7);
      SUBCASE("no padding at all") { s.seqlens_q = {4 * W, 2 * W, 6 * W}; }
      SUBCASE("padding between every sequence") {
        s.seqlens_q = {3, 2 * W + 1, 5};
        s.padded_q = {4 * W, 4 * W, 2 * W + 2 * W};
      }
      SUBCASE("chunk r partly valid, chunk 2W-1-r all padding") {
        s.seqlens_q = {2 * W + 1};  // padded 4W, C = 2: rank 1 holds 1 valid row of chunk 1... and nothing of 2W-2
        s.padded_q = {4 * W};
      }
      SUBCASE("zero-length and length-1 sequences") { s.seqlens_q = {0, 1, 0, 2 * W - 1, 0}; }
      SUBCASE("tail padding only (p2p tail rows)") {
        s.seqlens_q = {2 * W, 4 * W};
        if (comm == CommType::p2p) s.total_tokens_q = s.total_tokens_kv = 6 * W + 2 * W;
      }
      check_case(s);
    }
}

TEST_CASE("MLA (d_qk != d_v) and MQA") {
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p}) {
    CAPTURE(std::string(comm_name(comm)));
    CaseSpec s = base_case(comm, 4, kMasks[0], 11);
    s.seqlens_q = {13, 0, 22, 5};
    s.dim_qk = 12;
    s.dim_v = 8;
    check_case(s);
    if (comm == CommType::p2p || comm == CommType::all_gather) {
      s.heads_q = 4;
      s.heads_kv = 1;  // MQA
      check_case(s);
    }
  }
}

TEST_CASE("non-causal cross attention with L_q != L_kv under CP") {
  for (CommType comm : {CommType::p2p, CommType::all_gather, CommType::a2a}) {
    CaseSpec s = base_case(comm, 2, kMasks[1], 5);
    s.seqlens_q = {3, 9, 0};
    s.seqlens_kv = {7, 2, 4};
    check_case(s);
  }
}

TEST_CASE("pads filled with Inf do not reach outputs") {
  CaseSpec s = base_case(CommType::p2p, 3, kMasks[2], 3);
  s.seqlens_q = {5, 1, 10};
  s.pad_fill = PadFill::inf;
  check_case(s);
}

TEST_CASE("CP peer stays close to the oracle and keeps pads zero") {
  CaseSpec s = base_case(CommType::p2p, 4, kMasks[0], 9);
  s.seqlens_q = {30, 7, 17};
  s.dtype = DType::bf16;
  const Plan plan = make_plan(s);
  const CaseInputs in = make_case_inputs(s);
  const auto peer = gather_outputs(plan, run_cp_peer(plan, in, DType::bf16).ranks);
  const auto oracle = gather_outputs(plan, run_cp_oracle(plan, in).ranks);
  double worst = 0;
  for (size_t i = 0; i < oracle.o.values.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(peer.o.values[i]) - oracle.o.values[i]));
  CHECK(worst > 0);      // bf16 rounding is visible
  CHECK(worst < 0.05);   // but small
  const ThdLayout l = layout(s);
  for (int64_t r = 0; r < l.q.total_rows; ++r)
    if (!l.q.is_valid_row(r))
      for (int h = 0; h < s.heads_q; ++h) CHECK(peer.o(r, h, 0) == 0.0f);
}

TEST_CASE("trace: forward partials merge to the output, dKV in flight ends at its owner") {
  CaseSpec s = base_case(CommType::p2p, 3, kMasks[0], 21);
  s.seqlens_q = {11, 6};
  const Plan plan = make_plan(s);
  const CpRun<double> run = run_cp_oracle(plan, make_case_inputs(s));
  CHECK(run.trace.forward.size() == 9);
  CHECK(run.trace.backward.size() == 9);
  // Rank 2's last backward step holds its own final dK (before rounding, which is the identity for the oracle).
  const auto& last = run.trace.backward.back();
  CHECK(last.rank == 2);
  CHECK(last.dk_in_flight.values == run.ranks[2].dk.values);
  // Upper-section partial of rank 0 at step 1 has t/2 rows.
  for (const auto& f : run.trace.forward)
    if (f.rank == 0 && f.step == 1) CHECK(f.o.rows == plan.partition.q.half_rows());
}

TEST_CASE("a wrong message schedule is detected") {
  CaseSpec s = base_case(CommType::p2p, 3, kMasks[0], 2);
  s.seqlens_q = {11, 6};
  Plan plan = make_plan(s);
  plan.forward.messages.erase(plan.forward.messages.begin());
  CHECK_THROWS_AS(run_cp_oracle(plan, make_case_inputs(s)), std::logic_error);
}

#include <omp.h>

TEST_CASE("CP peer: every comm type close to the oracle, bitwise identical for 1 and 2 threads") {
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p}) {
    CAPTURE(std::string(comm_name(comm)));
    CaseSpec s = base_case(comm, 4, kMasks[2], 17);
    s.seqlens_q = {19, 0, 33, 6};
    s.dtype = DType::fp16;
    const Plan plan = make_plan(s);
    const CaseInputs in = make_case_inputs(s);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const auto one = run_cp_peer(plan, in, DType::fp16);
    omp_set_num_threads(2);
    const auto two = run_cp_peer(plan, in, DType::fp16);
    omp_set_num_threads(threads);
    for (int r = 0; r < 4; ++r) {
      CHECK(one.ranks[r].o.values == two.ranks[r].o.values);
      CHECK(one.ranks[r].dq.values == two.ranks[r].dq.values);
      CHECK(one.ranks[r].dk.values == two.ranks[r].dk.values);
    }
    const auto peer = gather_outputs(plan, one.ranks);
    const auto oracle = gather_outputs(plan, run_cp_oracle(plan, in).ranks);
    double worst = 0;
    for (size_t i = 0; i < oracle.dk.values.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(peer.dk.values[i]) - oracle.dk.values[i]));
    CHECK(worst < 0.02);
    for (float x : peer.dv.values) CHECK(std::isfinite(x));
  }
}

TEST_CASE("W = 1 with tail rows, every comm type") {
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p}) {
    CAPTURE(std::string(comm_name(comm)));
    CaseSpec s = base_case(comm, 1, kMasks[0], 4);
    s.seqlens_q = {3, 0, 6};
    s.total_tokens_q = s.total_tokens_kv = 16;  // padded 4 + 0 + 6 = 10, then 6 tail rows
    check_case(s);
  }
}

TEST_CASE("W = 1, every comm type: causal and windowed cross attention (bottom-right, L_q != L_kv)") {
  // W = 1 allows L_q != L_kv under any mask. Keys visible to chunk c reach past the chunk's end by delta = L_kv - L_q:
  // all_gather once cut them at (c + 1) * C + wr, a wrong CP peer and budgets as large as the outputs.
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p})
    for (const MaskCase& m : kMasks) {
      CAPTURE(std::string(comm_name(comm)));
      CAPTURE(std::string(m.name));
      CaseSpec s = base_case(comm, 1, m, 6);
      s.seqlens_q = {4, 6, 0, 5};
      s.seqlens_kv = {9, 2, 3, 5};
      check_case(s);
      s.window = normalize_window(false, {-1, 0});  // causal by its window only
      s.causal = false;
      check_case(s);
    }
}

TEST_CASE("tail rows under CP are p2p only") {
  CaseSpec s = base_case(CommType::all_gather, 2, kMasks[0], 4);
  s.seqlens_q = {3, 6};
  s.total_tokens_q = 16;
  check_input_error([&] { make_plan(s); }, "total_tokens_q", {"16"});
}

// The program's optional paths (forward_rows, backward_sum over StepRows) are the GPU backend's; ExecutorOptions::by_rows
// runs them on the host, where they must give the default path's bits: the program hands over the right rows.
TEST_CASE("CP peer and oracle: the program's row-reading and summing paths give the default path's bits") {
  for (CommType comm : {CommType::p2p, CommType::a2a_p2p, CommType::a2a, CommType::all_gather})
    for (const MaskCase& m : kMasks)
      for (int W : {2, 4}) {
        if (comm == CommType::a2a_p2p && W != 4) continue;
        CAPTURE(std::string(comm_name(comm)));
        CAPTURE(std::string(m.name));
        CAPTURE(W);
        TestRng rng{static_cast<uint64_t>(W * 977 + static_cast<int>(comm) * 13)};
        CaseSpec s = base_case(comm, W, m, rng.next());
        s.seqlens_q = {3, 0, 4 * W + 1, 2 * W};
        s.padded_q = {2 * W, 2 * W, 6 * W, 2 * W};
        s.dtype = DType::bf16;
        const Plan plan = make_plan(s);
        const CaseInputs in = make_case_inputs(s);
        ExecutorOptions plain, by_rows;
        plain.record_trace = by_rows.record_trace = false;
        by_rows.by_rows = true;
        const auto a = run_cp_peer(plan, in, DType::bf16, plain);
        const auto b = run_cp_peer(plan, in, DType::bf16, by_rows);
        const auto c = run_cp_oracle(plan, in, plain);
        const auto d = run_cp_oracle(plan, in, by_rows);
        for (int r = 0; r < W; ++r) {
          CAPTURE(r);
          CHECK(a.ranks[r].o.values == b.ranks[r].o.values);
          CHECK(a.ranks[r].lse.values == b.ranks[r].lse.values);
          CHECK(a.ranks[r].dq.values == b.ranks[r].dq.values);
          CHECK(a.ranks[r].dk.values == b.ranks[r].dk.values);
          CHECK(a.ranks[r].dv.values == b.ranks[r].dv.values);
          CHECK(c.ranks[r].o.values == d.ranks[r].o.values);
          CHECK(c.ranks[r].dq.values == d.ranks[r].dq.values);
          CHECK(c.ranks[r].dk.values == d.ranks[r].dk.values);
          CHECK(c.ranks[r].dv.values == d.ranks[r].dv.values);
        }
      }
}
