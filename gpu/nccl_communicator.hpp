#pragma once
// One rank's NCCL communicator for the multi-GPU CP paths: grouped send/recv (the p2p ring's KV and dKV, the a2a
// exchange), all-gather (all_gather's K/V), reduce-scatter of float32 sums (all_gather's dK/dV), all-to-all, and
// ncclCommSplit for the a2a groups and p2p rings of a2a+p2p.
// Fault contract: communicators are non-blocking (ncclConfig_t::blocking = 0); every operation is enqueued, then
// wait() polls the communicator's asynchronous error, the stream, and the rank channel's faults, and aborts the
// communicator (ncclCommAbort) when the timeout passes, NCCL reports an error, or another rank posted a fault.
// Every error names this rank, the communicator and the operation; nothing waits longer than the timeout.
// Byte counts move bytes exactly (ncclUint8); only reduce_scatter_sum does arithmetic.
#include <cstddef>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/rank_channel.hpp"

typedef struct ncclComm* ncclComm_t;

namespace cpgold::gpu {

class NcclCommunicator {
 public:
  // Collective over `channel` (every rank calls it): rank 0 makes the unique id, the channel hands it to the others,
  // every rank joins on CUDA device `device` (made current on the calling thread). RankFailure / runtime_error
  // naming the rank on any failure or timeout.
  static NcclCommunicator create(RankChannel& channel, int device, Seconds timeout, const std::string& name = "world");
  NcclCommunicator() = default;
  NcclCommunicator(NcclCommunicator&& other) noexcept;
  NcclCommunicator& operator=(NcclCommunicator&& other) noexcept;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator();  // finalizes (bounded) and destroys; aborts when an operation failed

  // ncclCommSplit: every rank of this communicator calls it; ranks with the same color form one communicator,
  // ordered by key. name: for errors ("a2a group 1").
  NcclCommunicator split(int color, int key, const std::string& name);

  bool valid() const { return comm_ != nullptr; }
  int rank() const { return rank_; }        // rank in this communicator
  int size() const { return size_; }
  int world_rank() const { return channel_ ? channel_->rank() : -1; }
  const std::string& name() const { return name_; }
  Seconds timeout() const { return timeout_; }
  RankChannel& channel() const { return *channel_; }

  // One grouped exchange: each send moves `bytes` from `buffer` to `peer`, each receive `bytes` from `peer` into
  // `buffer` (peers are ranks of this communicator). Enqueued on `stream`; call wait() before reading.
  struct Send {
    int peer = 0;
    const void* buffer = nullptr;
    size_t bytes = 0;
  };
  struct Receive {
    int peer = 0;
    void* buffer = nullptr;
    size_t bytes = 0;
  };
  void send_receive(const std::vector<Send>& sends, const std::vector<Receive>& receives, cudaStream_t stream,
                    const std::string& operation);
  // send [bytes] -> recv [size() * bytes], rank r's block at r * bytes.
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream, const std::string& operation);
  // send [size() * count] float32 -> recv [count]: block rank() of the elementwise sum over ranks.
  void reduce_scatter_sum(const float* send, float* recv, size_t count, cudaStream_t stream, const std::string& operation);
  // send [size() * bytes] -> recv [size() * bytes]: block j of send goes to rank j, block j of recv comes from rank j.
  // NCCL's ncclAlltoAll where the installed NCCL has it (2.28 and later), grouped send/recv otherwise.
  void all_to_all(const void* send, void* recv, size_t bytes, cudaStream_t stream, const std::string& operation);

  // Waits until everything enqueued on `stream` (NCCL's and earlier work) is done, at most timeout(); aborts the
  // communicator and throws on an NCCL error, a CUDA error, a fault posted by another rank, or the timeout.
  void wait(cudaStream_t stream, const std::string& operation);
  // Waits until NCCL has finished enqueuing (non-blocking calls return ncclInProgress), without waiting for the
  // stream: lets a caller overlap the transfer with work on another stream and synchronise through events.
  void wait_enqueued(const std::string& operation);

  // Marks the communicator failed and aborts it (idempotent). Called by wait() on any failure.
  void abort();

  // "rank 1 of 4 (a2a group 0, rank 1 of 2)": the prefix of every error.
  std::string who() const;

 private:
  void check_call(int result, const std::string& operation, const char* call);
  [[noreturn]] void fail(const std::string& operation, const std::string& cause, int failing_rank);
  void poll_until_ready(const std::string& operation, const char* what);

  ncclComm_t comm_ = nullptr;
  RankChannel* channel_ = nullptr;
  int rank_ = 0, size_ = 0, device_ = 0;
  Seconds timeout_{60};
  std::string name_;
  bool failed_ = false;
};

// Which NCCL the build links ("2.28.9"), for reports.
std::string nccl_version();

}  // namespace cpgold::gpu
