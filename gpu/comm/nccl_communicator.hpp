#pragma once
// The NCCL implementation of the communicator contract (gpu/comm/communicator.hpp): one rank per GPU, one ncclComm_t
// per rank and per split, for the multi-GPU CP paths: grouped send/recv (the p2p ring's KV and dKV, a2a), all-gather
// (all_gather's K/V), reduce-scatter of float32 sums (all_gather's dK/dV), all-to-all (ncclAlltoAll where the
// installed NCCL has it, 2.28 and later; grouped send/recv otherwise), ncclCommSplit for a2a+p2p's groups and rings.
// Bytes move as ncclUint8 (bit for bit); only reduce_scatter_sum does arithmetic.
// Faults: communicators are non-blocking (ncclConfig_t::blocking = 0). Every call enqueues, then polls
// ncclCommGetAsyncError until NCCL has finished enqueuing; synchronize() polls the stream. Every poll loop also
// watches the rank channel (gpu/comm/rank_channel.hpp) for a fault posted by another rank, and gives up after
// options().timeout: then the communicator is aborted (ncclCommAbort) and CommError names this rank (its rank in
// the CP communicator, W), the operation and the cause: a peer's failure names that peer.
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "gpu/comm/communicator.hpp"
#include "gpu/comm/rank_channel.hpp"

typedef struct ncclComm* ncclComm_t;

namespace cpgold::gpu {

// NCCL's CTA policy (ncclConfig_t::CTAPolicy, NCCL 2.27 and later): how many thread blocks NCCL's kernels take
// beside the application's. `efficiency` takes fewer (NCCL's choice for communication overlapped with compute),
// `zero` none where NCCL can move the data otherwise. Applies to the communicator and its splits.
enum class NcclCtaPolicy { nccl_default, efficiency, zero };
std::string_view nccl_cta_policy_name(NcclCtaPolicy policy);  // "default", "efficiency", "zero"
// "default", "efficiency" or "zero"; std::invalid_argument naming the value otherwise.
NcclCtaPolicy parse_nccl_cta_policy(std::string_view name);
bool nccl_has_cta_policies();  // built against NCCL 2.27 or later: a policy other than the default can be set

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `channel` (every rank calls it, each from its own thread or process): rank 0 makes NCCL's
  // unique id, the channel hands it to the others, every rank joins on CUDA device `device` (made current on the
  // calling thread) with a new non-blocking stream of the highest priority. CommError(split is not involved:
  // CommOp::barrier names the creation) or RankFailure (the channel) on failure or timeout. A CTA policy other than
  // the default needs NCCL 2.27 or later (CommError otherwise).
  static std::unique_ptr<NcclCommunicator> create(RankChannel& channel, int device, const CommOptions& options = {},
                                                  NcclCtaPolicy cta_policy = NcclCtaPolicy::nccl_default);
  ~NcclCommunicator() override;  // finalizes (bounded by the timeout) and destroys; aborts after a fault

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void* stream() const override { return stream_; }
  const CommOptions& options() const override { return options_; }

  void send_recv(std::span<const SendTo> sends, std::span<const RecvFrom> recvs) override;
  void all_gather(const void* send, void* recv, size_t bytes_per_rank) override;
  void reduce_scatter_sum(const float* send, float* recv, size_t count_per_rank) override;
  void all_to_all(const void* send, void* recv, size_t bytes_per_peer) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  void synchronize() override;
  void abort() noexcept override;

  RankChannel& channel() const { return *channel_; }
  const std::string& name() const { return name_; }  // "world", "split color 1"

 private:
  struct Shared;  // what a communicator and its splits share: the channel, world rank and size, stream, CTA policy
  NcclCommunicator(std::shared_ptr<Shared> shared, ncclComm_t comm, int rank, int size, std::string name);

  [[noreturn]] void fail(CommOp op, CommFault fault, const std::string& detail);
  void check_nccl(int result, CommOp op, const char* call);
  void check_usable(CommOp op);
  void wait_enqueued(CommOp op, const char* call);  // polls ncclCommGetAsyncError until not in progress

  std::shared_ptr<Shared> shared_;
  RankChannel* channel_ = nullptr;
  ncclComm_t comm_ = nullptr;
  void* stream_ = nullptr;
  CommOptions options_;
  int rank_ = 0, size_ = 0;
  std::string name_;
  bool failed_ = false;
};

// Which NCCL the program runs with ("2.28.3"), for reports.
std::string nccl_version();

}  // namespace cpgold::gpu
