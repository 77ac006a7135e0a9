// GPU CP executor: the single-GPU driver (W ranks on one device) and the one-rank driver over any communicator, both
// running the per-rank CP program (sim/program/cp_program.hpp) over DeviceRankBackend (gpu/cp/device_rank_backend.hpp).
#include "gpu/cp/cp_executor.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/comm/local_communicator.hpp"
#include "gpu/cp/device_rank_backend.hpp"
#include "sim/program/cp_program.hpp"

namespace cpgold::gpu {

namespace {

// Each rank starts with only its own rows of the global inputs (thd_get_partitioned_indices).
void upload_shards(DeviceRankBackend& b, const sim::Plan& plan, const sim::CaseInputs& inputs) {
  const int r = b.rank();
  b.upload_input(sim::Payload::q, sim::shard_rows(plan.partition.q, r, inputs.q));
  b.upload_input(sim::Payload::k, sim::shard_rows(plan.partition.kv, r, inputs.k));
  b.upload_input(sim::Payload::v, sim::shard_rows(plan.partition.kv, r, inputs.v));
  b.upload_input(sim::Payload::dout, sim::shard_rows(plan.partition.q, r, inputs.dout));
}

// The ranks allocate their step buffers stream-ordered; with the default release threshold (0) the pool returns its
// memory to the driver at every synchronisation and each run pays for fresh physical pages. With accumulate_aside, a
// block freed on the accumulation stream is not handed to an allocation on the compute stream by making the compute
// stream wait for that free (the pool's internal dependencies would tie step i + 1's attention to step i's
// accumulation); the pool takes other memory instead, or the block once its free has completed. (The attribute is the
// device pool's, so it stays for the rest of the process.)
void keep_pool_memory(int device, bool accumulate_aside) {
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    if (accumulate_aside) {
      int no = 0;
      cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no);
    }
  }
}

}  // namespace

Outcome cp_capability(const sim::Plan& plan, DType dtype, const sim::CaseInputs& inputs) {
  if (dtype != DType::bf16 && dtype != DType::fp16)
    return {Status::unsupported, "dtype " + std::string(dtype_name(dtype)) + ": the GPU runs bf16 and fp16"};
  return check_capability({dtype, plan.heads_q, plan.heads_kv, static_cast<int>(inputs.q.dim),
                           static_cast<int>(inputs.v.dim)});
}

struct LocalCpExecutor::State {
  sim::Plan plan;  // the tiles' addresses key the attention plans
  DType dtype;
  CpGpuOptions options;
  int device = 0;
  std::vector<std::unique_ptr<Communicator>> comms;         // destroyed after the backends (their streams)
  std::vector<std::unique_ptr<DeviceRankBackend>> backends;
};

LocalCpExecutor::LocalCpExecutor(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype,
                                 const CpGpuOptions& options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.plan = plan;
  s.dtype = dtype;
  s.options = options;
  if (const Outcome cap = cp_capability(plan, dtype, inputs); !cap.ok())
    throw std::invalid_argument("GPU CP: " + std::string(status_name(cap.status)) + ": " + cap.message);
  if (cudaGetDevice(&s.device) != cudaSuccess) throw std::runtime_error("GPU CP: no CUDA device");
  keep_pool_memory(s.device, options.accumulate_aside);
  CommOptions comm_options;
  comm_options.timeout = options.timeout;
  const int W = plan.cp_size;
  s.comms = make_local_communicators(W, comm_options);
  for (int r = 0; r < W; ++r) {
    auto b = std::make_unique<DeviceRankBackend>(r, *s.comms[static_cast<size_t>(r)], dtype, options);
    upload_shards(*b, s.plan, inputs);
    s.backends.push_back(std::move(b));
  }
}

LocalCpExecutor::~LocalCpExecutor() = default;

