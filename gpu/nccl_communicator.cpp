// NcclCommunicator: non-blocking NCCL communicators with bounded waits (see the header for the contract).
#include "gpu/nccl_communicator.hpp"

#include <atomic>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

#include <nccl.h>

namespace cpgold::gpu {
namespace {

using Clock = std::chrono::steady_clock;

ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// How long a poll loop sleeps between looks: short, since NCCL transfers between GPUs of one host take microseconds.
void pause() { std::this_thread::sleep_for(std::chrono::microseconds(20)); }

}  // namespace

std::string nccl_version() {
  int code = 0;
  ncclGetVersion(&code);
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

std::string NcclCommunicator::who() const {
  std::string text = "rank " + std::to_string(world_rank());
  if (channel_) text += " of " + std::to_string(channel_->size());
  if (name_ != "world") text += " (" + name_ + ", rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")";
  return text;
}

void NcclCommunicator::fail(const std::string& operation, const std::string& cause, int failing_rank) {
  abort();
  throw RankFailure(failing_rank, who() + ": " + operation + ": " + cause);
}

void NcclCommunicator::check_call(int result, const std::string& operation, const char* call) {
  const auto code = static_cast<ncclResult_t>(result);
  if (code == ncclSuccess || code == ncclInProgress) return;
  const char* last = comm_ ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
  fail(operation, std::string(call) + " failed: " + ncclGetErrorString(code) + (last && *last ? std::string(" (") + last + ")" : ""),
       world_rank());
}

void NcclCommunicator::poll_until_ready(const std::string& operation, const char* what) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) check_call(queried, operation, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) check_call(state, operation, what);
    if (const std::optional<RankFault> fault = channel_->poll_fault())
      fail(operation, "stopped: rank " + std::to_string(fault->rank) + " failed: " + fault->message, fault->rank);
    if (Clock::now() > deadline)
      fail(operation, std::string(what) + " did not complete within " + seconds_text(timeout_) +
                          " (a peer rank is not taking part); communicator aborted", -1);
    pause();
  }
}

NcclCommunicator NcclCommunicator::create(RankChannel& channel, int device, Seconds timeout, const std::string& name) {
  NcclCommunicator result;
  result.channel_ = &channel;
  result.rank_ = channel.rank();
  result.size_ = channel.size();
  result.device_ = device;
  result.timeout_ = timeout;
  result.name_ = name;
  const std::string operation = "ncclCommInitRankConfig";
  if (const cudaError_t error = cudaSetDevice(device); error != cudaSuccess)
    throw RankFailure(channel.rank(), result.who() + ": cudaSetDevice(" + std::to_string(device) + ") failed: " +
                                          cudaGetErrorString(error));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (channel.rank() == 0) result.check_call(ncclGetUniqueId(&id), operation, "ncclGetUniqueId");
  const std::vector<std::string> ids =
      channel.all_gather(std::string(reinterpret_cast<const char*>(&id), sizeof(id)), "NCCL unique id handoff", timeout);
  std::memcpy(&id, ids[0].data(), sizeof(id));
  ncclConfig_t config = non_blocking_config();
  result.check_call(ncclCommInitRankConfig(&result.comm_, channel.size(), id, channel.rank(), &config), operation,
                    "ncclCommInitRankConfig");
  result.poll_until_ready(operation, "ncclCommInitRankConfig");
  return result;
}

NcclCommunicator NcclCommunicator::split(int color, int key, const std::string& name) {
  NcclCommunicator result;
  result.channel_ = channel_;
  result.device_ = device_;
  result.timeout_ = timeout_;
  result.name_ = name;
  const std::string operation = "ncclCommSplit(" + name + ")";
  ncclConfig_t config = non_blocking_config();
  check_call(ncclCommSplit(comm_, color, key, &result.comm_, &config), operation, "ncclCommSplit");
  // Non-blocking split: the parent reports the split's progress, and NCCL stores the new communicator into
  // result.comm_ from its own thread when the split completes.
  poll_until_ready(operation, "ncclCommSplit");
  if (std::atomic_ref<ncclComm_t>(result.comm_).load(std::memory_order_acquire) == nullptr)
    fail(operation, "ncclCommSplit completed without a communicator for color " + std::to_string(color), world_rank());
  result.poll_until_ready(operation, "ncclCommSplit");
  result.check_call(ncclCommUserRank(result.comm_, &result.rank_), operation, "ncclCommUserRank");
  result.check_call(ncclCommCount(result.comm_, &result.size_), operation, "ncclCommCount");
  return result;
}

NcclCommunicator::NcclCommunicator(NcclCommunicator&& other) noexcept { *this = std::move(other); }

NcclCommunicator& NcclCommunicator::operator=(NcclCommunicator&& other) noexcept {
  if (this != &other) {
    std::swap(comm_, other.comm_);
    std::swap(channel_, other.channel_);
    std::swap(rank_, other.rank_);
    std::swap(size_, other.size_);
    std::swap(device_, other.device_);
    std::swap(timeout_, other.timeout_);
    std::swap(name_, other.name_);
    std::swap(failed_, other.failed_);
  }
  return *this;
}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  // Unwinding from an error: peers may never finish their part, so finalizing could only wait out the timeout
  // before this rank gets to tell them why it stops.
  if (failed_ || std::uncaught_exceptions() > 0) {
    ncclCommAbort(comm_);
    return;
  }
  // ncclCommFinalize flushes outstanding work; bounded like every other wait, aborted if it does not finish.
  ncclResult_t state = ncclCommFinalize(comm_);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  while (state == ncclInProgress || state == ncclSuccess) {
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
      return;
    }
    if (state != ncclInProgress || Clock::now() > deadline) break;
    pause();
  }
  ncclCommAbort(comm_);
}

