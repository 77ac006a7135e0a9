// NcclCommunicator: non-blocking NCCL communicators with bounded waits (see the header for the contract).
#include "gpu/comm/nccl_communicator.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <exception>
#include <stdexcept>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

namespace cpgold::gpu {
namespace {

using Clock = std::chrono::steady_clock;

// NVLink multicast (NVLS) stays off in every process that opens a communicator, however it was started (threads,
// mpirun, the folder handoff): NCCL reads NCCL_NVLS_ENABLE once, at its first call, so this runs before any.
void nvls_off() {
  static std::once_flag once;
  std::call_once(once, [] { setenv("NCCL_NVLS_ENABLE", "0", 1); });
}

ncclConfig_t non_blocking_config(NcclCtaPolicy policy) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  if (policy == NcclCtaPolicy::efficiency) config.CTAPolicy = NCCL_CTA_POLICY_EFFICIENCY;
  if (policy == NcclCtaPolicy::zero) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
#else
  (void)policy;  // create() refuses a non-default policy before this is reached
#endif
  return config;
}

// Between polls: short, since NCCL transfers between GPUs of one host take microseconds.
void pause() { std::this_thread::sleep_for(std::chrono::microseconds(20)); }

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

struct NcclCommunicator::Shared {
  RankChannel* channel = nullptr;
  int world_rank = 0, world_size = 0;
  cudaStream_t stream = nullptr;
  NcclCtaPolicy cta_policy = NcclCtaPolicy::nccl_default;
  ~Shared() {
    if (stream) cudaStreamDestroy(stream);
  }
};

std::string nccl_version() {
  int code = 0;
  ncclGetVersion(&code);
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

std::string_view nccl_cta_policy_name(NcclCtaPolicy policy) {
  switch (policy) {
    case NcclCtaPolicy::efficiency: return "efficiency";
    case NcclCtaPolicy::zero: return "zero";
    case NcclCtaPolicy::nccl_default: break;
  }
  return "default";
}

bool nccl_has_cta_policies() {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  return true;
#else
  return false;
#endif
}

NcclCtaPolicy parse_nccl_cta_policy(std::string_view name) {
  for (NcclCtaPolicy p : {NcclCtaPolicy::nccl_default, NcclCtaPolicy::efficiency, NcclCtaPolicy::zero})
    if (name == nccl_cta_policy_name(p)) return p;
  throw std::invalid_argument("CTA policy: expected default, efficiency or zero, got \"" + std::string(name) + "\"");
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<Shared> shared, ncclComm_t comm, int rank, int size, std::string name)
    : shared_(std::move(shared)), comm_(comm), rank_(rank), size_(size), name_(std::move(name)) {
  channel_ = shared_->channel;
  stream_ = shared_->stream;
}

void NcclCommunicator::fail(CommOp op, CommFault fault, const std::string& detail) {
  abort();
  std::string where = detail;
  if (name_ != "world") where += " [" + name_ + ", rank " + std::to_string(rank_) + " of " + std::to_string(size_) + "]";
  throw CommError(shared_->world_rank, shared_->world_size, op, fault, where);
}

void NcclCommunicator::check_nccl(int result, CommOp op, const char* call) {
  const auto code = static_cast<ncclResult_t>(result);
  if (code == ncclSuccess || code == ncclInProgress) return;
  const char* last = ncclGetLastError(comm_);
  fail(op, code == ncclInvalidArgument || code == ncclInvalidUsage ? CommFault::invalid_argument : CommFault::device_error,
       std::string(call) + ": " + ncclGetErrorString(code) + (last && *last ? std::string(" (") + last + ")" : ""));
}

void NcclCommunicator::check_usable(CommOp op) {
  if (failed_ || !comm_) fail(op, CommFault::aborted, "the communicator was aborted by an earlier fault");
}

void NcclCommunicator::wait_enqueued(CommOp op, const char* call) {
  const auto deadline = Clock::now() + options_.timeout;
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &state), op, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) check_nccl(state, op, call);
    if (polls % 16 == 0)
      if (const std::optional<RankFault> fault = channel_->poll_fault())
        fail(op, CommFault::aborted, "stopped: rank " + std::to_string(fault->rank) + " failed: " + fault->message);
    if (Clock::now() > deadline)
      fail(op, CommFault::timeout, std::string(call) + " still in progress after " +
                                       seconds_text(Seconds(options_.timeout)) + " (a peer is not taking part); aborted");
    pause();
  }
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(RankChannel& channel, int device, const CommOptions& options,
                                                           NcclCtaPolicy cta_policy) {
  nvls_off();
  auto shared = std::make_shared<Shared>();
  shared->channel = &channel;
  shared->world_rank = channel.rank();
  shared->world_size = channel.size();
  shared->cta_policy = cta_policy;
  if (cta_policy != NcclCtaPolicy::nccl_default && !nccl_has_cta_policies())
    throw CommError(channel.rank(), channel.size(), CommOp::barrier, CommFault::invalid_argument,
                    "CTA policy " + std::string(nccl_cta_policy_name(cta_policy)) + " needs NCCL 2.27 or later, this is " +
                        nccl_version());
  auto cuda_fail = [&](const char* call, cudaError_t e) {
    throw CommError(channel.rank(), channel.size(), CommOp::barrier, CommFault::device_error,
                    std::string(call) + " on device " + std::to_string(device) + ": " + cudaGetErrorString(e));
  };
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) cuda_fail("cudaSetDevice", e);
  // The highest priority: NCCL's kernels then take SMs as soon as the attention running beside them frees any,
  // instead of queueing behind all of its blocks (the exchanges overlap the attention on another stream).
  int lowest = 0, highest = 0;
  if (const cudaError_t e = cudaDeviceGetStreamPriorityRange(&lowest, &highest); e != cudaSuccess)
    cuda_fail("cudaDeviceGetStreamPriorityRange", e);
  if (const cudaError_t e = cudaStreamCreateWithPriority(&shared->stream, cudaStreamNonBlocking, highest); e != cudaSuccess)
    cuda_fail("cudaStreamCreate", e);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (channel.rank() == 0)
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      throw CommError(0, channel.size(), CommOp::barrier, CommFault::device_error,
                      std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  const Seconds timeout(options.timeout);
  const std::vector<std::string> ids =
      channel.all_gather(std::string(reinterpret_cast<const char*>(&id), sizeof(id)), "NCCL unique id handoff", timeout);
  std::memcpy(&id, ids[0].data(), sizeof(id));
  std::unique_ptr<NcclCommunicator> result(new NcclCommunicator(shared, nullptr, channel.rank(), channel.size(), "world"));
  result->options_ = options;
  ncclConfig_t config = non_blocking_config(cta_policy);
  result->check_nccl(ncclCommInitRankConfig(&result->comm_, channel.size(), id, channel.rank(), &config),
                     CommOp::barrier, "ncclCommInitRankConfig");
  result->wait_enqueued(CommOp::barrier, "ncclCommInitRankConfig");
  return result;
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  check_usable(CommOp::split);
  ncclComm_t child = nullptr;
  ncclConfig_t config = non_blocking_config(shared_->cta_policy);
  check_nccl(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config), CommOp::split,
             "ncclCommSplit");
  // Non-blocking split: the parent reports its progress, and NCCL stores the new communicator into `child` from
  // its own thread when the split completes.
  wait_enqueued(CommOp::split, "ncclCommSplit");
  child = std::atomic_ref<ncclComm_t>(child).load(std::memory_order_acquire);
  if (color < 0) return nullptr;
  if (child == nullptr) fail(CommOp::split, CommFault::device_error, "ncclCommSplit completed without a communicator");
  int child_rank = 0, child_size = 0;
  std::unique_ptr<NcclCommunicator> result(new NcclCommunicator(shared_, child, 0, 0, "split color " + std::to_string(color)));
  result->options_ = options_;
  result->wait_enqueued(CommOp::split, "ncclCommSplit (new communicator)");
  result->check_nccl(ncclCommUserRank(child, &child_rank), CommOp::split, "ncclCommUserRank");
  result->check_nccl(ncclCommCount(child, &child_size), CommOp::split, "ncclCommCount");
  result->rank_ = child_rank;
  result->size_ = child_size;
  return result;
}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  // Unwinding from an error, or after a fault: peers may never finish their part, so finalizing could only wait
  // out the timeout before this rank gets to tell them why it stops.
  if (failed_ || std::uncaught_exceptions() > 0) {
    ncclCommAbort(comm_);
    return;
  }
  ncclResult_t state = ncclCommFinalize(comm_);
  const auto deadline = Clock::now() + options_.timeout;
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

