#pragma once
// `cpgold check` as a library: candidate files (fixtures/SCHEMA.md, "Candidate files") against a golden fixture.
// Exact classes first, then the budget rule of docs/numerics.md for every float tensor, global, per rank and per step
// when both sides carry traces. Reports name the worst element and the first divergence in layout order with rank,
// step, sequence, row within the sequence, head and dim, candidate / oracle / peer values and the case JSON.
#include <map>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "check/budget_rule.hpp"
#include "check/candidates.hpp"
#include "check/report.hpp"

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
  bool diagnose = true;  // on a failed check, name the kind of bug (check/diagnosis/diagnose.hpp; --no-diagnosis)
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

}  // namespace cpgold::fx