void NcclCommunicator::abort() {
  if (!comm_ || failed_) return;
  failed_ = true;
  ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::send_receive(const std::vector<Send>& sends, const std::vector<Receive>& receives,
                                    cudaStream_t stream, const std::string& operation) {
  if (failed_ || !comm_) fail(operation, "the communicator was aborted by an earlier failure", world_rank());
  for (const Send& s : sends)
    if (s.peer < 0 || s.peer >= size_ || s.peer == rank_)
      fail(operation, "send peer " + std::to_string(s.peer) + " is outside 0.." + std::to_string(size_ - 1) + " or self", world_rank());
  for (const Receive& r : receives)
    if (r.peer < 0 || r.peer >= size_ || r.peer == rank_)
      fail(operation, "receive peer " + std::to_string(r.peer) + " is outside 0.." + std::to_string(size_ - 1) + " or self", world_rank());
  check_call(ncclGroupStart(), operation, "ncclGroupStart");
  for (const Send& s : sends)
    if (s.bytes > 0) check_call(ncclSend(s.buffer, s.bytes, ncclUint8, s.peer, comm_, stream), operation, "ncclSend");
  for (const Receive& r : receives)
    if (r.bytes > 0) check_call(ncclRecv(r.buffer, r.bytes, ncclUint8, r.peer, comm_, stream), operation, "ncclRecv");
  check_call(ncclGroupEnd(), operation, "ncclGroupEnd");
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream,
                                  const std::string& operation) {
  if (failed_ || !comm_) fail(operation, "the communicator was aborted by an earlier failure", world_rank());
  check_call(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream), operation, "ncclAllGather");
}

void NcclCommunicator::reduce_scatter_sum(const float* send, float* recv, size_t count, cudaStream_t stream,
                                          const std::string& operation) {
  if (failed_ || !comm_) fail(operation, "the communicator was aborted by an earlier failure", world_rank());
  check_call(ncclReduceScatter(send, recv, count, ncclFloat32, ncclSum, comm_, stream), operation, "ncclReduceScatter");
}

void NcclCommunicator::all_to_all(const void* send, void* recv, size_t bytes, cudaStream_t stream,
                                  const std::string& operation) {
  if (failed_ || !comm_) fail(operation, "the communicator was aborted by an earlier failure", world_rank());
#if NCCL_VERSION_CODE >= 22800
  check_call(ncclAlltoAll(send, recv, bytes, ncclUint8, comm_, stream), operation, "ncclAlltoAll");
#else
  // Block `rank_` stays local: a device copy in stream order, the other blocks by grouped send/recv.
  const auto* in = static_cast<const unsigned char*>(send);
  auto* out = static_cast<unsigned char*>(recv);
  if (const cudaError_t error = cudaMemcpyAsync(out + rank_ * bytes, in + rank_ * bytes, bytes, cudaMemcpyDeviceToDevice, stream);
      error != cudaSuccess)
    fail(operation, std::string("cudaMemcpyAsync failed: ") + cudaGetErrorString(error), world_rank());
  std::vector<Send> sends;
  std::vector<Receive> receives;
  for (int peer = 0; peer < size_; ++peer)
    if (peer != rank_) {
      sends.push_back({peer, in + peer * bytes, bytes});
      receives.push_back({peer, out + peer * bytes, bytes});
    }
  send_receive(sends, receives, stream, operation);
#endif
}

void NcclCommunicator::wait_enqueued(const std::string& operation) {
  if (failed_ || !comm_) fail(operation, "the communicator was aborted by an earlier failure", world_rank());
  poll_until_ready(operation, "enqueue");
}

void NcclCommunicator::wait(cudaStream_t stream, const std::string& operation) {
  if (failed_ || !comm_) fail(operation, "the communicator was aborted by an earlier failure", world_rank());
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  int polls = 0;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) check_call(queried, operation, "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress) check_call(state, operation, "NCCL (asynchronous error)");
    if (state == ncclSuccess) {  // everything is enqueued: now the stream decides
      const cudaError_t query = cudaStreamQuery(stream);
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady)
        fail(operation, std::string("CUDA error on the stream: ") + cudaGetErrorString(query), world_rank());
    }
    // The channel is polled less often than NCCL: a fault is rare, the stream query is cheap.
    if (++polls % 16 == 0)
      if (const std::optional<RankFault> fault = channel_->poll_fault())
        fail(operation, "stopped: rank " + std::to_string(fault->rank) + " failed: " + fault->message, fault->rank);
    if (Clock::now() > deadline)
      fail(operation, "did not complete within " + seconds_text(timeout_) +
                          " (a peer rank is not taking part); communicator aborted", -1);
    pause();
  }
}

}  // namespace cpgold::gpu
