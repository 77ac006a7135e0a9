// RankStreams: the rank's own streams, events and CUDA error reports (see the header).
#include "gpu/cp/rank_streams.hpp"

#include <stdexcept>
#include <string>

namespace cpgold::gpu {

RankStreams::OwnStream::OwnStream(int priority) {
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (const cudaError_t e = cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority ? greatest : 0);
      e != cudaSuccess)
    throw std::runtime_error(std::string("cudaStreamCreate (rank stream): ") + cudaGetErrorString(e));
}

RankStreams::OwnStream::~OwnStream() {
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
}

RankStreams::RankStreams(int rank, cudaStream_t comm, bool timing) : rank_(rank), comm_(comm), timing_(timing) {}

EventRef RankStreams::record(cudaStream_t stream) const {
  auto ev = std::make_shared<Event>();
  check(cudaEventCreateWithFlags(&ev->event, timing_ ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventRecord(ev->event, stream), "cudaEventRecord");
  return ev;
}

double RankStreams::elapsed(const EventRef& a, const EventRef& b) const {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a->event, b->event), "cudaEventElapsedTime");
  return ms;
}

EventRef RankStreams::join() const {
  check(cudaStreamWaitEvent(compute(), record(accumulation())->event, 0), "cudaStreamWaitEvent (join)");
  EventRef end = record(compute());
  check(cudaStreamWaitEvent(comm_, end->event, 0), "cudaStreamWaitEvent (join)");
  return end;
}

void RankStreams::check(cudaError_t e, const char* what) const {
  if (e != cudaSuccess) throw std::runtime_error(who() + " " + what + ": " + cudaGetErrorString(e));
}

}  // namespace cpgold::gpu
