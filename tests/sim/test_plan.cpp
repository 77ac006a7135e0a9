// The worked example of docs/cp-layout.md as per-step metadata of the Plan, and plan structure checks.
#include <doctest/doctest.h>

#include "sim/plan/plan.hpp"
#include "tests/reference/input_error_check.hpp"
#include "tests/sim/row_segments.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::testing;
using namespace cpgold::sim::testing;

namespace {
using V = std::vector<int32_t>;

CaseSpec worked_example(CommType comm) {
  CaseSpec s;
  s.seqlens_q = {5, 8};
  s.padded_q = {8, 8};
  s.causal = true;
  s.window = normalize_window(true, {});
  s.cp_size = 2;
  s.comm = comm;
  s.heads_q = 2;
  return s;
}
}  // namespace

TEST_CASE("p2p forward of the worked example (§2.4)") {
  const Plan plan = make_plan(worked_example(CommType::p2p));
  REQUIRE(plan.forward.steps == 2);
  // Step 0: diagonal on both ranks with exact counts and cuP/W offsets.
  const Tile& d0 = plan.forward.tile(0, 0);
  CHECK(d0.section == StepSection::diagonal);
  CHECK(d0.kv_owner == 0);
  CHECK(d0.te.cu_seqlens_q == V{0, 2, 6});
  CHECK(d0.te.cu_seqlens_kv == V{0, 2, 6});
  CHECK(d0.te.cu_seqlens_q_padded == V{0, 4, 8});
  CHECK(d0.te.mask == "padding_causal");
  CHECK(plan.forward.tile(1, 0).te.cu_seqlens_q == V{0, 3, 7});
  // Rank 1, step 1: lower, o = 0; Q cu [0,3,7] at [0,4,8]; KV = read_half(chunk 0 of rank 0) cu [0,2,4] at [0,2,4].
  const Tile& lower = plan.forward.tile(1, 1);
  CHECK(lower.section == StepSection::lower);
  CHECK(lower.kv_owner == 0);
  CHECK(lower.q_half == HalfSelect::full);
  CHECK(lower.kv_half == HalfSelect::first);
  CHECK(lower.te.cu_seqlens_q == V{0, 3, 7});
  CHECK(lower.te.cu_seqlens_q_padded == V{0, 4, 8});
  CHECK(lower.te.cu_seqlens_kv == V{0, 2, 4});
  CHECK(lower.te.cu_seqlens_kv_padded == V{0, 2, 4});
  CHECK(lower.te.mask == "padding");
  // max_seqlen: DPA's 64 becomes 32 (/W) for full tensors and 16 for halves.
  CHECK(lower.te.max_seqlen_q == 32);
  CHECK(lower.te.max_seqlen_kv == 16);
  CHECK(lower.te.max_seqlen_q_exact == 4);
  CHECK(lower.te.max_seqlen_kv_exact == 2);
  // Rank 0, step 1: upper, o = 1; Q = read_half(chunk 3) cu [0,0,2] at [0,2,4]; KV cu [0,3,7] at [0,4,8].
  const Tile& upper = plan.forward.tile(0, 1);
  CHECK(upper.section == StepSection::upper);
  CHECK(upper.kv_owner == 1);
  CHECK(upper.q_half == HalfSelect::second);
  CHECK(upper.te.cu_seqlens_q == V{0, 0, 2});
  CHECK(upper.te.cu_seqlens_q_padded == V{0, 2, 4});
  CHECK(upper.te.cu_seqlens_kv == V{0, 3, 7});
  CHECK(upper.te.cu_seqlens_kv_padded == V{0, 4, 8});
  CHECK(upper.te.max_seqlen_q == 16);
  CHECK(upper.te.max_seqlen_kv == 32);
  // The position-aware call of the upper tile: sequence 1 Q = chunk 3 (positions 6, 7) at half row 2;
  // KV of rank 1 = chunks 1 and 2: sequence 0 positions 2..4 (3 valid), sequence 1 positions 2..5.
  REQUIRE(upper.call.sequences.size() == 2);
  check_segments(upper.call.sequences[0].q, {});
  check_segments(upper.call.sequences[1].q, {{2, 2, 6}});
  check_segments(upper.call.sequences[0].kv, {{0, 2, 2}, {2, 1, 4}});
  check_segments(upper.call.sequences[1].kv, {{4, 2, 2}, {6, 2, 4}});
  // Messages: after step 0, each rank sends its KV to the next rank.
  REQUIRE(plan.forward.messages.size() == 2);
  CHECK(plan.forward.messages[0].from_rank == 0);
  CHECK(plan.forward.messages[0].to_rank == 1);
  CHECK(plan.forward.messages[0].shard_owner == 0);
  CHECK(plan.forward.messages[0].after_step == 0);
}

