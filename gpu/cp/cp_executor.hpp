#pragma once
// GPU CP executor: the one CP orchestration (sim/cp_program.hpp) over a device backend, one backend per rank, each
// exchanging through a Communicator (gpu/comm/communicator.hpp) on its own stream. With make_local_communicators all W
// ranks run on one device (one host thread each); run_cp_rank runs one rank of the same backend over any
// communicator (NCCL: one rank per GPU thread or process, gpu/verify/nccl_verify.hpp).
// Numerics: attention partials in the case dtype with float32 LSE (the kernels of gpu/kernels/attention.hpp), merges
// and dQ/dK/dV/dKV accumulation in float32, outputs rounded once to the dtype, pad rows exactly zero (LSE -inf).
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu/kernels/attention.hpp"
#include "gpu/comm/communicator.hpp"
#include "gpu/cp/timeline.hpp"
#include "sim/case_inputs.hpp"
#include "sim/executor.hpp"
#include "sim/plan.hpp"

namespace cpgold::gpu {

struct StepRef {
  int rank = 0, step = 0;
};

// Device time per phase of a run (bench_cp_local's breakdown). With CpGpuOptions::phases set, every backend operation
// except the exchanges runs under one lock over all ranks, starting on a drained device and synchronised before the
// lock is released, so its event time is its own (up to exchange copies another rank enqueues meanwhile); an
// exchange is timed on the communication stream from before the rendezvous to after its copies (waits for peers
// included, the ranks' copies concurrent), outside the lock. bytes = bytes read + written.
// Serialises the run: for the breakdown, never for the wall time. The attention calls are kept apart by pass and
// step section, under attention_phase()'s names.
struct PhaseTimes {
  struct Entry {
    double ms = 0, bytes = 0;
    int64_t calls = 0;
  };
  std::mutex mutex;
  std::map<std::string, Entry> phases;
};

// "attention forward, lower" etc.: the PhaseTimes key of one pass's attention calls of one step section.
std::string attention_phase(sim::PassKind pass, sim::StepSection section);

struct CpGpuOptions {
  bool backward = true;
  bool record_trace = false;  // download every step's partials into CpRun::trace (synchronises per step)
  BackwardMode mode = BackwardMode::atomic;
  // Self-test of the checkers: adds 1 to the forward partial O of this rank and step (the first row of the tile's
  // first Q segment, all heads and dims) right after its attention call, before the trace and the merge see it.
  std::optional<StepRef> inject;
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  std::shared_ptr<PhaseTimes> phases;  // per-phase device times (serialises the ranks' operations)
  bool time_exchanges = false;  // CUDA events around every exchange and wait (RankRun::times)
  // Schedule (same results, bit for bit): run the float32 accumulation of the backward partials on a third stream
  // per rank, so that step i's accumulation (memory-bound) can run beside step i + 1's attention (compute-bound)
  // instead of after it. Off: everything but the exchanges in program order on the compute stream.
  bool accumulate_aside = false;
  // Summing backward (the p2p/a2a/a2a+p2p ring steps): each step's attention backward adds its dQ, dK, dV, rounded to
  // the dtype, straight into the rank's float32 sums (BackwardBuffers' RowSum) instead of writing partials that a
  // separate scatter_add adds: the same bits, one pass over the sums fewer. The step's dKV must then have arrived
  // before its attention starts. Not with record_trace (the trace needs the partials), where it is ignored.
  bool sum_in_backward = false;
  // Ring steps that read one half of the rank's tensors read it in place (the attention call's segments point into
  // the rank's tensors) instead of gathering it into a step tensor first: the forward's K/V halves (its Q halves are
  // gathered: the merge takes the step's O rows), and with sum_in_backward the backward's Q and K/V halves. The same
  // bits either way. (The summing backward also takes rowsum(dO * O) from one pass over the rank's O and dO.)
  bool read_halves_in_place = true;
  // With sum_in_backward: the step that adds last to a rank's dQ (dK, dV) over all of its rows writes the finished
  // sum in the dtype (RowSum::result) instead of float32 that a final conversion then reads. The same bits.
  bool last_sum_in_dtype = true;
  // Every operation's span on its stream, from CUDA events, without serialising (gpu/cp/timeline.hpp); appended to by
  // each run, in ms from a reference recorded before the ranks start (LocalCpExecutor) or from the rank's own run
  // start (run_cp_rank). Not with phases.
  std::shared_ptr<Timeline> timeline;
};

// Device time of one rank's run (CpGpuOptions::time_exchanges), from CUDA events, in milliseconds.
struct RankTimes {
  double run_ms = 0;      // compute stream: from the run's first operation to its last
  double comm_ms = 0;     // communication stream: sum over exchanges, each from when its inputs were ready to its end
  double exposed_ms = 0;  // compute stream: sum of its waits for exchanges, the communication not hidden behind compute
  int exchanges = 0;
};

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
