// Names, the error type and the a2a+p2p group split of the communicator contract (gpu/comm/communicator.hpp).
#include "gpu/comm/communicator.hpp"

namespace cpgold::gpu {

std::string_view comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::send_recv: return "send_recv";
    case CommOp::all_gather: return "all_gather";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::all_to_all: return "all_to_all";
    case CommOp::split: return "split";
    case CommOp::synchronize: return "synchronize";
    case CommOp::barrier: return "barrier";
  }
  return "unknown";
}

std::string_view comm_fault_name(CommFault fault) {
  switch (fault) {
    case CommFault::timeout: return "timeout";
    case CommFault::mismatch: return "mismatch";
    case CommFault::invalid_argument: return "invalid_argument";
    case CommFault::device_error: return "device_error";
    case CommFault::aborted: return "aborted";
  }
  return "unknown";
}

CommError::CommError(int rank, int size, CommOp op, CommFault fault, const std::string& detail)
    : std::runtime_error("rank " + std::to_string(rank) + " (of " + std::to_string(size) + ") " +
                         std::string(comm_op_name(op)) + ": " + std::string(comm_fault_name(fault)) + ": " + detail),
      rank_(rank), size_(size), op_(op), fault_(fault), detail_(detail) {}

CpGroups split_cp_groups(Communicator& cp, int a2a_size) {
  if (a2a_size < 1 || cp.size() % a2a_size != 0)
    throw CommError(cp.rank(), cp.size(), CommOp::split, CommFault::invalid_argument,
                    "a2a_size " + std::to_string(a2a_size) + " does not divide the communicator size " +
                        std::to_string(cp.size()));
  CpGroups groups;
  // Both splits are collective: every rank makes them in the same order.
  groups.a2a = cp.split(cp.rank() / a2a_size, cp.rank() % a2a_size);
  groups.p2p = cp.split(cp.rank() % a2a_size, cp.rank() / a2a_size);
  return groups;
}

}  // namespace cpgold::gpu