TEST_CASE("p2p backward replays the forward in reverse with dKV travelling") {
  CaseSpec s = worked_example(CommType::p2p);
  s.cp_size = 4;
  s.padded_q = {8, 8};
  const Plan plan = make_plan(s);
  const int W = 4;
  for (int r = 0; r < W; ++r)
    for (int i = 0; i < W; ++i) {
      const Tile& b = plan.backward.tile(r, i);
      CHECK(b.kv_owner == (r + 1 + i) % W);
      const StepSection want = i == W - 1 ? StepSection::diagonal : (i >= W - r - 1 ? StepSection::lower : StepSection::upper);
      CHECK(b.section == want);
      const Tile& f = plan.forward.tile(r, W - 1 - i);
      CHECK(f.kv_owner == b.kv_owner);
      CHECK(f.te.cu_seqlens_q == b.te.cu_seqlens_q);
      CHECK(f.te.cu_seqlens_kv == b.te.cu_seqlens_kv);
    }
  int dkv = 0;
  for (const Message& m : plan.backward.messages) {
    CHECK(m.to_rank == (m.from_rank + W - 1) % W);
    if (m.payload == Payload::dkv) ++dkv;
  }
  CHECK(dkv == W * (W - 1));
}

TEST_CASE("all_gather of the worked example (§2.4)") {
  const Plan plan = make_plan(worked_example(CommType::all_gather));
  const Tile& s0 = plan.forward.tile(1, 0);
  const Tile& s1 = plan.forward.tile(1, 1);
  CHECK(s0.te.cu_seqlens_q_padded == V{0, 4, 8});
  CHECK(s1.te.cu_seqlens_q_padded == V{2, 6, 8});
  CHECK(s0.te.cu_seqlens_q == V{0, 2, 4});
  CHECK(s1.te.cu_seqlens_q == V{0, 1, 3});
  CHECK(s0.te.cu_seqlens_kv == V{0, 4, 8});
  CHECK(s1.te.cu_seqlens_kv == V{0, 5, 11});
  CHECK(s0.te.cu_seqlens_kv_padded == V{0, 8, 16});
  CHECK(s1.te.max_seqlen_q == 16);
  CHECK(s0.te.mask == "padding_causal_bottom_right");
  CHECK(s1.te.window == Window{-1, 0});
  // Query row 0 of step 1, sequence 0 is global position 4 and sees keys 0..4 (bottom-right: 5 - 1 = 4).
  const SequenceTile& seq0 = s1.call.sequences[0];
  REQUIRE(seq0.q.size() == 1);
  CHECK(seq0.q[0].position == 4);
  CHECK(seq0.q[0].first_row == 2);
  int visible_keys = 0;
  for (const RowSegment& k : seq0.kv)
    for (int j = 0; j < k.count; ++j) visible_keys += visible(s1.call.window, seq0.q[0].position, k.position + j, seq0.delta());
  CHECK(visible_keys == 5);
}

TEST_CASE("a2a plan: head groups, one step, exchanges") {
  CaseSpec s = worked_example(CommType::a2a);
  s.heads_q = 4;
  s.heads_kv = 2;
  const Plan plan = make_plan(s);
  CHECK(plan.forward.steps == 1);
  CHECK(plan.forward.tile(1, 0).head_begin == 2);
  CHECK(plan.forward.tile(1, 0).kv_head_begin == 1);
  CHECK(plan.forward.tile(1, 0).te.cu_seqlens_q == V{0, 5, 13});
  CHECK(plan.forward.tile(1, 0).te.max_seqlen_q == 64);
  s.heads_q = 6;
  s.heads_kv = 3;
  s.cp_size = 4;
  check_input_error([&] { make_plan(s); }, "heads_q", {"value 6"});
}

TEST_CASE("a2a+p2p plan: consecutive a2a groups, ring over groups") {
  CaseSpec s = worked_example(CommType::a2a_p2p);
  s.cp_size = 4;
  s.a2a_size = 2;
  s.seqlens_q = {5, 16};
  s.padded_q = {8, 16};
  s.heads_q = 4;
  const Plan plan = make_plan(s);
  CHECK(plan.p2p_size == 2);
  CHECK(plan.forward.steps == 2);
  // Rank 3 = p2p rank 1, a2a index 1: at step 1 it reads the KV of p2p rank 0 with the same a2a index: rank 1.
  CHECK(plan.forward.tile(3, 1).kv_owner == 1);
  CHECK(plan.forward.tile(3, 1).head_begin == 2);
  CHECK(plan.forward.tile(3, 1).section == StepSection::lower);
  // Ring counts use the P-way partition (cuP / 2): p2p rank 1 holds P-chunks 1 and 2 (sizes 2 and 4).
  CHECK(plan.forward.tile(3, 0).te.cu_seqlens_q == V{0, 3, 11});
  for (const Message& m : plan.forward.messages)
    if (m.payload == Payload::kv) CHECK(m.to_rank % 2 == m.from_rank % 2);
}

