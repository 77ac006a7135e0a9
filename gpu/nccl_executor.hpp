#pragma once
// The NCCL CP executor: one rank of the one CP orchestration (sim/cp_program.hpp) on this process's current GPU,
// exchanging through a Communicator (gpu/nccl_communicator.hpp for several GPUs). Same numerics as the single-GPU
// executor (gpu/cp_executor.hpp): attention partials in the case dtype with float32 LSE, merges and dQ/dK/dV/dKV
// accumulation in float32, outputs rounded once to the dtype, pad rows exactly zero.
#include "gpu/communicator.hpp"
#include "gpu/cp_executor.hpp"
#include "sim/case_inputs.hpp"
#include "sim/executor.hpp"
#include "sim/plan.hpp"

namespace cpgold::gpu {

// This rank's outputs (rank-local layout, host float32 holding dtype values). inputs: the global inputs (the rank
// takes its own shards). comm: size plan.cp_size, rank `rank`; every rank calls this with the same plan.
// CommError for exchange faults (rank, operation), std::runtime_error for CUDA / kernel failures naming rank and step.
sim::RankOutputs<float> run_cp_rank(const sim::Plan& plan, const sim::CaseInputs& inputs, int rank, Communicator& comm,
                                    DType dtype, const CpGpuOptions& options);

}  // namespace cpgold::gpu
