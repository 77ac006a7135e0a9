// Single-GPU communicator (contract in gpu/comm/communicator.hpp and gpu/comm/local_communicator.hpp).
#include "gpu/comm/local_communicator.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "gpu/comm/block_sum.hpp"
#include "sim/program/rendezvous.hpp"

namespace cpgold::gpu {
namespace {

// A CUDA event shared between the two sides of a message (destroyed when both are done with it).
struct Event {
  cudaEvent_t event = nullptr;
  ~Event() {
    if (event) cudaEventDestroy(event);
  }
};
using EventToken = std::shared_ptr<Event>;
using LocalRendezvous = sim::Rendezvous<EventToken>;

// Collective split bookkeeping shared by the ranks of one communicator.
struct SplitBoard {
  std::mutex mutex;
  std::condition_variable cv;
  // (split number, parent rank) -> (color, key)
  std::map<std::pair<int, int>, std::pair<int, int>> entries;
  std::map<std::pair<int, int>, std::shared_ptr<LocalRendezvous>> groups;  // (split number, color)
  std::map<std::pair<int, int>, std::shared_ptr<SplitBoard>> boards;
};

struct Shared {
  std::shared_ptr<LocalRendezvous> rendezvous;
  std::shared_ptr<SplitBoard> board;
};

CommFault fault_of(sim::ExchangeFault f) {
  switch (f) {
    case sim::ExchangeFault::timeout: return CommFault::timeout;
    case sim::ExchangeFault::mismatch: return CommFault::mismatch;
    case sim::ExchangeFault::invalid_argument: return CommFault::invalid_argument;
    case sim::ExchangeFault::aborted: return CommFault::aborted;
  }
  return CommFault::aborted;
}

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(int rank, Shared shared, cudaStream_t stream, bool owns_stream, const CommOptions& options)
      : rank_(rank), shared_(std::move(shared)), stream_(stream), owns_stream_(owns_stream), options_(options) {}
  ~LocalCommunicator() override {
    if (owns_stream_ && stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return shared_.rendezvous->size(); }
  void* stream() const override { return stream_; }
  const CommOptions& options() const override { return options_; }

  void send_recv(std::span<const SendTo> sends, std::span<const RecvFrom> recvs) override {
    std::vector<sim::PostedSend> posted;
    std::vector<sim::WantedRecv> wanted;
    for (const SendTo& s : sends) posted.push_back({s.peer, s.data, s.bytes});
    for (const RecvFrom& r : recvs) wanted.push_back({r.peer, r.data, r.bytes});
    exchange(CommOp::send_recv, posted, wanted);
  }

  void all_gather(const void* send, void* recv, size_t bytes_per_rank) override {
    std::vector<sim::PostedSend> posted;
    std::vector<sim::WantedRecv> wanted;
    for (int r = 0; r < size(); ++r) {
      posted.push_back({r, send, bytes_per_rank});
      wanted.push_back({r, static_cast<char*>(recv) + static_cast<size_t>(r) * bytes_per_rank, bytes_per_rank});
    }
    exchange(CommOp::all_gather, posted, wanted);
  }

  void reduce_scatter_sum(const float* send, float* recv, size_t count_per_rank) override {
    guard(CommOp::reduce_scatter);
    const size_t bytes = count_per_rank * sizeof(float);
    float* staging = nullptr;
    cuda(cudaMallocAsync(reinterpret_cast<void**>(&staging), std::max<size_t>(16, bytes * size()), stream_),
         CommOp::reduce_scatter, "cudaMallocAsync");
    std::vector<sim::PostedSend> posted;
    std::vector<sim::WantedRecv> wanted;
    for (int r = 0; r < size(); ++r) {
      posted.push_back({r, send + static_cast<size_t>(r) * count_per_rank, bytes});
      wanted.push_back({r, staging + static_cast<size_t>(r) * count_per_rank, bytes});
    }
    try {
      exchange(CommOp::reduce_scatter, posted, wanted);
    } catch (...) {
      cudaFreeAsync(staging, stream_);
      throw;
    }
    // Ranks summed in ascending order: bitwise reproducible.
    cuda(launch_sum_blocks(recv, staging, size(), count_per_rank, stream_), CommOp::reduce_scatter, "sum kernel");
    cuda(cudaFreeAsync(staging, stream_), CommOp::reduce_scatter, "cudaFreeAsync");
  }

  void all_to_all(const void* send, void* recv, size_t bytes_per_peer) override {
    std::vector<sim::PostedSend> posted;
    std::vector<sim::WantedRecv> wanted;
    for (int r = 0; r < size(); ++r) {
      posted.push_back({r, static_cast<const char*>(send) + static_cast<size_t>(r) * bytes_per_peer, bytes_per_peer});
      wanted.push_back({r, static_cast<char*>(recv) + static_cast<size_t>(r) * bytes_per_peer, bytes_per_peer});
    }
    exchange(CommOp::all_to_all, posted, wanted);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    guard(CommOp::split);
    SplitBoard& board = *shared_.board;
    std::unique_lock<std::mutex> lock(board.mutex);
    const int number = split_count_++;
    board.entries[{number, rank_}] = {color, key};
    board.cv.notify_all();
    const bool all = board.cv.wait_for(lock, options_.timeout, [&] {
      for (int r = 0; r < size(); ++r)
        if (!board.entries.count({number, r})) return false;
      return true;
    });
    if (!all) {
      lock.unlock();
      fail(CommOp::split, CommFault::timeout,
           "not every rank called split (split number " + std::to_string(number) + ") within " +
               std::to_string(options_.timeout.count()) + " ms");
    }
    if (color < 0) return nullptr;
    std::vector<std::tuple<int, int>> members;  // (key, parent rank)
    for (int r = 0; r < size(); ++r) {
      const auto [c, k] = board.entries[{number, r}];
      if (c == color) members.emplace_back(k, r);
    }
    std::sort(members.begin(), members.end());
    int sub_rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (std::get<1>(members[i]) == rank_) sub_rank = static_cast<int>(i);
    auto& group = board.groups[{number, color}];
    if (!group) group = std::make_shared<LocalRendezvous>(static_cast<int>(members.size()), options_.timeout);
    auto& sub_board = board.boards[{number, color}];
    if (!sub_board) sub_board = std::make_shared<SplitBoard>();
    return std::make_unique<LocalCommunicator>(sub_rank, Shared{group, sub_board}, stream_, false, options_);
  }

  void synchronize() override {
    guard(CommOp::synchronize);
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) fail(CommOp::synchronize, CommFault::device_error, cudaGetErrorString(e));
      if (std::chrono::steady_clock::now() > deadline)
        fail(CommOp::synchronize, CommFault::timeout,
             "stream work not finished within " + std::to_string(options_.timeout.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void abort() noexcept override {
    aborted_ = true;
    shared_.rendezvous->abort();
  }

 private:
  void guard(CommOp op) {
    if (aborted_ || shared_.rendezvous->aborted())
      throw CommError(rank_, size(), op, CommFault::aborted, "the communicator was aborted by an earlier fault");
  }
  [[noreturn]] void fail(CommOp op, CommFault fault, const std::string& detail) {
    abort();
    throw CommError(rank_, size(), op, fault, detail);
  }
  void cuda(cudaError_t e, CommOp op, const char* what) {
    if (e != cudaSuccess) fail(op, CommFault::device_error, std::string(what) + ": " + cudaGetErrorString(e));
  }
  EventToken record(CommOp op) {
    auto token = std::make_shared<Event>();
    cuda(cudaEventCreateWithFlags(&token->event, cudaEventDisableTiming), op, "cudaEventCreate");
    cuda(cudaEventRecord(token->event, stream_), op, "cudaEventRecord");
    return token;
  }

  void exchange(CommOp op, const std::vector<sim::PostedSend>& sends, const std::vector<sim::WantedRecv>& recvs) {
    guard(op);
    try {
      shared_.rendezvous->exchange(
          rank_, std::string(comm_op_name(op)), sends, recvs, [&] { return record(op); },
          [&](void* dst, const void* src, size_t bytes, const EventToken& ready) {
            cuda(cudaStreamWaitEvent(stream_, ready->event, 0), op, "cudaStreamWaitEvent");
            if (bytes > 0)
              cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), op, "cudaMemcpyAsync");
            return record(op);
          },
          [&](const EventToken& copied) {
            cuda(cudaStreamWaitEvent(stream_, copied->event, 0), op, "cudaStreamWaitEvent");
          });
    } catch (const sim::ExchangeError& e) {
      aborted_ = true;
      throw CommError(rank_, size(), op, fault_of(e.fault()), e.detail());
    }
  }

  int rank_;
  Shared shared_;
  cudaStream_t stream_;
  bool owns_stream_;
  CommOptions options_;
  std::atomic<bool> aborted_{false};
  int split_count_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_communicators(int size, const CommOptions& options) {
  if (size < 1) throw CommError(0, size, CommOp::split, CommFault::invalid_argument, "size " + std::to_string(size) + " < 1");
  Shared shared{std::make_shared<LocalRendezvous>(size, options.timeout), std::make_shared<SplitBoard>()};
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) {
    cudaStream_t stream = nullptr;
    const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess)
      throw CommError(r, size, CommOp::split, CommFault::device_error,
                      std::string("cudaStreamCreate: ") + cudaGetErrorString(e));
    comms.push_back(std::make_unique<LocalCommunicator>(r, shared, stream, true, options));
  }
  return comms;
}

}  // namespace cpgold::gpu
