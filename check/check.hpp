#pragma once
// `cpgold check` as a library: candidate files (fixtures/SCHEMA.md, "Candidate files") against a golden fixture.
// Exact classes first, then the budget rule of docs/design.md for every float tensor, global, per rank and per step
// when both sides carry traces. Reports name the worst element and the first divergence in layout order with rank,
// step, sequence, row within the sequence, head and dim, candidate / oracle / peer values and the case JSON.
#include <map>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "check/diagnosis/diagnosis.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/storage/hdf5_file.hpp"
#include "fixtures/schema/tolerance.hpp"

namespace cpgold::fx {

struct CheckOptions {
  std::vector<Quantity> tensors;  // empty: all five; a tensor the golden has and the candidate lacks then fails
  EmptyRowLse empty_row_lse = EmptyRowLse::neg_inf;  // LSE expected on valid rows without keys (--empty-row-lse)
  PadRows pad_rows = PadRows::zero;  // pad and tail rows of O/dQ/dK/dV: exactly 0, or left out (--pad-rows)
  // Per-rank outputs are checked for these ranks (--ranks); empty: every rank of the fixture. A rank-local test that
  // holds one rank's outputs checks just that rank.
  std::vector<int> ranks;
  // The golden file given again as a candidate is unusable input (exit 2: swapped or repeated arguments) unless this
  // asks for it: then its stored simulator outputs (/peer) are checked against its own oracle (--allow-same-file).
  bool allow_same_file = false;
  bool diagnose = true;  // on a failed check, name the kind of bug (check/diagnosis/diagnosis.hpp; --no-diagnosis)
  // The diagnosis's replay of modelled mistakes starts no new mistake past this many seconds (--diagnosis-budget);
  // 0: no replay.
  double diagnosis_budget_seconds = 30;
};

// "o,lse": every item a tensor name, none empty ("o," and "o,,lse" alike), none twice; InputError naming `field`.
// `cpgold check --tensors` and the Python package's tensors= read it the same way.
std::vector<Quantity> parse_tensor_list(const std::string& text, const std::string& field);
// "0,2": non-negative integers, no empty item ("0," included), none twice (`--ranks`, Python's ranks=).
std::vector<int> parse_rank_list(const std::string& text, const std::string& field);
// The two conventions of a check, as `--empty-row-lse` / `--pad-rows` (and Python's empty_row_lse= / pad_rows=) spell
// them, set on `options`; InputError naming the field (`empty_row_field`, `pad_rows_field`) and the value otherwise.
void set_conventions(CheckOptions& options, const std::string& empty_row_lse, const std::string& empty_row_field,
                     const std::string& pad_rows, const std::string& pad_rows_field);

// One tensor of an implementation under test, in memory: float values (bf16/fp16 widened exactly), row-major.
struct CandidateTensor {
  std::string where;           // "file:/path", "array o@r1": named in errors and reports
  Values<float> values;
  std::vector<int64_t> dims;   // [t, h, d]; LSE [h, t], or [t, h] with lse_row_major
  bool lse_row_major = false;  // LSE given as [t, h] (or [t, h, 1], whose dims are then [t, h])
};

// The inputs a candidate source states it was computed from (root attribute inputs_sha256, SCHEMA.md).
struct InputsClaim {
  std::string source;     // the file (or "arrays")
  std::string sha256;     // its inputs_sha256
  std::string case_json;  // the case of those inputs when the source names it (attribute inputs_case_json), or ""
  bool matches = true;    // equal to the fixture's inputs digest (set by check)
};

// What a check reads: candidate tensors by (rank or -1, step or -1, pass 0 forward / 1 backward, quantity), the scope
// of the global ones, the inputs the sources state, and whether a source is itself a cpgold fixture.
struct CandidateSet {
  using Key = std::tuple<int, int, int, Quantity>;
  std::map<Key, CandidateTensor> tensors;
  CandidateScope global_scope = CandidateScope::global_only;
  std::vector<std::string> sources;  // files, or a description of in-memory arrays: the report's "candidate" lines
  std::vector<InputsClaim> inputs;
  std::string fixture_candidate;     // a candidate file that is a cpgold fixture (its /peer outputs were read), or ""
  std::vector<std::string> warnings;  // datasets named like outputs that were not read
  void add(const Key& key, CandidateTensor tensor);  // InputError if the same tensor comes twice
};

// The shape a candidate tensor must declare, and where that comes from ("golden.h5:/golden/o"); InputError where the
// tensor has no place in the golden at all. Asked before any value of the tensor is read.
using ExpectedShape =
    std::function<std::pair<std::vector<int64_t>, std::string>(const CandidateSet::Key&, const CandidateTensor&)>;

// Reads candidate files (fixtures/SCHEMA.md, "Candidate files"). A file that is itself a cpgold fixture gives its
// stored simulator outputs (/peer: the CP peer, gathered) as global CP outputs. InputError for unusable files. With
// `expected_shape`, every tensor's declared shape is compared with it before its values are read (a file declaring
// [4194304, 4, 64] over a few kB allocates nothing).
CandidateSet read_candidate_files(const std::vector<std::string>& files, const ExpectedShape& expected_shape = {});
// The shapes of the golden `fixture` (open in `golden`, both outliving the result) for its candidates: the rule
// `check` applies to candidate files, and the Python extension to arrays before it copies any of them.
ExpectedShape expected_shapes(const h5::Reader& golden, const FixtureFile& fixture);

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
};

// InputError (exit 2) for unusable files: non-HDF5, wrong shapes or element types, a candidate with nothing to check.
CheckReport check(const std::string& golden, const std::vector<std::string>& candidates, const CheckOptions& options = {});
// The same on a golden file the caller already holds open (`fixture` read from `golden`): a command that read the
// fixture's inputs through this handle checks against the same version of the file, whatever replaces it meanwhile.
CheckReport check(const h5::Reader& golden, const FixtureFile& fixture, const std::vector<std::string>& candidates,
                  const CheckOptions& options = {});
// The engine itself, on candidates already in memory (read_candidate_files, or arrays handed over by the Python
// extension): every way of checking goes through it, so a verdict does not depend on how the candidate arrived.
CheckReport check(const h5::Reader& golden, const FixtureFile& fixture, const CandidateSet& candidates,
                  const CheckOptions& options = {});

// Runs an independent low-precision path on the fixture's own inputs: the CPU simulator (the CP peer) in the case
// dtype with another order of operations (row block 48 instead of 64, the softmax scale applied to K in the
// accumulation type instead of to the scores), and checks its per-rank outputs, its gathered global outputs (CP
// budget) and, for a traced fixture, its step partials as a candidate. The margins show how far inside the budgets
// an honest implementation lands.
CheckReport self_check(const std::string& golden, const CheckOptions& options = {});

// Bit-for-bit comparison of two candidate files (determinism).
struct IdenticalReport {
  int datasets = 0;
  std::vector<std::string> differences;  // one line per differing or unmatched dataset
  bool pass() const { return differences.empty(); }
};
IdenticalReport identical(const std::string& first, const std::string& second);

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
std::string render_text(const IdenticalReport& report);

}  // namespace cpgold::fx