TEST_CASE("windowed p2p skips empty tiles") {
  CaseSpec s;
  s.seqlens_q = {32};
  s.causal = true;
  s.window = normalize_window(true, {2, 0});
  s.cp_size = 4;
  const Plan plan = make_plan(s);
  int skipped = 0;
  for (const Tile& t : plan.forward.tiles) skipped += !t.computed;
  CHECK(skipped > 0);
  // C = 4, window 2: rank 3 (chunks 3, 4) needs rank 2's chunk 2 (positions 8..11) only for position 12, 13.
  const Tile& t = plan.forward.tile(3, 1);
  CHECK(t.kv_owner == 2);
  CHECK(t.computed);
  CHECK(t.kv_half == HalfSelect::first);
  CHECK(t.q_half == HalfSelect::first);
}

#include "sim/plan/coverage.hpp"
#include "sim/explain/explain.hpp"

TEST_CASE("explain: stable JSON keys, work equals the allowed pairs, shortcut warnings") {
  const CaseSpec s = worked_example(CommType::p2p);
  const Plan plan = make_plan(s);
  const auto j = explain_json(s, plan);
  for (const char* key : {"case", "comm", "cp_size", "a2a_size", "p2p_size", "window", "chunk_map", "passes", "work", "warnings"})
    CHECK(j.contains(key));
  const auto& tile = j["passes"]["forward"]["tiles"][1];  // rank 0, step 1
  CHECK(tile["section"] == "upper");
  CHECK(tile["cu_seqlens_q"] == nlohmann::json::array({0, 0, 2}));
  CHECK(tile["cu_seqlens_q_padded"] == nlohmann::json::array({0, 2, 4}));
  CHECK(tile["q_input"] == "second_half");
  CHECK(j["chunk_map"]["q"][0]["chunks"][1]["valid"] == 0);  // sequence 0, chunk 3 of rank 0 is all padding
  // Total work equals the pairs the causal mask allows (5*6/2 + 8*9/2 = 51) times the 2 heads.
  int64_t total = 0;
  for (const auto& x : j["work"]["per_rank"]) total += x.get<int64_t>();
  CHECK(total == 102);
  CHECK(total == check_coverage(plan, PassKind::forward).allowed_pairs);
  // cu // W gives [0,2,6] for rank 1 but the exact counts are [0,3,7]: warned.
  bool found = false;
  for (const std::string& w : shortcut_count_warnings(plan))
    found = found || (w.find("rank 1") != std::string::npos && w.find("[0,3,7]") != std::string::npos);
  CHECK(found);
  // No padding: no warnings.
  CaseSpec even = s;
  even.seqlens_q = {8, 8};
  CHECK(shortcut_count_warnings(make_plan(even)).empty());
  CHECK(explain_svg(s, plan).find("<svg") == 0);
}

TEST_CASE("every tile's AttentionCall agrees with its TransformerEngine metadata") {
  // seqused = per-step counts; a segment's first row = the padded offset of its sequence in the step tensor.
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p})
    for (bool causal : {true, false}) {
      CaseSpec s;
      s.seqlens_q = {5, 13, 0, 9, 1};
      s.cp_size = 4;
      s.comm = comm;
      s.causal = causal;
      s.window = normalize_window(causal, {});
      s.heads_q = 4;
      s.a2a_size = 2;
      const Plan plan = make_plan(s);
      for (const PassPlan* pass : {&plan.forward, &plan.backward})
        for (const Tile& t : pass->tiles)
          for (size_t b = 0; b < t.call.sequences.size(); ++b) {
            CAPTURE(std::string(comm_name(comm)));
            CAPTURE(t.rank);
            CAPTURE(t.step);
            CAPTURE(b);
            const SequenceTile& seq = t.call.sequences[b];
            int32_t nq = 0, nk = 0;
            for (const RowSegment& x : seq.q) nq += x.count;
            for (const RowSegment& x : seq.kv) nk += x.count;
            CHECK(nq == t.te.cu_seqlens_q[b + 1] - t.te.cu_seqlens_q[b]);
            if (!seq.q.empty()) CHECK(seq.q[0].first_row == t.te.cu_seqlens_q_padded[b]);
            if (!seq.kv.empty()) CHECK(seq.kv[0].first_row == t.te.cu_seqlens_kv_padded[b]);
            if (comm != CommType::all_gather) CHECK(nk == t.te.cu_seqlens_kv[b + 1] - t.te.cu_seqlens_kv[b]);
            else if (nq > 0) CHECK(nk == t.te.cu_seqlens_kv[b + 1] - t.te.cu_seqlens_kv[b]);  // TE's count is exact here
          }
    }
}
