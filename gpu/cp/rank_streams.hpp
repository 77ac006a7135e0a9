#pragma once
// The CUDA streams of one rank of the GPU CP executor and the events that order them. Three streams per rank:
// attention, copies and merges run on the compute stream; exchanges run on the communicator's stream; with
// CpGpuOptions::accumulate_aside the float32 accumulation of the backward partials (scatter_add) runs on the
// accumulation stream, otherwise on the compute stream. An exchange starts on the communication stream once the
// compute stream has passed what was enqueued before it (the sent tensors' producers, the receive buffers'
// allocation); the compute stream waits for the exchange only where the program finishes it, so what the program
// enqueues in between overlaps it (gpu/cp/rank_exchange.hpp). An accumulation starts once the compute stream has
// produced its partial; the compute and communication streams wait for it only where they touch its accumulator
// (DeviceMemory::side_use, gpu/cp/device_tensor.hpp), so step i's memory-bound accumulation runs beside step i + 1's
// compute-bound attention. Every tensor is allocated on the compute stream and freed on it, or on the accumulation
// stream where that stream used it last, only after the exchanges that used it have finished.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

namespace cpgold::gpu {

// A CUDA event, destroyed when the last holder lets go (a recorded event may be destroyed before it completes).
struct Event {
  cudaEvent_t event = nullptr;
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (event) cudaEventDestroy(event);
  }
};
using EventRef = std::shared_ptr<Event>;

class RankStreams {
 public:
  // Creates the compute and accumulation streams; `comm` is the communicator's stream. timing: events can be timed
  // (CpGpuOptions::time_exchanges or timeline); otherwise they only order streams.
  RankStreams(int rank, cudaStream_t comm, bool timing);
  RankStreams(const RankStreams&) = delete;
  RankStreams& operator=(const RankStreams&) = delete;

  int rank() const { return rank_; }
  cudaStream_t compute() const { return compute_.stream; }
  cudaStream_t accumulation() const { return accumulation_.stream; }
  cudaStream_t comm() const { return comm_; }
  bool timing() const { return timing_; }

  // A fresh event recorded on `stream`.
  EventRef record(cudaStream_t stream) const;
  // Milliseconds from a to b (both recorded with timing and completed).
  double elapsed(const EventRef& a, const EventRef& b) const;
  // The end of a run: the compute stream waits for the accumulation stream and records the run's last event, which
  // the communication stream waits for, so that the communicator's synchronize() (bounded, watching the peers)
  // covers the whole run. Returns that event.
  EventRef join() const;
  // Throws std::runtime_error "rank R <what>: <CUDA error>" unless e is cudaSuccess.
  void check(cudaError_t e, const char* what) const;
  // "rank R": how errors name the rank.
  std::string who() const { return "rank " + std::to_string(rank_); }

 private:
  // A stream of the rank's own: created with it, destroyed after every tensor freed on it (members of the backend
  // that holds this object are destroyed first).
  struct OwnStream {
    cudaStream_t stream = nullptr;
    // priority: 0 = the default, 1 = the device's highest (its blocks are dispatched before waiting default ones).
    explicit OwnStream(int priority);
    OwnStream(const OwnStream&) = delete;
    OwnStream& operator=(const OwnStream&) = delete;
    ~OwnStream();
  };

  OwnStream compute_{0};
  OwnStream accumulation_{1};  // at the highest priority
  int rank_;
  cudaStream_t comm_;
  bool timing_;
};

}  // namespace cpgold::gpu
