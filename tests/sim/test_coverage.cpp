// Coverage check of plans on random layouts, and mutations it must catch.
#include <doctest/doctest.h>

#include "cp_check.hpp"
#include "sim/plan/coverage.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::sim::testing;

namespace {
CaseSpec random_case(TestRng& rng, CommType comm, int W, bool causal, Window w) {
  CaseSpec s;
  s.comm = comm;
  s.cp_size = W;
  s.causal = causal;
  s.window = normalize_window(causal, w);
  s.heads_q = comm == CommType::a2a ? W : 2;
  s.heads_kv = s.heads_q;
  s.a2a_size = 2;
  s.seqlens_q = random_lengths(rng, W, 4, 8 * W);
  return s;
}

CaseSpec causal_case() {
  CaseSpec s;
  s.seqlens_q = {5, 13, 0, 9};
  s.causal = true;
  s.window = normalize_window(true, {});
  s.cp_size = 2;
  s.heads_q = 1;
  return s;
}
}  // namespace

TEST_CASE("coverage: every allowed pair exactly once, random layouts, every comm type and mask") {
  TestRng rng{42};
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p})
    for (int W : {1, 2, 3, 4})
      for (int m = 0; m < 4; ++m) {
        if (comm == CommType::a2a_p2p && W % 2 != 0) continue;
        const bool causal = m == 0 || m == 2;
        const Window w = m == 2 ? Window{4, 0} : (m == 3 ? Window{3, 2} : Window{});
        for (int rep = 0; rep < 3; ++rep) {
          const CaseSpec s = random_case(rng, comm, W, causal, w);
          CAPTURE(normalized_json(s));
          const Plan plan = make_plan(s);
          for (PassKind pass : {PassKind::forward, PassKind::backward}) {
            const CoverageReport r = check_coverage(plan, pass);
            CAPTURE(r.first_problem);
            CHECK(r.ok());
            CHECK(r.covered_once == r.allowed_pairs);
          }
        }
      }
}

TEST_CASE("mutation: per-rank counts from cu // W are caught") {
  const CaseSpec s = causal_case();
  Plan plan = make_plan(s);
  const SidePartition& q = plan.partition.q;
  // Rebuild rank-local Q segments of the diagonal tiles from the shortcut counts, as a pad_between_seqs=False stack.
  const std::vector<int32_t> cu = q.cu_seqlens_shortcut(true, true);
  for (Tile& t : plan.forward.tiles) {
    if (t.q_half != HalfSelect::full) continue;
    for (size_t b = 0; b < t.call.sequences.size(); ++b) {
      const int32_t n = cu[b + 1] - cu[b], c = q.chunk_size(static_cast<int>(b));
      const int64_t start = q.global().cu_seqlens_padded[b] / 2;
      auto& seg = t.call.sequences[b].q;
      seg.clear();
      if (std::min(n, c) > 0) seg.push_back({start, std::min(n, c), t.rank * c});
      if (n > c) seg.push_back({start + c, n - c, (3 - t.rank) * c});
    }
  }
  const CoverageReport r = check_coverage(plan, PassKind::forward);
  CHECK_FALSE(r.ok());
  CHECK(r.missing + r.extra > 0);
}

TEST_CASE("mutation: swapped chunk order is caught") {
  Plan plan = make_plan(causal_case());
  // Rank 1 believes it holds chunk 2W-1-r first: positions of its two Q segments swapped.
  for (Tile& t : plan.forward.tiles) {
    if (t.rank != 1 || t.q_half != HalfSelect::full) continue;
    for (SequenceTile& seq : t.call.sequences)
      if (seq.q.size() == 2) std::swap(seq.q[0].position, seq.q[1].position);
  }
  const CoverageReport r = check_coverage(plan, PassKind::forward);
  CHECK_FALSE(r.ok());
}

TEST_CASE("mutation: a dropped step is caught") {
  Plan plan = make_plan(causal_case());
  plan.forward.tiles[1].computed = false;  // rank 0, step 1
  const CoverageReport r = check_coverage(plan, PassKind::forward);
  CHECK_FALSE(r.ok());
  CHECK(r.missing > 0);
  CHECK(r.extra == 0);
}

TEST_CASE("mutation: a window off by one is caught") {
  CaseSpec s = causal_case();
  s.window = normalize_window(true, {3, 0});
  s.causal = true;
  for (int delta : {-1, +1}) {
    Plan plan = make_plan(s);
    plan.forward.tiles[2].call.window.left += delta;  // rank 1, step 0
    const CoverageReport r = check_coverage(plan, PassKind::forward);
    CAPTURE(delta);
    CHECK_FALSE(r.ok());
  }
}

TEST_CASE("coverage of all_gather with a non-causal window wr > 0 (the §5 case) is exact") {
  CaseSpec s;
  s.seqlens_q = {5, 13, 2, 11};
  s.window = {3, 5};
  s.cp_size = 3;
  s.comm = CommType::all_gather;
  const Plan plan = make_plan(s);
  CHECK(check_coverage(plan, PassKind::forward).ok());
}
