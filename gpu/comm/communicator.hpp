#pragma once
// The communicator a GPU CP executor exchanges through: one object per rank, each rank driven by its own host thread
// (or process), every operation enqueued on the rank's CUDA stream. Two implementations share this contract:
//  - local (gpu/comm/local_communicator.hpp): all W ranks on one device, messages as device copies ordered by events, a
//    host rendezvous matching sends with receives;
//  - NCCL: one ncclComm_t per rank (non-blocking config), grouped send/recv inside ncclGroupStart/End, errors polled
//    with ncclCommGetAsyncError and the communicator aborted on timeout.
//
// Contract common to every call:
//  - Collective: every rank of the communicator makes the same sequence of calls (same operation, matching sizes),
//    each from its own thread. A rank that does not arrive makes the others fail with a timeout, never hang.
//  - Stream order: the operation runs on stream() after the work already enqueued there; work enqueued there later
//    sees its results. A call returns once the operation is enqueued (the local implementation: once the matching
//    peers have posted theirs and the copies are enqueued; NCCL: once ncclGroupEnd is no longer in progress). The
//    data is there when the stream reaches that point; synchronize() waits for it on the host. A caller computing
//    on another stream orders it against stream() with events (the CP backend, gpu/cp/cp_executor.cpp, does so to
//    overlap the ring's exchanges with its attention).
//  - Buffers are device pointers on the rank's device, valid and unmodified (send) / untouched (receive) until the
//    stream has passed the operation. Send and receive buffers of one call must not overlap.
//  - Faults: every failure throws CommError naming this rank, the operation and what went wrong; no call (including
//    synchronize()) waits longer than options().timeout. After a CommError the communicator is aborted: every later
//    call throws CommError (kind aborted) at once. Errors are never swallowed or turned into wrong data.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include "sim/program/exchange_message.hpp"

namespace cpgold::gpu {

// The operations a CommError can name.
enum class CommOp { send_recv, all_gather, reduce_scatter, all_to_all, split, synchronize, barrier };
std::string_view comm_op_name(CommOp op);  // "send_recv", "all_gather", ...

enum class CommFault {
  timeout,           // a peer did not arrive / the stream did not reach the operation within the timeout
  mismatch,          // peers disagree (operation, byte counts, sizes, a send without a receive in the same call)
  invalid_argument,  // a bad peer rank, a negative or overflowing size, null buffers with non-zero bytes
  device_error,      // a CUDA or NCCL call failed; the message carries its error string
  aborted,           // the communicator was aborted by an earlier fault (of this rank or a peer)
};
std::string_view comm_fault_name(CommFault fault);  // "timeout", "mismatch", ...

// what(): "rank <r> (of <size>) <operation>: <fault>: <detail>".
class CommError : public std::runtime_error {
 public:
  CommError(int rank, int size, CommOp op, CommFault fault, const std::string& detail);
  int rank() const { return rank_; }
  int size() const { return size_; }
  CommOp operation() const { return op_; }
  CommFault fault() const { return fault_; }
  const std::string& detail() const { return detail_; }

 private:
  int rank_, size_;
  CommOp op_;
  CommFault fault_;
  std::string detail_;
};

struct CommOptions {
  // Longest time any call waits: for peers to arrive (host rendezvous / NCCL progress) and in synchronize().
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// One message of a grouped exchange (sim/program/exchange_message.hpp): {peer, data, bytes}, bytes may be 0.
using SendTo = sim::PostedSend;
using RecvFrom = sim::WantedRecv;

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;  // 0 .. size()-1 within this communicator
  virtual int size() const = 0;
  virtual void* stream() const = 0;  // the rank's cudaStream_t
  virtual const CommOptions& options() const = 0;

  // The messages of one step as one group (ncclGroupStart; ncclSend/ncclRecv...; ncclGroupEnd). Matching: the k-th
  // send of rank a to b in this call pairs with the k-th receive of rank b from a in b's same-numbered send_recv
  // call; paired byte counts must be equal (mismatch otherwise). Sends and receives of one call run concurrently, so
  // a ring shift (send to next, receive from previous) in one call cannot deadlock. A send to or receive from self
  // is a device copy. An unmatched message makes both sides fail with timeout (or mismatch where detected).
  virtual void send_recv(std::span<const SendTo> sends, std::span<const RecvFrom> recvs) = 0;

  // recv: [size()][bytes_per_rank] bytes; block r = rank r's send [bytes_per_rank] (rank order).
  virtual void all_gather(const void* send, void* recv, size_t bytes_per_rank) = 0;

  // send: [size()][count_per_rank] float32 on every rank; recv: [count_per_rank] float32 =
  // sum over ranks r of block rank() of rank r's send. The summation order is the implementation's (local: ranks in
  // ascending order, so results are bitwise reproducible; NCCL: its ring/tree order, reproducible for a fixed
  // topology and NCCL version).
  virtual void reduce_scatter_sum(const float* send, float* recv, size_t count_per_rank) = 0;

  // send: [size()][bytes_per_peer]; block j goes to rank j. recv: [size()][bytes_per_peer]; block i comes from rank
  // i. (NCCL: grouped send/recv.)
  virtual void all_to_all(const void* send, void* recv, size_t bytes_per_peer) = 0;

  // Collective over this communicator (ncclCommSplit): ranks with the same color form a new communicator, ordered
  // by (key, parent rank); same stream and options as the parent. color < 0: this rank joins none (returns null).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Waits on the host until the stream has passed every enqueued operation (and, for NCCL, no async error is
  // pending). timeout -> CommError(timeout) and abort.
  virtual void synchronize() = 0;

  // Marks the communicator failed; peers blocked in a call with this rank fail with CommError(aborted) promptly
  // (NCCL: ncclCommAbort). Idempotent; never throws.
  virtual void abort() noexcept = 0;
};

// The two sub-communicators of a2a+p2p for a CP communicator of size W = a2a_size * P: the a2a group of this rank
// (a2a_size consecutive ranks: color rank / a2a_size) and its p2p ring (P ranks with the same index inside their
// a2a group: color rank % a2a_size, ordered by group). Both are collective splits of `cp`.
struct CpGroups {
  std::unique_ptr<Communicator> a2a;
  std::unique_ptr<Communicator> p2p;
};
CpGroups split_cp_groups(Communicator& cp, int a2a_size);

}  // namespace cpgold::gpu
