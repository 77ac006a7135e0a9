// RankTiming: the run's events, the phase table and the timeline of one rank (see the header).
#include "gpu/cp/rank_timing.hpp"

namespace cpgold::gpu {

void RankTiming::begin_run() {
  comm_spans_.clear();
  wait_spans_.clear();
  op_spans_.clear();
  run_begin_ = streams_.record(streams_.compute());
}

RankTimes RankTiming::times() const {
  RankTimes t;
  if (!options_.time_exchanges || !run_begin_ || !run_end_) return t;
  t.run_ms = streams_.elapsed(run_begin_, run_end_);
  for (const auto& [a, b] : comm_spans_) t.comm_ms += streams_.elapsed(a, b);
  for (const auto& [a, b] : wait_spans_) t.exposed_ms += streams_.elapsed(a, b);
  t.exchanges = static_cast<int>(comm_spans_.size());
  return t;
}

void RankTiming::collect_timeline(const EventRef& ref) {
  if (!options_.timeline || options_.phases) return;
  const EventRef& zero = ref ? ref : run_begin_;
  const int rank = streams_.rank();
  std::vector<TimelineSpan> out;
  for (const OpSpan& x : op_spans_)
    out.push_back({rank, x.stream, x.name, streams_.elapsed(zero, x.begin), streams_.elapsed(zero, x.end)});
  for (const auto& [a, b] : comm_spans_)
    out.push_back({rank, "exchange", "exchange", streams_.elapsed(zero, a), streams_.elapsed(zero, b)});
  for (const auto& [a, b] : wait_spans_)
    out.push_back({rank, "exchange wait", "wait for exchange", streams_.elapsed(zero, a), streams_.elapsed(zero, b)});
  op_spans_.clear();
  std::lock_guard<std::mutex> lock(options_.timeline->mutex);
  for (TimelineSpan& x : out) options_.timeline->spans.push_back(std::move(x));
}

float RankTiming::elapsed_ms(cudaEvent_t a, cudaEvent_t z) {
  streams_.check(cudaEventSynchronize(z), "cudaEventSynchronize");
  float ms = 0;
  streams_.check(cudaEventElapsedTime(&ms, a, z), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(z);
  return ms;
}

void RankTiming::add_phase(const char* phase, double bytes, float ms) {
  std::lock_guard<std::mutex> lock(options_.phases->mutex);
  PhaseTimes::Entry& e = options_.phases->phases[phase];
  e.ms += ms;
  e.bytes += bytes;
  ++e.calls;
}

std::mutex& RankTiming::device_lock() {
  static std::mutex m;
  return m;
}

}  // namespace cpgold::gpu
