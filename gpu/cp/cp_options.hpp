#pragma once
// What a GPU CP run is asked to do (CpGpuOptions) and what it measures (PhaseTimes, RankTimes, and the Timeline of
// gpu/cp/timeline.hpp): shared by the executors (gpu/cp/cp_executor.hpp) and the parts of the device backend.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "gpu/cp/timeline.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "sim/plan/plan.hpp"

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
inline std::string attention_phase(sim::PassKind pass, sim::StepSection section) {
  return std::string(pass == sim::PassKind::forward ? "attention forward, " : "attention backward, ") +
         std::string(sim::section_name(section));
}

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

}  // namespace cpgold::gpu
