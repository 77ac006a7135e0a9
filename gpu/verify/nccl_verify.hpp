#pragma once
// `cpgold verify --backend nccl`, one rank's part: every rank reads the fixture, the ranks agree on the case (hash of
// the case, layout, W and options), each rank runs its own part of the fixture's comm type on its GPU through the
// NCCL communicator, checks its outputs against /ranks/<r> with the check engine, and rank 0 prints one combined
// table, one verdict line and every rank's output digest (the bits of O, LSE, dQ, dK, dV; for comparing reruns). The same verdict is returned on every rank.
#include <functional>
#include <string>
#include <vector>

#include "gpu/comm/communicator.hpp"
#include "gpu/comm/nccl_ranks.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "gpu/verify/fixture_verify.hpp"
#include "gpu/verify/nccl_exchange_check.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/program/executor.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::gpu {

// One rank's run of a plan: this rank's outputs in the rank-local layout (float32 on the host), computed on the
// calling thread's current device through `comm` (the CP communicator of the run, size = plan.cp_size).
// inputs: the global inputs (each rank takes its own shards).
using RankRunner = std::function<sim::RankOutputs<float>(const sim::Plan& plan, const sim::CaseInputs& inputs, int rank,
                                                      Communicator& comm, DType dtype, BackwardMode mode)>;

struct NcclVerifyOptions {
  BackwardMode mode = BackwardMode::atomic;
  ExchangeFault inject_failure;  // self-test: that rank fails before its first exchange
  int inject_mismatch = -1;      // self-test: that rank describes another case
};

// Returns the verdict of `fixture_path` (the same on every rank). Unsupported: outside the GPU capability table, or
// cp_size != the number of ranks (named in the reason). InputError for unusable fixtures and a case mismatch.
FixtureVerdict verify_fixture_on_rank(RankContext& context, Communicator& comm, const std::string& fixture_path,
                                      const NcclVerifyOptions& options, const RankRunner& run);

// The whole `verify --backend nccl` on the ranks of this process (run_ranks): one NCCL communicator per rank for
// all fixtures, verify_fixture_on_rank for each, and rank 0's summary line "verify: P passed, F failed, U
// unsupported (of N fixtures; backend nccl, W ranks (launch); backward mode M)". Returns the process's exit code:
// 0 when every fixture passed, 1 when one failed or was unsupported, 2/3 for bad input / a failed rank.
int verify_fixtures_nccl(const std::vector<std::string>& fixtures, const NcclVerifyOptions& options,
                         const RankLaunch& launch, const RankRunner& run);

}  // namespace cpgold::gpu
