// DeviceRankBackend: the device backend of the per-rank CP program, composed of the rank's parts (see the header).
#include "gpu/cp/device_rank_backend.hpp"

#include <stdexcept>
#include <string>
#include <utility>

namespace cpgold::gpu {

namespace {

// sim's messages of this backend -> the exchange's transfers (the same peer and buffer).
template <class Message>
std::vector<RankExchange::Transfer> transfers(const std::vector<Message>& messages) {
  std::vector<RankExchange::Transfer> out;
  out.reserve(messages.size());
  for (const Message& m : messages) out.push_back({m.peer, m.tensor, m.lse});
  return out;
}

}  // namespace

DeviceRankBackend::DeviceRankBackend(int rank, Communicator& comm, DType dtype, const CpGpuOptions& options)
    : streams_(rank, static_cast<cudaStream_t>(comm.stream()), options.time_exchanges || options.timeline != nullptr),
      options_(options), dtype_(dtype), storage_(storage_elem(dtype)), timing_(streams_, options_),
      memory_(streams_, timing_), rows_(streams_, timing_, memory_, storage_, options_.accumulate_aside),
      attention_(streams_, timing_, memory_, rows_, dtype_, storage_, options_),
      exchange_(comm, streams_, timing_, memory_) {}

void DeviceRankBackend::upload_input(sim::Payload payload, const Tensor3<float>& x) {
  inputs_[static_cast<int>(payload)] = memory_.upload(x, dtype_, storage_);
}

const DeviceTensor& DeviceRankBackend::input(sim::Payload payload) const {
  auto it = inputs_.find(static_cast<int>(payload));
  if (it == inputs_.end())
    throw std::logic_error(streams_.who() + ": no input " + std::string(sim::payload_name(payload)));
  return it->second;
}

DeviceTensor DeviceRankBackend::zeros(int64_t rows, int64_t heads, int64_t dim, sim::BufferKind kind) {
  return memory_.zeros(rows, heads, dim, kind == sim::BufferKind::storage ? storage_ : Elem::f32);
}

void DeviceRankBackend::merge_forward(const std::vector<sim::MergePart<DeviceRankBackend>>& parts, Tensor& o,
                                      Lse& lse) {
  std::vector<RankRowOps::Partial> partials;
  partials.reserve(parts.size());
  for (const auto& part : parts) partials.push_back({part.o, part.lse, &part.rows});
  rows_.merge_forward(partials, o, lse);
}

DeviceRankBackend::Pending DeviceRankBackend::exchange_start(
    const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
    const std::vector<sim::Incoming<DeviceRankBackend>>& recvs) {
  return exchange_.start(transfers(sends), transfers(recvs));
}

void DeviceRankBackend::exchange(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                                 const std::vector<sim::Incoming<DeviceRankBackend>>& recvs) {
  Pending p = exchange_start(sends, recvs);
  exchange_finish(p);
}

void DeviceRankBackend::record_forward(int step, const Forward& res) {
  if (options_.record_trace) trace.forward.push_back({rank(), step, to_host(res.o), to_host(res.lse)});
}

void DeviceRankBackend::record_backward(int step, Backward&& res, const Tensor* dk_in_flight,
                                        const Tensor* dv_in_flight) {
  if (!options_.record_trace) return;
  sim::BackwardStepTrace<float> rec{rank(), step, to_host(res.dq), to_host(res.dk), to_host(res.dv), {}, {}};
  if (dk_in_flight) rec.dk_in_flight = to_host(*dk_in_flight);
  if (dv_in_flight) rec.dv_in_flight = to_host(*dv_in_flight);
  trace.backward.push_back(std::move(rec));
}

}  // namespace cpgold::gpu
