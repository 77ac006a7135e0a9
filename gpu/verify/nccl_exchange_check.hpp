#pragma once
// Data movement of the multi-GPU CP paths, bit for bit: coded-value tensors pushed through every exchange the comm
// types use, on the real NCCL communicators, and checked one way against the expected global row ids.
// Each element is a 64-bit code of (origin rank, global row, head, dim); a receiver decodes what arrived and
// compares it with what the partition (sim/plan/partition.hpp) says must be there, so a wrong peer, a wrong block
// offset, a wrong head slice or a torn row names itself. The exchanges:
//  - p2p:        the KV ring (W - 1 steps, send to r + 1, receive from r - 1) and the backward's KV + dKV ring
//                (two buffers per grouped step);
//  - all_gather: all-gather of the rank-local shards; reduce-scatter of float32 sums (each rank contributes
//                (rank + 1) x an integer code, so the exact sum W(W+1)/2 x code proves every rank was added once);
//  - a2a:        head-scatter / sequence-gather (block j of rank i goes to rank j) and its reverse;
//  - a2a+p2p:    ncclCommSplit into a2a groups of consecutive ranks and p2p rings across them; the a2a inside each
//                group, then the ring over the P-way shards.
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/comm/nccl_communicator.hpp"
#include "gpu/comm/nccl_ranks.hpp"

namespace cpgold::gpu {

struct ExchangeResult {
  std::string exchange;   // "p2p kv ring step 1", "a2a head scatter", ...
  int64_t elements = 0;   // elements checked on this rank
  int64_t wrong = 0;
  std::string first_wrong;  // "row 12 head 1 dim 3: got (rank 0, global row 7, head 1, dim 3), expected (...)"
};

// Deliberate faults, as a self-test of the fault path (documented in docs/cli-gpu.md).
struct ExchangeFault {
  int rank = -1;             // the rank that misbehaves; -1: none
  std::string kind;          // "exception", "cuda", "input" (fails before the all-gather, peers wait inside NCCL)
};

// Runs every exchange on `world` (all ranks call it) with a2a groups of `a2a_size` consecutive ranks for a2a+p2p
// (skipped when a2a_size does not divide W or is 1). Returns this rank's results.
// "RANK:KIND" of --inject-failure ("" = none; KIND defaults to exception). InputError naming the flag otherwise.
ExchangeFault parse_exchange_fault(const std::string& text);

// Makes rank `rank` fail as `fault` says when fault.rank == rank: throws (exception), reports bad input
// (InputError), or hits and reports a real CUDA error (a copy from an address that is no allocation).
void inject_fault(const ExchangeFault& fault, int rank);

// Runs on any implementation of the communicator contract (NCCL here, the local one alike).
std::vector<ExchangeResult> check_exchanges(Communicator& world, int a2a_size, const ExchangeFault& fault = {});

// The layout the check runs on (padded lengths multiples of 2W for W up to 8), as a text for case agreement.
std::string exchange_layout_description(int world_size, int a2a_size);

// One rank's whole run of `cpgold nccl-check`: case agreement (mismatch_rank describes another case, as a self-test),
// the world communicator, check_exchanges, and every rank's results gathered on every rank.
struct ExchangeCheckRun {
  int a2a_size = 2;
  ExchangeFault fault;
  int mismatch_rank = -1;
};
struct ExchangeVerdict {
  std::string table;  // one line per (rank, exchange)
  int64_t exchanges = 0, elements = 0, wrong = 0;
  bool pass() const { return wrong == 0 && exchanges > 0; }
};
ExchangeVerdict run_exchange_check(RankContext& context, const ExchangeCheckRun& run);

// One result line per rank result, rendered on rank 0 from every rank's serialised results.
std::string serialise(const std::vector<ExchangeResult>& results);
std::vector<ExchangeResult> deserialise(const std::string& bytes);

}  // namespace cpgold::gpu
