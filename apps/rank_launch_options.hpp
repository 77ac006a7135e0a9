#pragma once
// The command-line options that start the ranks of a multi-GPU (NCCL) run, shared by `verify --backend nccl` and
// `nccl-check` (gpu/comm/nccl_ranks.hpp says what each launch mode does).
#include <CLI/CLI.hpp>
#include <string>

#if CPGOLD_HAVE_NCCL
#include "gpu/comm/nccl_ranks.hpp"
#endif

namespace cpgold::app {

struct RankLaunchOptions {
  std::string launch = "auto";
  int ranks = 0;
  std::string rendezvous;
  int rank = -1, world_size = -1, device = -1;
  double timeout_s = 60;
};

inline void add_rank_launch_options(CLI::App& sub, RankLaunchOptions& o) {
  sub.add_option("--launch", o.launch,
                 "nccl ranks: auto (mpi under mpirun, else threads), threads (one per GPU), mpi, folder");
  sub.add_option("--ranks", o.ranks, "threads: number of ranks (default: every visible GPU)");
  sub.add_option("--rendezvous", o.rendezvous, "folder: a new, empty folder every rank can read and write");
  sub.add_option("--rank", o.rank, "folder: this process's rank");
  sub.add_option("--world-size", o.world_size, "folder: number of ranks");
  sub.add_option("--device", o.device, "mpi/folder: CUDA device of this process (default: node-local rank)");
  sub.add_option("--timeout", o.timeout_s, "seconds any rank waits for the others before it aborts (default 60)");
}

#if CPGOLD_HAVE_NCCL
// How gpu::run_ranks starts the ranks, from the options (no callback at each rank's end).
inline gpu::RankLaunch rank_launch(const RankLaunchOptions& o) {
  return {.launch = o.launch, .ranks = o.ranks, .rendezvous = o.rendezvous, .rank = o.rank,
          .world_size = o.world_size, .device = o.device, .timeout = gpu::Seconds(o.timeout_s), .on_rank_end = {}};
}
#endif

}  // namespace cpgold::app
