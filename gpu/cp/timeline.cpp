#include "gpu/cp/timeline.hpp"

#include <algorithm>
#include <limits>

namespace cpgold::gpu {

namespace {

using Intervals = std::vector<std::pair<double, double>>;

// Sorted, disjoint union of [begin, end) intervals (empty ones dropped).
Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& [b, e] : v) {
    if (e <= b) continue;
    if (!out.empty() && b <= out.back().second)
      out.back().second = std::max(out.back().second, e);
    else
      out.emplace_back(b, e);
  }
  return out;
}

double length(const Intervals& v) {
  double t = 0;
  for (const auto& [b, e] : v) t += e - b;
  return t;
}

// Length of the intersection of two sorted, disjoint unions.
double intersection(const Intervals& a, const Intervals& b) {
  double t = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) t += hi - lo;
    (a[i].second < b[j].second ? i : j)++;
  }
  return t;
}

}  // namespace

TimelineSummary summarize(const std::vector<TimelineSpan>& spans) {
  TimelineSummary s;
  if (spans.empty()) return s;
  s.begin_ms = std::numeric_limits<double>::infinity();
  s.end_ms = -std::numeric_limits<double>::infinity();
  std::map<std::string, Intervals> by_kind;
  for (const TimelineSpan& x : spans) {
    by_kind[x.stream].emplace_back(x.begin_ms, x.end_ms);
    s.begin_ms = std::min(s.begin_ms, x.begin_ms);
    s.end_ms = std::max(s.end_ms, x.end_ms);
  }
  for (auto& [kind, v] : by_kind) v = merged(std::move(v));
  for (const auto& [kind, v] : by_kind) s.busy_ms[kind] = length(v);
  for (auto a = by_kind.begin(); a != by_kind.end(); ++a)
    for (auto b = std::next(a); b != by_kind.end(); ++b)
      s.overlap_ms[{a->first, b->first}] = intersection(a->second, b->second);
  return s;
}

nlohmann::json chrome_trace(const std::vector<TimelineSpan>& spans) {
  std::map<std::string, int> tids;  // stream kind -> thread id, in name order
  std::map<int, int> ranks;
  for (const TimelineSpan& x : spans) {
    tids.emplace(x.stream, 0);
    ranks.emplace(x.rank, 0);
  }
  int next = 0;
  for (auto& [kind, tid] : tids) tid = next++;
  nlohmann::json events = nlohmann::json::array();
  for (const auto& [rank, unused] : ranks) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank},
                      {"args", {{"name", "rank " + std::to_string(rank)}}}});
    for (const auto& [kind, tid] : tids)
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tid}, {"args", {{"name", kind}}}});
  }
  for (const TimelineSpan& x : spans)
    events.push_back({{"name", x.name},
                      {"ph", "X"},
                      {"ts", x.begin_ms * 1e3},
                      {"dur", std::max(0.0, x.end_ms - x.begin_ms) * 1e3},
                      {"pid", x.rank},
                      {"tid", tids.at(x.stream)}});
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace cpgold::gpu
