#pragma once
// Replay of modelled CP mistakes for a failed check (docs/diagnosis.md, "Replay"): the CPU simulator runs the case
// under each mistake of sim/program/mistakes.hpp (the same Plan and program as every executor, with one thing changed) and the
// candidate's results, global or per rank, as a test holds them in memory, are compared with what the mistake gives.
// A mistake matches when every compared element is within the diagnosis tolerance of its simulation. Cost: one
// float64 forward per mistake (a backward too only for a mistake whose forward matches) of a sub-case: the failing
// sequences with the fewest pairs (attention never crosses sequences; filler sequences keep the offsets' residues
// that count shortcuts see) and, for p2p and all_gather, one KV head with its query heads (the modelled mistakes treat
// every head alike there); within a time budget.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fixtures/schema/fixture_reader.hpp"
#include "check/budget_rule.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/program/mistakes.hpp"

namespace cpgold::fx {

// One result of the candidate as the check read it.
struct ReplaySubject {
  std::string name;  // "o", "lse@r1", ...
  Quantity quantity = Quantity::o;
  int rank = -1;                // -1: global rows; r: rank r's local rows, in the order the candidate holds them
  TensorView<float> cand;       // [rows, heads, dim]; LSE [rows, heads, 1]
  TensorView<float> golden;     // the golden's global tensor, same shape convention (rows: global rows)
  double limit = 0;             // the deciding max limit of the result
  double explain_limit = 0;     // what a failing element is past (the mean limit for a result failed on the mean only;
                                // 0: the max limit)
  DType precision = DType::fp32;
  std::vector<uint8_t> failing;  // per row: the check found it wrong (empty: the result passed)
};

struct ReplayOptions {
  double budget_seconds = 30;     // no mistake starts past this (or when its run is expected to end past it), a
                                  // run past it stops at its next tile; the ones left are named as not replayed
  PadRows pad_rows = PadRows::zero;
  EmptyRowLse empty_row_lse = EmptyRowLse::neg_inf;
  int q_head = 0;                 // p2p, all_gather: a query head that fails; its KV head and group are replayed
  double max_pairs = 4e6;         // sequences replayed: those with failing rows, fewest pairs first, while the padded
                                  // (query x key) pairs stay under this (at least one)
};

struct ReplayResult {
  std::string mistake;
  sim::MistakeFamily family = sim::MistakeFamily::layout;
  std::string description;
  bool matches = false;
  double worst_ratio = 0;          // largest |candidate - simulation| / tolerance over the compared elements
  int64_t elements = 0;            // elements compared
  int64_t elements_within = 0;     // of them within the tolerance
  int64_t failing_rows = 0;        // failing rows of the subjects in the sequences replayed (every pass's)
  int64_t failing_rows_matched = 0;
  int64_t failing_rows_closer = 0;
  int64_t failing_rows_finite = 0;  // reproduced failing rows with a finite element the mistake moved  // failing rows where the simulation sits nearer the candidate than the golden
  std::map<size_t, std::vector<uint8_t>> rows;  // subject index -> failing rows the simulation reproduces
  std::vector<sim::TileRef> tiles;              // forward tiles the mistake changes (mask, counts)
  std::vector<int> ranks;                       // ranks whose results differ from the golden under the mistake
  bool backward_run = false;
};

struct ReplayOutcome {
  std::vector<ReplayResult> results;   // every mistake replayed, matches first, then by closeness
  std::vector<std::string> not_replayed;  // left out by the budget
  std::vector<int> heads;              // query heads replayed
  std::vector<int> sequences;          // sequences replayed
  double seconds = 0;
  int runs = 0;                        // simulator runs
};

// inputs: the fixture's inputs (all heads). Mistakes that cannot be simulated for this case are left out.
ReplayOutcome replay_mistakes(const FixtureFile& fixture, const sim::CaseInputs& inputs,
                              const std::vector<ReplaySubject>& subjects, const ReplayOptions& options);

}  // namespace cpgold::fx
