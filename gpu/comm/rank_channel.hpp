#pragma once
// The host-side channel between the ranks of one multi-GPU run, beside NCCL: it hands out NCCL's unique id,
// compares the ranks' case hashes before any collective, gathers every rank's verdict at rank 0, and carries a
// failing rank's identity and message to the others (the side channel of the fault contract: a rank waiting on
// NCCL learns that a peer failed instead of waiting for a message that never comes). Three transports:
//  - threads of one process (one thread per GPU, no launcher): shared memory;
//  - one process per GPU under mpirun: MPI (gpu/comm/rank_channel_mpi.cpp, built when MPI is found);
//  - one process per GPU under any other launcher, across nodes too: files in a shared folder.
// No call waits longer than its timeout; every wait also watches for faults posted by other ranks.
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace cpgold::gpu {

using Seconds = std::chrono::duration<double>;

// The rank whose failure stops the run, and its message. A rank that stops because it learnt of another rank's
// failure re-posts that fault (so every rank names the rank that failed first, not the messenger).
struct RankFault {
  int rank = -1;
  std::string message;
};

// Thrown on a rank that learns that rank `failing_rank` failed, or whose wait ran out (failing_rank -1 when the
// silent ranks cannot be told apart). what() names the failing rank, the operation and the cause.
class RankFailure : public std::runtime_error {
 public:
  RankFailure(int failing_rank, const std::string& message) : std::runtime_error(message), failing_rank_(failing_rank) {}
  int failing_rank() const { return failing_rank_; }

 private:
  int failing_rank_;
};

class RankChannel {
 public:
  virtual ~RankChannel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string transport() const = 0;  // "threads", "mpi", "folder"

  // Every rank's `mine`, indexed by rank (called by all ranks in the same order). `what` names the exchange in
  // errors. RankFailure when another rank posted a fault or `timeout` passes (naming the ranks not heard from).
  virtual std::vector<std::string> all_gather(const std::string& mine, const std::string& what, Seconds timeout) = 0;
  // Tells every other rank that this rank stopped because of `fault` (its own failure: fault.rank == rank()).
  // Only the first post of a rank counts.
  virtual void post_fault(const RankFault& fault) = 0;
  // A fault posted by another rank, if any, preferring a rank's own failure over a re-post (cheap: called in
  // NCCL wait loops).
  virtual std::optional<RankFault> poll_fault() = 0;
  // Before a failing process exits: waits (at most `timeout`) until every other rank has posted a fault too, so
  // that a launcher that kills the job when one process exits (mpirun) cannot silence a rank before it has said
  // why it stops. Returns the ranks that never answered.
  virtual std::vector<int> wait_for_all_faults(Seconds timeout) = 0;
};

// "60 s", "0.5 s": a timeout in errors.
std::string seconds_text(Seconds seconds);

// Throws RankFailure naming the peer if another rank posted a fault.
void throw_if_peer_failed(RankChannel& channel, const std::string& operation);

// --- one process, one thread per rank ---------------------------------------------------------------------------
// The state the threads share; create one per run and give every thread its channel(rank).
class ThreadRendezvous {
 public:
  explicit ThreadRendezvous(int size);
  ~ThreadRendezvous();
  std::unique_ptr<RankChannel> channel(int rank);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// --- one process per rank, files in a shared folder -------------------------------------------------------------
// folder: empty (or new) at the start of the run and visible to every rank (a shared file system across nodes);
// messages are files written under a temporary name and renamed into place. InputError for a bad rank or size.
std::unique_ptr<RankChannel> make_folder_channel(const std::string& folder, int rank, int size);

// --- one process per rank, MPI ----------------------------------------------------------------------------------
// True when this build has the MPI transport.
bool mpi_available();
// Initialises MPI (once per process) and returns the channel over MPI_COMM_WORLD; finalize_mpi() at a normal end.
// InputError when the build has no MPI.
std::unique_ptr<RankChannel> make_mpi_channel();
void finalize_mpi();
// Ends the whole MPI job with `code` (after every rank has reported); no-op without MPI.
[[noreturn]] void abort_mpi(int code);
// True when the process was started by mpirun (OpenMPI's or PMIx's rank variables are set).
bool started_by_mpirun();

}  // namespace cpgold::gpu
