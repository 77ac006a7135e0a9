#pragma once
// The TransformerEngine audit sweep: small layouts for every comm type, W in 2..4 and every mask and window class TE
// accepts, each replayed for both backends and both pad_between_seqs settings and audited. Beside the audit, an
// independent brute-force count of the wrong pairs (rows mapped through cpgold's partition maps, the backends'
// documented mask formulas written out pair by pair, the truth from reference/mask.hpp), and the class table that
// docs/te-audit.md records.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/case/case_spec.hpp"
#include "sim/te/te_audit.hpp"

namespace cpgold::sim::testing {

struct SweepCase {
  nlohmann::json object;  // the case as given (mask and window before cpgold normalises them)
  std::string comm;       // "p2p", "a2a", "all_gather", "a2a+p2p"
  int klass = 0;          // index into te_sweep_classes()
};

struct SweepClass {
  std::string name;  // as the table shows it
};
const std::vector<SweepClass>& te_sweep_classes();

// Layouts of every class for every comm type and W in 2..max_cp_size: every one-sequence layout up to 2W + 1 tokens
// with and without extra padding (and other key padding), then `random_per_cell` random layouts of 2 and 3 sequences.
std::vector<SweepCase> te_sweep_cases(int random_per_cell, uint64_t seed, int max_cp_size = 4);

// Sum over (head group, query token, key token) of |computed multiplicity - visible|, counted pair by pair.
int64_t brute_force_wrong_pairs(const CaseSpec& spec, const TeReplay& replay);

// One line of a case for the table: the flags that reproduce it.
std::string case_flags(const nlohmann::json& object);

struct SweepCell {
  int cases = 0;
  int with_findings[2][2] = {};   // [pad_between_seqs][backend]
  int refused[2][2] = {};
  std::map<std::string, int> refusal[2][2];  // TE's source lines of the refusals -> layouts
  std::string smallest[2][2];     // flags of the smallest layout with findings
  int64_t smallest_rows[2][2] = {{-1, -1}, {-1, -1}};
};
struct SweepTable {
  std::vector<std::string> comms;
  std::vector<std::vector<SweepCell>> cells;  // [comm][class]
  int64_t cases = 0, replays = 0, mismatches = 0;  // mismatches: audit verdicts the brute force disagrees with
  std::string first_mismatch;
};
SweepTable run_te_sweep(const std::vector<SweepCase>& cases);
std::string te_sweep_markdown(const SweepTable& table);

}  // namespace cpgold::sim::testing
