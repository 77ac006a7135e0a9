// The timeline's host side (gpu/cp/timeline.hpp): device-wide busy time per stream kind, overlap of two kinds, and the
// Chrome trace. No GPU needed: the spans are coded by hand.
#include <doctest/doctest.h>

#include "gpu/cp/timeline.hpp"

using namespace cpgold::gpu;

TEST_CASE("timeline: busy time is the union over ranks, overlap the time two kinds are busy at once") {
  const std::vector<TimelineSpan> spans = {
      {0, "compute", "attention", 0.0, 2.0},
      {1, "compute", "attention", 1.0, 3.0},   // overlaps rank 0's: the union is [0, 3]
      {0, "accumulate", "scatter_add", 2.5, 4.0},
      {1, "accumulate", "scatter_add", 3.5, 3.5},  // empty: ignored
      {1, "exchange", "exchange", 10.0, 11.0},
  };
  const TimelineSummary s = summarize(spans);
  CHECK(s.begin_ms == 0.0);
  CHECK(s.end_ms == 11.0);
  CHECK(s.busy_ms.at("compute") == doctest::Approx(3.0));
  CHECK(s.busy_ms.at("accumulate") == doctest::Approx(1.5));
  CHECK(s.busy_ms.at("exchange") == doctest::Approx(1.0));
  REQUIRE(s.overlap_ms.size() == 3);
  CHECK(s.overlap_ms.at({"accumulate", "compute"}) == doctest::Approx(0.5));  // [2.5, 3]
  CHECK(s.overlap_ms.at({"accumulate", "exchange"}) == 0.0);
  CHECK(s.overlap_ms.at({"compute", "exchange"}) == 0.0);
}

TEST_CASE("timeline: overlap of many interleaved spans, and an empty timeline") {
  std::vector<TimelineSpan> spans;
  for (int i = 0; i < 10; ++i) {
    spans.push_back({i % 3, "compute", "a", 2.0 * i, 2.0 * i + 1.0});        // [0,1], [2,3], ...
    spans.push_back({i % 3, "accumulate", "b", 2.0 * i + 0.5, 2.0 * i + 2.25});  // crosses into the next gap
  }
  const TimelineSummary s = summarize(spans);
  CHECK(s.busy_ms.at("compute") == doctest::Approx(10.0));
  CHECK(s.busy_ms.at("accumulate") == doctest::Approx(17.5));  // each 1.75 long, overlapping the next by 0 (2.25 < 2.5)
  // Each accumulate span covers [2i + 0.5, 2i + 1] of compute span i and [2i + 2, 2i + 2.25] of span i + 1.
  CHECK(s.overlap_ms.at({"accumulate", "compute"}) == doctest::Approx(10 * 0.5 + 9 * 0.25));
  const TimelineSummary none = summarize({});
  CHECK(none.busy_ms.empty());
  CHECK(none.overlap_ms.empty());
}

TEST_CASE("timeline: the Chrome trace has one complete event per span, in microseconds, threads named by kind") {
  const std::vector<TimelineSpan> spans = {{0, "compute", "attention forward, diagonal", 0.25, 1.5},
                                           {1, "exchange", "exchange", 1.0, 2.0}};
  const nlohmann::json trace = chrome_trace(spans);
  int complete = 0, thread_names = 0, process_names = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") {
      ++complete;
      if (e.at("pid") == 0) {
        CHECK(e.at("name") == "attention forward, diagonal");
        CHECK(e.at("ts").get<double>() == doctest::Approx(250.0));
        CHECK(e.at("dur").get<double>() == doctest::Approx(1250.0));
        CHECK(e.at("tid") == 0);  // "compute" < "exchange"
      } else {
        CHECK(e.at("tid") == 1);
      }
    } else {
      CHECK(e.at("ph") == "M");
      thread_names += e.at("name") == "thread_name";
      process_names += e.at("name") == "process_name";
    }
  }
  CHECK(complete == 2);
  CHECK(process_names == 2);
  CHECK(thread_names == 4);  // 2 kinds named in each of the 2 ranks
}
