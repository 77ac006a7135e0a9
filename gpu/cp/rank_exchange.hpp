#pragma once
// The exchanges of one rank's CP program through its Communicator (gpu/comm/communicator.hpp), on the communication
// stream: an exchange starts once the compute stream has passed what was enqueued before it, and the compute stream
// waits for it only where the program finishes it, so what the program enqueues in between overlaps it. A sent buffer
// that the accumulation stream wrote last is waited for on the communication stream, not the compute stream.
#include <memory>
#include <vector>

#include "gpu/comm/communicator.hpp"
#include "gpu/cp/device_tensor.hpp"
#include "gpu/cp/rank_memory.hpp"
#include "gpu/cp/rank_streams.hpp"
#include "gpu/cp/rank_timing.hpp"

namespace cpgold::gpu {

class RankExchange {
 public:
  // One message of a grouped send/recv: a whole tensor or LSE to or from `peer` (exactly one of tensor / lse).
  struct Transfer {
    int peer = 0;
    const DeviceTensor* tensor = nullptr;
    const DeviceLse* lse = nullptr;
  };
  struct Pending {
    EventRef done;  // recorded on the communication stream after the exchange
    // The buffers the exchange reads and writes, held until the compute stream has waited for it: their memory is
    // freed (and may be reused) in the compute stream's order, so it must not be released while the communication
    // stream may still use it.
    std::vector<std::shared_ptr<DeviceMemory>> in_flight;
  };

  RankExchange(Communicator& comm, const RankStreams& streams, RankTiming& timing, RankMemory& memory)
      : comm_(comm), streams_(streams), timing_(timing), memory_(memory) {}
  RankExchange(const RankExchange&) = delete;
  RankExchange& operator=(const RankExchange&) = delete;

  // Enqueues the exchange and leaves it in flight: the program never writes the sent tensors nor reads the receive
  // buffers until finish. A receive overwrites its whole buffer (the communicator checks that the sizes match).
  Pending start(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs);
  // The compute stream waits for the exchange; with timing, the wait's span is the communication not hidden. The
  // buffers are released only after the wait is enqueued (see Pending::in_flight); the sent ones that the
  // accumulation stream wrote last are the compute stream's again (the exchange waited for that accumulation).
  void finish(Pending& p);

 private:
  // One grouped send/recv of whole tensors on the communication stream.
  void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs);

  Communicator& comm_;
  const RankStreams& streams_;
  RankTiming& timing_;
  RankMemory& memory_;
};

}  // namespace cpgold::gpu
