#pragma once
// Host-side matching of grouped sends and receives between the W rank threads of one process: the CPU simulator's
// exchanges and the single-GPU communicator (gpu/comm/local_communicator.*) both run on it. The k-th send of rank a to
// rank b pairs with the k-th receive of b from a (per ordered pair, over the whole run). A sender posts its messages
// and waits until each has been consumed; a receiver waits for the matching post and copies it with the caller's copy
// function. Every wait is bounded by the timeout; faults name the rank, the operation and the peer. Knows no CUDA:
// a backend's copy function may enqueue device copies and pass events through the Token.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sim/program/exchange_message.hpp"

namespace cpgold::sim {

enum class ExchangeFault { timeout, mismatch, invalid_argument, aborted };

// what(): "rank <r> <operation>: <fault>: <detail>"
class ExchangeError : public std::runtime_error {
 public:
  ExchangeError(int rank, std::string operation, ExchangeFault fault, const std::string& detail)
      : std::runtime_error("rank " + std::to_string(rank) + " " + operation + ": " + std::string(fault_name(fault)) + ": " + detail),
        rank_(rank), operation_(std::move(operation)), fault_(fault), detail_(detail) {}
  int rank() const { return rank_; }
  const std::string& operation() const { return operation_; }
  ExchangeFault fault() const { return fault_; }
  const std::string& detail() const { return detail_; }
  static std::string_view fault_name(ExchangeFault f) {
    switch (f) {
      case ExchangeFault::timeout: return "timeout";
      case ExchangeFault::mismatch: return "mismatch";
      case ExchangeFault::invalid_argument: return "invalid_argument";
      case ExchangeFault::aborted: return "aborted";
    }
    return "unknown";
  }

 private:
  int rank_;
  std::string operation_;
  ExchangeFault fault_;
  std::string detail_;
};

// Token: what a send carries to its receiver (e.g. a "data ready" event) and what the receiver hands back ("copy
// done" event); an empty struct for host copies.
template <class Token>
class Rendezvous {
 public:
  Rendezvous(int size, std::chrono::milliseconds timeout) : size_(size), timeout_(timeout) {}
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // One grouped exchange of `rank`. make_token(): the sender's token of this call (called once, before posting).
  // copy(dst, src, bytes, sender_token) -> receiver token: performs/enqueues one receive. after(receiver_token):
  // called by the sender for each of its consumed sends (e.g. its stream waits on the copy's event).
  template <class MakeToken, class Copy, class After>
  void exchange(int rank, const std::string& operation, const std::vector<PostedSend>& sends,
                const std::vector<WantedRecv>& recvs, MakeToken&& make_token, Copy&& copy, After&& after) {
    for (const PostedSend& s : sends) check_peer(rank, operation, s.peer, "send to");
    for (const WantedRecv& r : recvs) check_peer(rank, operation, r.peer, "receive from");
    std::vector<std::shared_ptr<Entry>> mine;
    if (!sends.empty()) {
      const Token token = make_token();
      std::lock_guard<std::mutex> lock(mutex_);
      throw_if_aborted(rank, operation);
      for (const PostedSend& s : sends) {
        auto e = std::make_shared<Entry>();
        e->data = s.data;
        e->bytes = s.bytes;
        e->sender_token = token;
        const int64_t seq = send_count_[{rank, s.peer}]++;
        e->seq = seq;
        posted_[{rank, s.peer, seq}] = e;
        mine.push_back(e);
      }
      cv_.notify_all();
    }
    for (const WantedRecv& r : recvs) {
      std::shared_ptr<Entry> e;
      int64_t seq = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        seq = recv_count_[{r.peer, rank}]++;
        const Key key{r.peer, rank, seq};
        const bool arrived = cv_.wait_for(lock, timeout_, [&] { return aborted_ || posted_.count(key) > 0; });
        throw_if_aborted(rank, operation);
        if (!arrived) {
          lock.unlock();
          fail(rank, operation, ExchangeFault::timeout,
               "no matching send from rank " + std::to_string(r.peer) + " (message " + std::to_string(seq) +
                   " of that pair) within " + std::to_string(timeout_.count()) + " ms");
        }
        e = posted_[key];
        posted_.erase(key);
      }
      if (e->bytes != r.bytes) {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          e->failed = true;
          cv_.notify_all();
        }
        fail(rank, operation, ExchangeFault::mismatch,
             "receive of " + std::to_string(r.bytes) + " bytes from rank " + std::to_string(r.peer) +
                 " matches a send of " + std::to_string(e->bytes) + " bytes (message " + std::to_string(seq) + ")");
      }
      Token done = copy(r.data, e->data, r.bytes, e->sender_token);
      std::lock_guard<std::mutex> lock(mutex_);
      e->receiver_token = std::move(done);
      e->consumed = true;
      cv_.notify_all();
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      const std::shared_ptr<Entry>& e = mine[i];
      std::unique_lock<std::mutex> lock(mutex_);
      const bool done = cv_.wait_for(lock, timeout_, [&] { return aborted_ || e->consumed || e->failed; });
      throw_if_aborted(rank, operation);
      lock.unlock();
      if (e->failed)
        fail(rank, operation, ExchangeFault::mismatch,
             "send of " + std::to_string(e->bytes) + " bytes to rank " + std::to_string(sends[i].peer) +
                 " met a receive of another size");
      if (!done)
        fail(rank, operation, ExchangeFault::timeout,
             "send to rank " + std::to_string(sends[i].peer) + " (message " + std::to_string(e->seq) +
                 " of that pair) not received within " + std::to_string(timeout_.count()) + " ms");
      after(e->receiver_token);
    }
  }

  // Makes every waiting and later call fail with ExchangeFault::aborted (after a fault of one rank).
  void abort() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    cv_.notify_all();
  }
  bool aborted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_;
  }

 private:
  struct Entry {
    const void* data = nullptr;
    size_t bytes = 0;
    int64_t seq = 0;
    Token sender_token{}, receiver_token{};
    bool consumed = false, failed = false;
  };
  struct Key {
    int from, to;
    int64_t seq;
    bool operator<(const Key& o) const {
      return from != o.from ? from < o.from : (to != o.to ? to < o.to : seq < o.seq);
    }
  };

  void check_peer(int rank, const std::string& operation, int peer, const char* what) {
    if (peer < 0 || peer >= size_)
      fail(rank, operation, ExchangeFault::invalid_argument,
           std::string(what) + " rank " + std::to_string(peer) + " outside [0, " + std::to_string(size_) + ")");
  }
  void throw_if_aborted(int rank, const std::string& operation) {
    if (aborted_) throw ExchangeError(rank, operation, ExchangeFault::aborted, "aborted by a fault of another rank");
  }
  // A fault aborts the exchange for everybody: the peers fail promptly instead of waiting out their timeout.
  [[noreturn]] void fail(int rank, const std::string& operation, ExchangeFault fault, const std::string& detail) {
    abort();
    throw ExchangeError(rank, operation, fault, detail);
  }

  int size_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool aborted_ = false;
  std::map<std::pair<int, int>, int64_t> send_count_, recv_count_;
  std::map<Key, std::shared_ptr<Entry>> posted_;
};

}  // namespace cpgold::sim
