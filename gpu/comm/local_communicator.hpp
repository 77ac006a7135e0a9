#pragma once
// The single-GPU communicator: W ranks on one device, each with its own non-blocking CUDA stream, driven by its own
// host thread. A message is a device-to-device copy enqueued on the receiver's stream after the sender's "data
// ready" event; the sender's stream then waits on the copy's event, so neither side reuses a buffer early. Sends
// and receives are matched by a host rendezvous (sim/program/rendezvous.hpp): a receive with no matching send, a send
// nobody receives, or a size mismatch fails with CommError naming the rank and the operation after at most the
// timeout, and aborts the peers' waits instead of leaving them hanging.
#include <memory>
#include <vector>

#include "gpu/comm/communicator.hpp"

namespace cpgold::gpu {

// One communicator per rank 0..W-1 on the current CUDA device (each with a fresh stream, destroyed with it). All
// of them must outlive every operation enqueued through any of them.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int size, const CommOptions& options = {});

}  // namespace cpgold::gpu
