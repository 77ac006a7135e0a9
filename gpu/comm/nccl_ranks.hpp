#pragma once
// Starting the W ranks of a multi-GPU run, and what happens when one of them fails.
//  - threads: one process, one thread per visible GPU (or --ranks of them); no launcher.
//  - mpi:     one process per GPU started by `mpirun -np W`; the device is the node-local rank.
//  - folder:  one process per GPU started by anything (a shell loop, a batch system, one per node), each told its
//             --rank, the --world-size and a --rendezvous folder all ranks can read and write.
// Every rank runs the same body. A body that throws is a failing rank: it posts its identity and message on the
// rank channel, and every other rank stops at its next wait (NCCL or channel) with an error naming that rank; no
// rank waits longer than the timeout. Every rank prints its own error line ("rank R: error: ...") on stderr.
#include <functional>
#include <string>

#include "gpu/comm/rank_channel.hpp"

namespace cpgold::gpu {

struct RankLaunch {
  std::string launch = "auto";  // auto (mpi under mpirun, else threads), threads, mpi, folder
  int ranks = 0;                // threads: number of ranks (0: every visible GPU)
  std::string rendezvous;       // folder: the shared folder
  int rank = -1, world_size = -1;  // folder: this process's rank and the number of ranks
  int device = -1;              // folder/mpi: CUDA device of this process (-1: node-local rank mod device count)
  Seconds timeout{60};          // every wait of the run
  // Called on every rank of this process when its body ends: its exit code and, for a fault, its error line.
  std::function<void(int rank, int code, const std::string& error)> on_rank_end;
};

// What one rank's body gets.
struct RankContext {
  RankChannel& channel;
  int device = 0;
  Seconds timeout{60};
};

// Exit codes of a rank body: 0 pass, 1 fail (a verdict, not a fault). An exception is a fault: InputError exits 2,
// anything else (CUDA, NCCL, a peer's failure, a timeout) exits 3.
constexpr int kExitRankFault = 3;

// Runs `body` on the ranks of this process and returns the process's exit code (the worst over its ranks).
// InputError for inconsistent launch options (named by their flag). Under mpirun, a failing run ends the MPI job
// once every rank has reported (or the timeout passed).
int run_ranks(const RankLaunch& launch, const std::function<int(RankContext&)>& body);

// The launch mode `auto` resolves to here ("mpi" or "threads").
std::string resolve_launch(const std::string& launch);

}  // namespace cpgold::gpu
