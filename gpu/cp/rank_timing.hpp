#pragma once
// What one rank's run measures, as CpGpuOptions asks (gpu/cp/cp_options.hpp): with phases, every operation alone on
// the device, timed into PhaseTimes (exchanges outside the device lock); with timeline, every operation's span on its
// stream, without serialising; with time_exchanges or timeline, the run, its exchanges and the compute stream's waits
// for them (RankTimes). Without any of them, an operation is only launched.
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpu/cp/cp_options.hpp"
#include "gpu/cp/rank_streams.hpp"

namespace cpgold::gpu {

class RankTiming {
 public:
  RankTiming(const RankStreams& streams, const CpGpuOptions& options) : streams_(streams), options_(options) {}
  RankTiming(const RankTiming&) = delete;
  RankTiming& operator=(const RankTiming&) = delete;

  // Marks the start of a run on the compute stream (and forgets the previous run's spans).
  void begin_run();
  // The run's last event (RankStreams::join).
  void end_run(EventRef end) { run_end_ = std::move(end); }
  // Device time of the last run (after end_run and a synchronize; options.time_exchanges).
  RankTimes times() const;
  // Appends the last run's spans to options.timeline, in milliseconds from `ref` (null: this rank's run start).
  // After end_run and a synchronize, so that every event has completed. Nothing with phases (serialised).
  void collect_timeline(const EventRef& ref);
  // A timing event on the compute stream (the reference of a timeline).
  EventRef timing_event() const { return streams_.record(streams_.compute()); }

  // Whether exchanges and waits are bracketed by events (time_exchanges or timeline): then the exchange code records
  // them and hands them over here.
  bool spans() const { return streams_.timing(); }
  void exchange_span(EventRef begin, EventRef end) { comm_spans_.emplace_back(std::move(begin), std::move(end)); }
  void wait_span(EventRef begin, EventRef end) { wait_spans_.emplace_back(std::move(begin), std::move(end)); }

  // Runs `launch` (enqueues on `stream`, the compute stream by default); with options.phases, alone on the device and
  // timed into `phase`. With options.timeline (and no phases), only brackets it with events on its stream.
  template <class F>
  void timed(const char* phase, double bytes, F&& launch, cudaStream_t stream = nullptr) {
    if (stream == nullptr) stream = streams_.compute();
    if (!options_.phases) {
      if (!options_.timeline) return launch();
      const EventRef begin = streams_.record(stream);
      launch();
      op_spans_.push_back(
          {stream == streams_.accumulation() ? "accumulate" : "compute", phase, begin, streams_.record(stream)});
      return;
    }
    std::lock_guard<std::mutex> alone(device_lock());
    // Every stream drained (the exchanges' copies of all ranks included, which run outside the lock), so the
    // operation starts alone; a copy enqueued while it runs can still overlap it.
    phase_span(phase, bytes, stream, true, launch);
  }
  // Runs `exchange` (a send/recv enqueued on the communication stream); with options.phases, timed into "exchange",
  // rendezvous waits included. Not under the device lock: the send/recv waits for its peers, and a peer may be
  // waiting for that lock to run the operation before its own exchange (holding the lock here deadlocked every run of
  // W >= 2).
  template <class F>
  void timed_exchange(double bytes, F&& exchange) {
    if (!options_.phases) return exchange();
    phase_span("exchange", bytes, streams_.comm(), false, exchange);
  }

 private:
  // Events a and z around f() on `stream` (after a cudaDeviceSynchronize with drain), their time added to `phase`.
  template <class F>
  void phase_span(const char* phase, double bytes, cudaStream_t stream, bool drain, F&& f) {
    cudaEvent_t a = nullptr, z = nullptr;
    streams_.check(cudaEventCreate(&a), "cudaEventCreate");
    streams_.check(cudaEventCreate(&z), "cudaEventCreate");
    if (drain) streams_.check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    streams_.check(cudaEventRecord(a, stream), "cudaEventRecord");
    f();
    streams_.check(cudaEventRecord(z, stream), "cudaEventRecord");
    add_phase(phase, bytes, elapsed_ms(a, z));
  }
  // Waits for z, destroys both events, returns the time between them.
  float elapsed_ms(cudaEvent_t a, cudaEvent_t z);
  void add_phase(const char* phase, double bytes, float ms);
  static std::mutex& device_lock();

  const RankStreams& streams_;
  const CpGpuOptions& options_;
  EventRef run_begin_, run_end_;
  std::vector<std::pair<EventRef, EventRef>> comm_spans_, wait_spans_;
  struct OpSpan {
    const char* stream;
    std::string name;
    EventRef begin, end;
  };
  std::vector<OpSpan> op_spans_;  // options.timeline: every timed() operation of the run
};

}  // namespace cpgold::gpu
