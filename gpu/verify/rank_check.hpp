#pragma once
// Checking a multi-GPU run where it runs: every rank checks its own outputs (rank-local layout) against
// /ranks/<r> of the fixture with the engine of `cpgold check`, and sends a summary to rank 0, which prints one
// combined table (every rank's rows under one header), the details of every failing tensor and one verdict.
#include <cstdint>
#include <string>
#include <vector>

#include "sim/program/executor.hpp"

namespace cpgold::gpu {

struct RankCheck {
  int rank = -1;
  bool pass = false;       // every tensor of this rank within its budget (exact classes included)
  // Not pass, and nothing failed for certain: a fixture of another engine cannot decide (fx::CheckReport::undecided).
  bool undecided = false;
  int64_t compared = 0;    // elements compared under the budget rule; 0 for a rank that holds only padding
  bool no_valid_element = false;  // the fixture's batch holds no token at all (an empty batch, seqlens_q [0])
  std::string rows;     // the check table's rows of this rank's tensors (o@r1, lse@r1, ...)
  std::string details;  // worst element and first divergence of each failing tensor
};

// outputs: this rank's O [rows_q, h_q, d_v], LSE [h_q, rows_q], dQ, dK [rows_kv, h_kv, d_qk], dV as float32;
// candidate_path: where the per-rank candidate file is written (root attribute rank = `rank`).
// InputError for unusable fixtures.
RankCheck check_rank_outputs(const std::string& fixture_path, int rank, const sim::RankOutputs<float>& outputs,
                             const std::string& candidate_path);

std::string serialise(const RankCheck& check);
RankCheck deserialise_rank_check(const std::string& bytes);

// The combined verdict: every rank passes and the ranks together compared at least one element. A rank whose rows
// are all padding compares nothing under the budget rule (its pad rows are still checked to be exactly zero); that
// is a pass for the rank, while a run in which no rank compared anything proves nothing and fails, unless the fixture
// has no valid element at all (an empty batch passes on its exact rules, as in `cpgold check`).
bool combined_pass(const std::vector<RankCheck>& ranks);
// No rank failed for certain and some rank is undecided (a fixture of another engine than the CPU reference).
bool combined_undecided(const std::vector<RankCheck>& ranks);

// Rank 0's report: the header of `cpgold check`'s table once, every rank's rows in rank order, the failures'
// details, and "verdict: PASS|FAIL" (combined_pass).
std::string combined_report(const std::string& fixture_path, const std::vector<RankCheck>& ranks);

}  // namespace cpgold::gpu
