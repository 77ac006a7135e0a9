// RankChannel over shared memory: one process, one thread per rank. Exchanges are numbered in call order (every rank
// calls all_gather in the same order), so exchange n of one rank meets exchange n of the others.
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>

#include "gpu/comm/rank_channel.hpp"
#include "gpu/comm/rank_fault_order.hpp"
#include "reference/input_error.hpp"

namespace cpgold::gpu {

struct ThreadRendezvous::State {
  explicit State(int n) : size(n), fault_posted(static_cast<size_t>(n), false) {}
  int size;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<long, std::vector<std::optional<std::string>>> exchanges;  // exchange number -> [rank] contribution
  std::vector<std::pair<int, RankFault>> faults;                      // (posting rank, fault) in posting order
  std::vector<bool> fault_posted;                                     // [rank]
};

namespace {

class ThreadChannel final : public RankChannel {
 public:
  ThreadChannel(std::shared_ptr<ThreadRendezvous::State> state, int rank) : state_(std::move(state)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return state_->size; }
  std::string transport() const override { return "threads"; }

  std::vector<std::string> all_gather(const std::string& mine, const std::string& what, Seconds timeout) override {
    const long number = next_exchange_++;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
    std::unique_lock lock(state_->mutex);
    auto& slots = state_->exchanges[number];
    slots.resize(static_cast<size_t>(state_->size));
    slots[static_cast<size_t>(rank_)] = mine;
    state_->changed.notify_all();
    auto complete = [&] { return std::all_of(slots.begin(), slots.end(), [](const auto& s) { return s.has_value(); }); };
    while (!complete()) {
      if (const std::optional<RankFault> fault = first_foreign_fault())
        throw RankFailure(fault->rank, "rank " + std::to_string(rank_) + ": " + what + " stopped: rank " +
                                           std::to_string(fault->rank) + " failed: " + fault->message);
      if (state_->changed.wait_until(lock, deadline) == std::cv_status::timeout && !complete()) {
        std::ostringstream silent;
        int first_silent = -1;
        for (int r = 0; r < state_->size; ++r)
          if (!slots[static_cast<size_t>(r)]) {
            silent << (first_silent < 0 ? "" : ",") << r;
            if (first_silent < 0) first_silent = r;
          }
        throw RankFailure(first_silent, "rank " + std::to_string(rank_) + ": " + what + " timed out after " +
                                            seconds_text(timeout) + " waiting for rank(s) " + silent.str());
      }
    }
    std::vector<std::string> out;
    for (const auto& s : slots) out.push_back(*s);
    return out;
  }

  void post_fault(const RankFault& fault) override {
    std::lock_guard lock(state_->mutex);
    if (state_->fault_posted[static_cast<size_t>(rank_)]) return;
    state_->fault_posted[static_cast<size_t>(rank_)] = true;
    state_->faults.emplace_back(rank_, fault);
    state_->changed.notify_all();
  }

  std::optional<RankFault> poll_fault() override {
    std::lock_guard lock(state_->mutex);
    return first_foreign_fault();
  }

  std::vector<int> wait_for_all_faults(Seconds timeout) override {
    std::unique_lock lock(state_->mutex);
    const auto all = [&] { return std::all_of(state_->fault_posted.begin(), state_->fault_posted.end(), [](bool b) { return b; }); };
    state_->changed.wait_for(lock, timeout, all);
    std::vector<int> silent;
    for (int r = 0; r < state_->size; ++r)
      if (!state_->fault_posted[static_cast<size_t>(r)]) silent.push_back(r);
    return silent;
  }

 private:
  // Caller holds the mutex.
  std::optional<RankFault> first_foreign_fault() const {
    return prefer_own_failures(state_->faults, rank_);
  }

  std::shared_ptr<ThreadRendezvous::State> state_;
  int rank_;
  long next_exchange_ = 0;
};

}  // namespace

ThreadRendezvous::ThreadRendezvous(int size) {
  if (size < 1) fail_input("ranks", "expected at least 1 rank, got ", size);
  state_ = std::make_shared<State>(size);
}
ThreadRendezvous::~ThreadRendezvous() = default;

std::unique_ptr<RankChannel> ThreadRendezvous::channel(int rank) {
  if (rank < 0 || rank >= state_->size) fail_input("rank", "expected 0..", state_->size - 1, ", got ", rank);
  return std::make_unique<ThreadChannel>(state_, rank);
}

std::string seconds_text(Seconds seconds) {
  std::ostringstream out;
  out << seconds.count() << " s";
  return out.str();
}

void throw_if_peer_failed(RankChannel& channel, const std::string& operation) {
  if (const std::optional<RankFault> fault = channel.poll_fault())
    throw RankFailure(fault->rank, "rank " + std::to_string(channel.rank()) + ": " + operation + " stopped: rank " +
                                       std::to_string(fault->rank) + " failed: " + fault->message);
}

}  // namespace cpgold::gpu
