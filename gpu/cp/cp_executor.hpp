#pragma once
// GPU CP executor: the one CP orchestration (sim/program/cp_program.hpp) over a device backend, one backend per rank, each
// exchanging through a Communicator (gpu/comm/communicator.hpp) on its own stream. With make_local_communicators all W
// ranks run on one device (one host thread each); run_cp_rank runs one rank of the same backend over any
// communicator (NCCL: one rank per GPU thread or process, gpu/verify/nccl_verify.hpp).
// Numerics: attention partials in the case dtype with float32 LSE (the kernels of gpu/kernels/attention/attention.hpp), merges
// and dQ/dK/dV/dKV accumulation in float32, outputs rounded once to the dtype, pad rows exactly zero (LSE -inf).
#include <memory>

#include "gpu/comm/communicator.hpp"
#include "gpu/cp/cp_options.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/program/executor.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::gpu {

// The shape check of a plan's case: Status::unsupported outside the kernels' capability table.
Outcome cp_capability(const sim::Plan& plan, DType dtype, const sim::CaseInputs& inputs);

// W ranks of `plan` on the current device. Holds the ranks' communicators, streams, uploaded shards and the attention
// plans of their tiles, so that run() can be repeated (benchmarks). Throws CommError (rank, operation) for exchange
// faults, std::runtime_error for CUDA / kernel failures naming rank and step, std::logic_error for plan faults.
class LocalCpExecutor {
 public:
  LocalCpExecutor(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, const CpGpuOptions& options);
  ~LocalCpExecutor();
  LocalCpExecutor(const LocalCpExecutor&) = delete;
  LocalCpExecutor& operator=(const LocalCpExecutor&) = delete;

  // Runs every rank once; with download, returns the per-rank outputs (host float holding dtype values) and the
  // trace; without, waits for the device and returns an empty run (timing).
  sim::CpRun<float> run(bool download = true);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// One rank of a CP run, for drivers with one rank per thread or process (`verify --backend nccl`): `comm` is this
// rank's communicator (size = plan.cp_size, rank = the CP rank) on the current device. Uploads the rank's shards of
// `inputs`, runs the per-rank program on comm.stream(), waits for it and returns the rank's outputs (host float of
// the dtype's values) and, with options.record_trace, its step records (in step order). Errors as LocalCpExecutor.
struct RankRun {
  sim::RankOutputs<float> outputs;
  sim::Trace<float> trace;
  RankTimes times;
};
RankRun run_cp_rank(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, Communicator& comm,
                    const CpGpuOptions& options);

// run_cp_rank that can be repeated (benchmarks): the rank's shards are uploaded and its attention plans built once.
class RankCpExecutor {
 public:
  RankCpExecutor(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, Communicator& comm,
                 const CpGpuOptions& options);
  ~RankCpExecutor();
  RankCpExecutor(const RankCpExecutor&) = delete;
  RankCpExecutor& operator=(const RankCpExecutor&) = delete;

  // One run of this rank; without download only the times (and no outputs) are returned.
  RankRun run(bool download = true);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// One-shot form of LocalCpExecutor.
sim::CpRun<float> run_cp_local(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype,
                               const CpGpuOptions& options);

}  // namespace cpgold::gpu
