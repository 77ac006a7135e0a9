#pragma once
// One message of a grouped exchange: `bytes` bytes from `data` on this rank to `peer` (a send) or from `peer` into
// `data` on this rank (a receive). bytes may be 0 (the message must still be matched). The host rendezvous
// (sim/program/rendezvous.hpp) and the GPU communicators (gpu/comm/communicator.hpp) exchange them.
#include <cstddef>

namespace cpgold::sim {

struct PostedSend {
  int peer = 0;
  const void* data = nullptr;
  size_t bytes = 0;
};
struct WantedRecv {
  int peer = 0;
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace cpgold::sim