void NcclCommunicator::abort() noexcept {
  if (!comm_ || failed_) return;
  failed_ = true;
  ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::send_recv(std::span<const SendTo> sends, std::span<const RecvFrom> recvs) {
  check_usable(CommOp::send_recv);
  std::vector<const SendTo*> to_self;
  std::vector<const RecvFrom*> from_self;
  for (const SendTo& s : sends) {
    if (s.peer < 0 || s.peer >= size_)
      fail(CommOp::send_recv, CommFault::invalid_argument, "send peer " + std::to_string(s.peer) + " outside 0.." + std::to_string(size_ - 1));
    if (s.bytes > 0 && !s.data) fail(CommOp::send_recv, CommFault::invalid_argument, "null send buffer with " + std::to_string(s.bytes) + " bytes");
    if (s.peer == rank_) to_self.push_back(&s);
  }
  for (const RecvFrom& r : recvs) {
    if (r.peer < 0 || r.peer >= size_)
      fail(CommOp::send_recv, CommFault::invalid_argument, "receive peer " + std::to_string(r.peer) + " outside 0.." + std::to_string(size_ - 1));
    if (r.bytes > 0 && !r.data) fail(CommOp::send_recv, CommFault::invalid_argument, "null receive buffer with " + std::to_string(r.bytes) + " bytes");
    if (r.peer == rank_) from_self.push_back(&r);
  }
  // Messages to self are device copies in stream order, paired in call order like any other peer's.
  if (to_self.size() != from_self.size())
    fail(CommOp::send_recv, CommFault::mismatch, std::to_string(to_self.size()) + " sends to self but " +
                                                      std::to_string(from_self.size()) + " receives from self");
  for (size_t i = 0; i < to_self.size(); ++i) {
    if (to_self[i]->bytes != from_self[i]->bytes)
      fail(CommOp::send_recv, CommFault::mismatch, "send to self of " + std::to_string(to_self[i]->bytes) +
                                                        " bytes paired with a receive of " + std::to_string(from_self[i]->bytes));
    if (to_self[i]->bytes > 0)
      if (const cudaError_t e = cudaMemcpyAsync(from_self[i]->data, to_self[i]->data, to_self[i]->bytes,
                                                cudaMemcpyDeviceToDevice, as_stream(stream_));
          e != cudaSuccess)
        fail(CommOp::send_recv, CommFault::device_error, std::string("cudaMemcpyAsync (self): ") + cudaGetErrorString(e));
  }
  check_nccl(ncclGroupStart(), CommOp::send_recv, "ncclGroupStart");
  for (const SendTo& s : sends)
    if (s.peer != rank_ && s.bytes > 0)
      check_nccl(ncclSend(s.data, s.bytes, ncclUint8, s.peer, comm_, as_stream(stream_)), CommOp::send_recv, "ncclSend");
  for (const RecvFrom& r : recvs)
    if (r.peer != rank_ && r.bytes > 0)
      check_nccl(ncclRecv(r.data, r.bytes, ncclUint8, r.peer, comm_, as_stream(stream_)), CommOp::send_recv, "ncclRecv");
  check_nccl(ncclGroupEnd(), CommOp::send_recv, "ncclGroupEnd");
  wait_enqueued(CommOp::send_recv, "ncclGroupEnd");
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t bytes_per_rank) {
  check_usable(CommOp::all_gather);
  check_nccl(ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm_, as_stream(stream_)), CommOp::all_gather, "ncclAllGather");
  wait_enqueued(CommOp::all_gather, "ncclAllGather");
}