sim::CpRun<float> LocalCpExecutor::run(bool download) {
  State& s = *state_;
  const int W = s.plan.cp_size;
  sim::CpRun<float> out;
  out.ranks.resize(static_cast<size_t>(W));
  // One reference for every rank's timeline: recorded on rank 0's idle stream before any rank starts.
  const EventRef timeline_zero = s.options.timeline ? s.backends[0]->timing_event() : nullptr;
  sim::run_rank_threads(
      W,
      [&](int g) {
        cudaSetDevice(s.device);
        DeviceRankBackend& b = *s.backends[static_cast<size_t>(g)];
        b.trace = {};
        try {
          b.begin_run();
          sim::RankResult<DeviceRankBackend> r = sim::run_rank(s.plan, b, s.options.backward);
          b.join_streams();
          s.comms[static_cast<size_t>(g)]->synchronize();
          b.collect_timeline(timeline_zero);
          if (download) {
            sim::RankOutputs<float>& mine = out.ranks[static_cast<size_t>(g)];
            mine.o = b.to_host(r.o);
            mine.lse = b.to_host(r.lse);
            if (s.options.backward) {
              mine.dq = b.to_host(r.dq);
              mine.dk = b.to_host(r.dk);
              mine.dv = b.to_host(r.dv);
            }
          }
        } catch (const CommError& e) {
          // A rank that only saw another rank's fault reports it as secondary (the fault's own rank is reported).
          if (e.fault() == CommFault::aborted)
            throw sim::ExchangeError(e.rank(), std::string(comm_op_name(e.operation())), sim::ExchangeFault::aborted,
                                     e.what());
          throw;
        }
      },
      [&] {
        for (auto& c : s.comms) c->abort();
      });
  if (download && s.options.record_trace) {
    std::vector<std::vector<sim::ForwardStepTrace<float>>> fwd;
    std::vector<std::vector<sim::BackwardStepTrace<float>>> bwd;
    for (auto& b : s.backends) {
      fwd.push_back(std::move(b->trace.forward));
      bwd.push_back(std::move(b->trace.backward));
    }
    out.trace.forward = sim::by_step_then_rank(fwd);
    out.trace.backward = sim::by_step_then_rank(bwd);
  }
  return out;
}

struct RankCpExecutor::State {
  sim::Plan plan;  // the tiles' addresses key the attention plans
  Communicator* comm = nullptr;
  CpGpuOptions options;
  std::unique_ptr<DeviceRankBackend> backend;
};

RankCpExecutor::RankCpExecutor(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, Communicator& comm,
                               const CpGpuOptions& options)
    : state_(std::make_unique<State>()) {
  if (comm.size() != plan.cp_size)
    throw std::invalid_argument("GPU CP: communicator size " + std::to_string(comm.size()) + " != cp_size " +
                                std::to_string(plan.cp_size));
  if (const Outcome cap = cp_capability(plan, dtype, inputs); !cap.ok())
    throw std::invalid_argument("GPU CP: " + std::string(status_name(cap.status)) + ": " + cap.message);
  State& s = *state_;
  s.plan = plan;
  s.comm = &comm;
  s.options = options;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("GPU CP: no CUDA device");
  keep_pool_memory(device, options.accumulate_aside);
  s.backend = std::make_unique<DeviceRankBackend>(comm.rank(), comm, dtype, options);
  upload_shards(*s.backend, s.plan, inputs);
}

RankCpExecutor::~RankCpExecutor() = default;

RankRun RankCpExecutor::run(bool download) {
  State& s = *state_;
  DeviceRankBackend& b = *s.backend;
  b.trace = {};
  RankRun out;
  b.begin_run();
  sim::RankResult<DeviceRankBackend> res = sim::run_rank(s.plan, b, s.options.backward);
  b.join_streams();
  s.comm->synchronize();  // bounded: a peer that fails or never arrives ends the wait with a CommError
  b.collect_timeline(nullptr);
  if (download) {
    out.outputs.o = b.to_host(res.o);
    out.outputs.lse = b.to_host(res.lse);
    if (s.options.backward) {
      out.outputs.dq = b.to_host(res.dq);
      out.outputs.dk = b.to_host(res.dk);
      out.outputs.dv = b.to_host(res.dv);
    }
  }
  out.trace = std::move(b.trace);
  out.times = b.times();
  return out;
}

RankRun run_cp_rank(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, Communicator& comm,
                    const CpGpuOptions& options) {
  RankCpExecutor executor(plan, inputs, dtype, comm, options);
  return executor.run(true);
}

sim::CpRun<float> run_cp_local(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype,
                               const CpGpuOptions& options) {
  LocalCpExecutor executor(plan, inputs, dtype, options);
  return executor.run(true);
}

}  // namespace cpgold::gpu
