// The host rendezvous under the CPU simulator and the single-GPU communicator: matched messages are copied,
// a receive without a send or a send without a receive fails with a timeout naming rank, operation and peer, a size
// mismatch names both sizes, and one rank's fault releases the others (aborted) instead of leaving them waiting.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "sim/program/rendezvous.hpp"

using namespace cpgold::sim;

namespace {
struct NoToken {};
using HostRendezvous = Rendezvous<NoToken>;

// Runs body(rank) on W threads; returns each rank's error text ("" when none).
template <class Body>
std::vector<std::string> on_threads(int W, Body body) {
  std::vector<std::string> errors(static_cast<size_t>(W));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const ExchangeError& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

void exchange(HostRendezvous& rv, int rank, const std::vector<PostedSend>& s, const std::vector<WantedRecv>& r) {
  rv.exchange(
      rank, "send_recv", s, r, [] { return NoToken{}; },
      [](void* dst, const void* src, size_t bytes, const NoToken&) {
        std::memcpy(dst, src, bytes);
        return NoToken{};
      },
      [](const NoToken&) {});
}
}  // namespace

TEST_CASE("rendezvous: a ring shift in one call delivers every rank's buffer to the next rank") {
  const int W = 5;
  HostRendezvous rv(W, std::chrono::seconds(10));
  std::vector<int> got(W, -1);
  const auto errors = on_threads(W, [&](int r) {
    int mine = 100 + r;
    exchange(rv, r, {{(r + 1) % W, &mine, sizeof mine}}, {{(r + W - 1) % W, &got[static_cast<size_t>(r)], sizeof(int)}});
  });
  for (int r = 0; r < W; ++r) {
    CHECK(errors[static_cast<size_t>(r)].empty());
    CHECK(got[static_cast<size_t>(r)] == 100 + (r + W - 1) % W);
  }
}

TEST_CASE("rendezvous: a receive without a matching send is a timeout naming rank, operation and peer") {
  HostRendezvous rv(2, std::chrono::milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(2, [&](int r) {
    int x = 0;
    if (r == 0) exchange(rv, 0, {}, {{1, &x, sizeof x}});
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(errors[0].find("rank 0 send_recv: timeout") != std::string::npos);
  CHECK(errors[0].find("rank 1") != std::string::npos);
  CHECK(errors[1].empty());
}

TEST_CASE("rendezvous: a send nobody receives times out on the sender, a size mismatch is named on both sides") {
  {
    HostRendezvous rv(2, std::chrono::milliseconds(200));
    const auto errors = on_threads(2, [&](int r) {
      int x = 1;
      if (r == 1) exchange(rv, 1, {{0, &x, sizeof x}}, {});
    });
    CHECK(errors[1].find("rank 1 send_recv: timeout: send to rank 0") != std::string::npos);
  }
  {
    HostRendezvous rv(2, std::chrono::seconds(10));
    const auto errors = on_threads(2, [&](int r) {
      double x = 1;
      if (r == 0) exchange(rv, 0, {{1, &x, sizeof x}}, {});
      else exchange(rv, 1, {}, {{0, &x, 4}});
    });
    CHECK(errors[1].find("rank 1 send_recv: mismatch: receive of 4 bytes from rank 0 matches a send of 8 bytes") !=
          std::string::npos);
    CHECK(!errors[0].empty());  // the sender learns of it (mismatch or aborted), it does not wait out the timeout
  }
}

TEST_CASE("rendezvous: one rank's fault releases the peers waiting on it (aborted), long before their timeout") {
  HostRendezvous rv(3, std::chrono::seconds(30));
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(3, [&](int r) {
    int x = 0;
    if (r == 0) exchange(rv, 0, {{7, &x, sizeof x}}, {});  // bad peer: invalid_argument, aborts
    if (r == 1) exchange(rv, 1, {}, {{2, &x, sizeof x}});  // waits for rank 2, which never sends
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  CHECK(errors[0].find("invalid_argument: send to rank 7 outside [0, 3)") != std::string::npos);
  CHECK(errors[1].find("rank 1 send_recv: aborted") != std::string::npos);
}
