#pragma once
// Memory of the CP simulator, known before it runs: the one CP program (sim/program/cp_program.hpp) run over a backend whose
// tensors are shapes that count their bytes (a dry run: no data, no arithmetic, no exchange). Each rank's program
// runs as the simulator runs it, so the count follows every buffer it holds (input shards, KV in flight, the forward
// partials kept until the merge, accumulators, gathered halves, the step results) and the attention results' own
// allocations; the peak of the W ranks together is the sum of each rank's peak (they run side by side, in step).
// Kernel workspace per thread (the score tiles) is not here: reference/attention.hpp, attention_workspace_bytes.
#include <cstdint>

#include "sim/plan/plan.hpp"

namespace cpgold::sim {

struct CpMemory {
  double shards = 0;     // bytes of the W ranks' input shards (held by the simulator for the whole run)
  double program = 0;    // sum over ranks of the peak bytes each rank's program holds beside its shards
  double outputs = 0;    // bytes of the W ranks' final outputs (O, LSE, dQ, dK, dV), held until gathered
  double trace = 0;      // bytes of the step records with trace
  double peak() const { return shards + program + trace; }
};

// element_bytes: 8 for the float64 CP oracle, 4 for the CP peer (float storage of the dtype's values).
CpMemory cp_memory(const Plan& plan, int dim_qk, int dim_v, int element_bytes, bool record_trace, bool backward = true);

}  // namespace cpgold::sim
