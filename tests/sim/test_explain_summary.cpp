// The large-layout explain summary agrees with the full plan's work table on small cases of every comm type, and
// answers for 10,000 sequences at W = 64 without building a plan.
#include <doctest/doctest.h>

#include <chrono>

#include "sim/case/case_spec.hpp"
#include "sim/explain/explain.hpp"
#include "sim/explain/explain_summary.hpp"
#include "sim/plan/plan.hpp"

using namespace cpgold;
using namespace cpgold::sim;

TEST_CASE("explain summary: per-rank work equals the plan's forward work table, every comm, mask and window") {
  const char* cases[] = {
      R"({"seqlens_q":[37,5,64],"heads_q":4,"cp_size":4,"comm":"p2p","mask":"causal"})",
      R"({"seqlens_q":[37,5,64],"heads_q":4,"cp_size":4,"comm":"p2p"})",
      R"({"seqlens_q":[37,5],"seqlens_kv":[20,9],"heads_q":4,"cp_size":2,"comm":"p2p"})",
      R"({"seqlens_q":[37,5,64],"heads_q":4,"cp_size":4,"comm":"a2a","mask":"causal"})",
      R"({"seqlens_q":[37,5,64],"heads_q":4,"cp_size":4,"comm":"all_gather","mask":"causal","window":[7,0]})",
      R"({"seqlens_q":[37,5,64],"heads_q":4,"cp_size":4,"comm":"a2a+p2p","a2a_size":2,"mask":"causal"})",
      R"({"seqlens_q":[203],"heads_q":2,"cp_size":4,"comm":"p2p","mask":"causal","window":[16,0]})",
      R"({"seqlens_q":[113,1],"seqlens_kv":[70,9],"heads_q":2,"window":[8,8],"cp_size":1})",
  };
  for (const char* text : cases) {
    CAPTURE(text);
    const CaseSpec spec = parse_case_text(text);
    const Plan plan = make_plan(spec);
    const auto full = explain_json(spec, plan);
    const LayoutSummary summary = summarize_layout(spec);
    REQUIRE(summary.ranks.size() == static_cast<size_t>(spec.cp_size));
    int64_t total = 0;
    for (int r = 0; r < spec.cp_size; ++r) {
      CHECK(summary.ranks[static_cast<size_t>(r)].work == full["work"]["per_rank"][r].get<int64_t>());
      CHECK(summary.ranks[static_cast<size_t>(r)].q_rows == plan.partition.q.local_rows());
      total += summary.ranks[static_cast<size_t>(r)].work;
    }
    CHECK(total > 0);
    CHECK(summary.imbalance == doctest::Approx(full["work"]["imbalance"].get<double>()));
  }
}

TEST_CASE("explain summary: 10,000 sequences (1M tokens) at W = 64 in seconds, with the first and worst sequences") {
  CaseSpec spec;
  spec.seqlens_q.assign(10000, 100);
  spec.seqlens_q[7] = 3;  // one short sequence: most of its rows are padding, so few ranks get work
  spec.causal = true;
  spec.cp_size = 64;
  validate_case(spec);
  CHECK(plan_units(spec) > kSummaryPlanUnits);
  const auto start = std::chrono::steady_clock::now();
  const LayoutSummary summary = summarize_layout(spec);
  const std::string text = summary_text(spec, summary);
  const std::string svg = summary_svg(spec, summary);
  const auto json = summary_json(spec, summary);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 10);
  CHECK(summary.first.size() == 3);
  CHECK(summary.first[0].sequence == 0);
  REQUIRE(summary.worst.size() == 3);
  CHECK(summary.worst[0].sequence == 7);
  CHECK(text.size() < 100000);
  CHECK(svg.size() < 200000);
  CHECK(json["per_rank"].size() == 64);
  CHECK(summary.tokens_q == 10000 * 100 - 97);
}