void NcclCommunicator::reduce_scatter_sum(const float* send, float* recv, size_t count_per_rank) {
  check_usable(CommOp::reduce_scatter);
  check_nccl(ncclReduceScatter(send, recv, count_per_rank, ncclFloat32, ncclSum, comm_, as_stream(stream_)),
             CommOp::reduce_scatter, "ncclReduceScatter");
  wait_enqueued(CommOp::reduce_scatter, "ncclReduceScatter");
}

void NcclCommunicator::all_to_all(const void* send, void* recv, size_t bytes_per_peer) {
  check_usable(CommOp::all_to_all);
#if NCCL_VERSION_CODE >= 22800
  check_nccl(ncclAlltoAll(send, recv, bytes_per_peer, ncclUint8, comm_, as_stream(stream_)), CommOp::all_to_all, "ncclAlltoAll");
  wait_enqueued(CommOp::all_to_all, "ncclAlltoAll");
#else
  const auto* in = static_cast<const unsigned char*>(send);
  auto* out = static_cast<unsigned char*>(recv);
  std::vector<SendTo> sends;
  std::vector<RecvFrom> recvs;
  for (int peer = 0; peer < size_; ++peer) {
    sends.push_back({peer, in + peer * bytes_per_peer, bytes_per_peer});
    recvs.push_back({peer, out + peer * bytes_per_peer, bytes_per_peer});
  }
  send_recv(sends, recvs);
#endif
}

void NcclCommunicator::synchronize() {
  check_usable(CommOp::synchronize);
  const auto deadline = Clock::now() + options_.timeout;
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &state), CommOp::synchronize, "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress) check_nccl(state, CommOp::synchronize, "NCCL (asynchronous error)");
    if (state == ncclSuccess) {  // everything is enqueued: the stream decides
      const cudaError_t query = cudaStreamQuery(as_stream(stream_));
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady)
        fail(CommOp::synchronize, CommFault::device_error, std::string("CUDA error on the stream: ") + cudaGetErrorString(query));
    }
    // The channel is polled less often than the stream: a fault is rare, the stream query is cheap.
    if (polls % 16 == 0)
      if (const std::optional<RankFault> fault = channel_->poll_fault())
        fail(CommOp::synchronize, CommFault::aborted, "stopped: rank " + std::to_string(fault->rank) + " failed: " + fault->message);
    if (Clock::now() > deadline)
      fail(CommOp::synchronize, CommFault::timeout, "the stream did not pass its operations within " +
                                                        seconds_text(Seconds(options_.timeout)) + " (a peer is not taking part); aborted");
    pause();
  }
}

}  // namespace cpgold::gpu
