#pragma once
// Timeline of a GPU CP run (CpGpuOptions::timeline): one span per backend operation on the stream it ran on, from
// CUDA events recorded around it without serialising anything (unlike PhaseTimes), so the spans show what ran beside
// what. A span covers the time its stream spent on the operation: from when the stream reached it to its end, waits
// for SMs or bandwidth taken by other streams included. Host code only: the summary and the Chrome trace are testable
// without a GPU.
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace cpgold::gpu {

struct TimelineSpan {
  int rank = 0;
  std::string stream;  // "compute", "accumulate", "exchange", "exchange wait" (the compute stream held by a wait)
  std::string name;    // the operation: "attention backward, lower", "scatter_add", "exchange", ...
  double begin_ms = 0, end_ms = 0;  // from the run's reference event
};

struct Timeline {
  std::mutex mutex;
  std::vector<TimelineSpan> spans;
};

// Device-wide view: for each stream kind, the time some rank's stream of that kind was busy (union of the spans over
// ranks), and for each pair of kinds the time both were busy at once.
struct TimelineSummary {
  double begin_ms = 0, end_ms = 0;  // first begin, last end
  std::map<std::string, double> busy_ms;
  std::map<std::pair<std::string, std::string>, double> overlap_ms;  // keys ordered (a < b)
};
TimelineSummary summarize(const std::vector<TimelineSpan>& spans);

// Chrome's Trace Event Format (chrome://tracing, Perfetto): one complete event ("ph": "X") per span, microseconds;
// pid = rank ("rank r"), tid = stream kind (named by metadata events, numbered in name order).
nlohmann::json chrome_trace(const std::vector<TimelineSpan>& spans);

}  // namespace cpgold::gpu
