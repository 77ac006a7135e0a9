#pragma once
// The command-line options that start the ranks of a multi-GPU (NCCL) run, shared by `verify --backend nccl` and
// `nccl-check` (gpu/comm/nccl_ranks.hpp says what each launch mode does).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

namespace cpgold::app {

struct RankLaunchOptions {
  std::string launch = "auto";
  int ranks = 0;
  std::string rendezvous;
  int rank = -1, world_size = -1, device = -1;
  double timeout_s = 60;
};

inline void add_rank_launch_options(CLI::App* sub, const std::shared_ptr<RankLaunchOptions>& o) {
  sub->add_option("--launch", o->launch,
                  "nccl ranks: auto (mpi under mpirun, else threads), threads (one per GPU), mpi, folder");
  sub->add_option("--ranks", o->ranks, "threads: number of ranks (default: every visible GPU)");
  sub->add_option("--rendezvous", o->rendezvous, "folder: a new, empty folder every rank can read and write");
  sub->add_option("--rank", o->rank, "folder: this process's rank");
  sub->add_option("--world-size", o->world_size, "folder: number of ranks");
  sub->add_option("--device", o->device, "mpi/folder: CUDA device of this process (default: node-local rank)");
  sub->add_option("--timeout", o->timeout_s, "seconds any rank waits for the others before it aborts (default 60)");
}

}  // namespace cpgold::app
