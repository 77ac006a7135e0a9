#pragma once
// The report of a check: one result per tensor (global, per rank, per step) with its evaluation under the budget rule,
// the worst element and the first divergence located in the terms of CP (rank, step, sequence, row, head, dim), the
// verdict and what decided it, the diagnosis of a failure; rendered as text or JSON.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "check/budget_rule.hpp"
#include "check/candidates.hpp"
#include "check/finding.hpp"

namespace cpgold::fx {

// Where an element sits, in the terms a person debugging CP uses.
struct ElementLocation {
  int rank = -1;          // -1: global tensor
  int step = -1;          // -1: not a step partial
  int sequence = -1;      // -1: pad/tail row outside every sequence
  int64_t row = 0;        // row of the tensor checked
  int64_t global_row = -1;
  int64_t row_in_sequence = -1;
  int64_t head = 0, dim = 0;
  double candidate = 0, oracle = 0;
  std::optional<double> peer;  // the CP peer's value when the fixture stores it
  bool pad_row = false;        // a row of a sequence's padded range past its tokens (sequence >= 0)
  std::optional<ExactRule> rule;  // the exact rule this element violates, if it is an exact violation
  int32_t sequence_length = -1;   // tokens of `sequence`
};

struct TensorResult {
  std::string tensor;      // "o", "lse", ...
  std::string dataset;     // candidate dataset, "file:/path"
  int rank = -1, step = -1;
  std::string pass;        // "forward" / "backward" for step partials
  CandidateScope scope = CandidateScope::cp_output;
  bool missing = false;    // the candidate lacks it (fails)
  bool has_other = true;   // the golden stores the other budget (step partials carry the CP budget only)
  Evaluation evaluation;
  std::optional<ElementLocation> worst, first_divergence;
  std::vector<ElementLocation> exact_violations;  // located, the first kMaxListedViolations in layout order
  bool ok() const { return !missing && evaluation.pass(); }
};

struct CheckReport {
  std::string golden;
  std::string case_json;
  std::vector<std::string> candidates;
  std::vector<TensorResult> results;
  EmptyRowLse empty_row_lse = EmptyRowLse::neg_inf;  // the convention the LSE checks used
  PadRows pad_rows = PadRows::zero;                  // the convention for pad and tail rows
  std::vector<std::string> warnings;  // e.g. candidate datasets that look like outputs but are not read
  std::string inputs_sha256;          // the fixture's inputs digest (computed when the file predates the attribute)
  std::string inputs_source = "seed"; // "seed" or "given" (the tensors of a run: cpgold gen --inputs, cpgold.capture)
  int64_t inputs_nonfinite_valid = 0; // given inputs: NaN or infinite values in valid rows (the fixture is flagged)
  std::vector<InputsClaim> inputs;    // what the candidates state about their inputs; a mismatch fails the check
  std::string fixture_candidate;      // a candidate that is a cpgold fixture: its stored simulator outputs were checked
  std::vector<int> ranks;             // the ranks whose per-rank outputs were checked
  std::vector<Diagnosis> diagnosis;   // a failed check: the kinds of bug the failures fit, most specific first
  // Valid (token) rows the fixture holds for the selected tensors over its whole batch (q rows for o, lse, dq; kv rows
  // for dk, dv; every rank's together), and the ranks whose shards hold any of them.
  int64_t fixture_valid_rows = 0;
  std::vector<int> ranks_with_tokens;
  int64_t compared() const;  // elements compared under the budget rule, over all results
  // The fixture itself has nothing to compare in the selected tensors (an empty batch, e.g. seqlens_q [0]): the check
  // then rests on the exact rules alone (pad rows 0, shapes, LSE -inf) and passes on them, saying "no valid element".
  bool no_valid_element() const { return !results.empty() && fixture_valid_rows == 0; }
  bool every_result_ok() const;  // at least one result, each present and within its budget (exact classes included)
  bool foreign_inputs() const;   // a candidate states inputs other than the fixture's
  // every_result_ok(), something compared and no candidate computed from other inputs. A check that compared nothing
  // fails (the selected ranks hold only padding, say) unless the fixture has no valid element to compare at all.
  bool pass() const;
  // Not pass, yet nothing failed for certain: the only results short of passing are undecided ones of a fixture of
  // another engine (Evaluation::undecided), nothing is missing and no candidate comes from other inputs. The CPU
  // reference's fixture of the same case decides (`cpgold gen --engine cpu`). Exit 5 of `cpgold check` (3 is an internal error).
  bool undecided() const;
  // The per-result part of undecided(): some result falls short of passing and every one that does is undecided (none
  // missing). A multi-GPU run applies it per rank (gpu/verify/rank_check.cpp), the rest of the rule to all ranks.
  bool results_undecided() const;
  std::string engine = "cpu";  // the engine that computed the fixture's oracle and peers (/case attribute engine)
};

// Worst ratio of error to limit over the results, against the deciding budget and against the other one.
struct Margins {
  double deciding_max = 0, deciding_mean = 0, other_max = 0, other_mean = 0;
  std::string deciding_max_at, deciding_mean_at, other_max_at, other_mean_at;  // result names ("o@r1/s0f")
};
Margins margins(const CheckReport& report);

std::string render_text(const CheckReport& report);
// "verdict: PASS" / "verdict: FAIL", with what else decided it ("(the candidate was computed from the inputs of another
// fixture)", "(checked the stored simulator outputs ... of the cpgold fixture X, not an implementation)").
std::string verdict_line(const CheckReport& report);
// "dq, dk, dv are missing in the candidate while o/lse are there: ... --tensors o,lse ...", or "" when that is not the
// case.
std::string forward_only_hint(const CheckReport& report);
nlohmann::ordered_json to_json(const CheckReport& report);
}  // namespace cpgold::fx
