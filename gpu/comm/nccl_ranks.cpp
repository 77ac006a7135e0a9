// run_ranks: threads, mpirun or a shared folder; the fault path of every rank (see the header).
#include "gpu/comm/nccl_ranks.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/comm/communicator.hpp"
#include "reference/input_error.hpp"

namespace cpgold::gpu {
namespace {

int visible_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

std::mutex print_mutex;

// One rank: runs the body, turns an exception into a posted fault and an error line. Returns the rank's exit code.
int run_one_rank(RankChannel& channel, int device, const RankLaunch& launch, const std::function<int(RankContext&)>& body) {
  const Seconds timeout = launch.timeout;
  const int rank = channel.rank();
  std::string message;
  int code = 0;
  RankFault fault{rank, ""};
  try {
    if (const cudaError_t error = cudaSetDevice(device); error != cudaSuccess)
      throw std::runtime_error("cudaSetDevice(" + std::to_string(device) + ") failed: " + cudaGetErrorString(error));
    RankContext context{channel, device, timeout};
    const int verdict = body(context);
    if (launch.on_rank_end) launch.on_rank_end(rank, verdict, "");
    return verdict;
  } catch (const RankFailure& failure) {
    // Another rank failed first (or nobody can tell: a timeout): pass its identity on.
    message = failure.what();
    fault.rank = failure.failing_rank() >= 0 ? failure.failing_rank() : rank;
    code = kExitRankFault;
  } catch (const InputError& error) {
    message = std::string("rank ") + std::to_string(rank) + ": " + error.what();
    code = 2;
  } catch (const CommError& error) {
    message = error.what();  // names the rank already
    code = kExitRankFault;
    // A communicator aborted on a peer's fault, or out of time: pass the failing rank on where one is known.
    if (error.fault() == CommFault::aborted || error.fault() == CommFault::timeout)
      if (const std::optional<RankFault> peer = channel.poll_fault()) fault.rank = peer->rank;
  } catch (const std::exception& error) {
    message = std::string("rank ") + std::to_string(rank) + ": " + error.what();
    code = kExitRankFault;
  }
  fault.message = message;
  channel.post_fault(fault);
  {
    std::lock_guard lock(print_mutex);
    std::fprintf(stderr, "rank %d: error: %s\n", rank, message.c_str());
    std::fflush(stderr);
  }
  if (launch.on_rank_end) launch.on_rank_end(rank, code, message);
  return code;
}

int node_local_rank(int fallback) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK", "SLURM_LOCALID"})
    if (const char* value = std::getenv(name)) return std::atoi(value);
  return fallback;
}

int pick_device(const RankLaunch& launch, int rank) {
  const int devices = visible_devices();
  if (launch.device >= 0) {
    if (launch.device >= devices) fail_input("--device", launch.device, " is not a visible CUDA device (", devices, " visible)");
    return launch.device;
  }
  if (devices == 0) fail_input("CUDA device", "none visible (the NCCL ranks need one GPU each)");
  return node_local_rank(rank) % devices;
}

}  // namespace

std::string resolve_launch(const std::string& launch) {
  if (launch == "auto") return started_by_mpirun() ? "mpi" : "threads";
  return launch;
}

int run_ranks(const RankLaunch& launch, const std::function<int(RankContext&)>& body) {
  if (launch.timeout.count() <= 0) fail_input("--timeout", "expected a positive number of seconds, got ", launch.timeout.count());
  const std::string mode = resolve_launch(launch.launch);
  if (mode == "threads") {
    const int devices = visible_devices();
    const int ranks = launch.ranks > 0 ? launch.ranks : devices;
    if (devices == 0) fail_input("CUDA device", "none visible (the NCCL ranks need one GPU each)");
    if (ranks > devices)
      fail_input("--ranks", ranks, " ranks need ", ranks, " CUDA devices, ", devices, " visible (one thread per GPU)");
    ThreadRendezvous rendezvous(ranks);
    std::vector<int> codes(static_cast<size_t>(ranks), 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        std::unique_ptr<RankChannel> channel = rendezvous.channel(r);
        codes[static_cast<size_t>(r)] = run_one_rank(*channel, r, launch, body);
      });
    for (std::thread& t : threads) t.join();
    int worst = 0;
    for (int c : codes) worst = std::max(worst, c);
    return worst;
  }
  if (mode == "mpi") {
    std::unique_ptr<RankChannel> channel = make_mpi_channel();
    const int code = run_one_rank(*channel, pick_device(launch, channel->rank()), launch, body);
    if (code >= 2) {
      // Faulted: stay until every rank has said why it stops, then end the job (a plain exit would let mpirun kill
      // ranks that have not printed yet; MPI_Finalize could wait on a rank that never comes).
      channel->wait_for_all_faults(launch.timeout);
      abort_mpi(code);
    }
    channel.reset();
    finalize_mpi();
    return code;
  }
  if (mode == "folder") {
    if (launch.world_size < 1) fail_input("--world-size", "folder launch needs the number of ranks, got ", launch.world_size);
    std::unique_ptr<RankChannel> channel = make_folder_channel(launch.rendezvous, launch.rank, launch.world_size);
    return run_one_rank(*channel, pick_device(launch, launch.rank), launch, body);
  }
  fail_input("--launch", "expected auto, threads, mpi or folder, got \"", launch.launch, "\"");
}

}  // namespace cpgold::gpu
