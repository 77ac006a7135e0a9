// The audit sweep (tests/sim/te_audit_sweep.hpp) in the default test set: over small layouts of every comm type,
// W in 2..4 and every mask and window class TE accepts, the audit calls a replay exact exactly when an independent
// pair-by-pair count finds the computed pairs equal to the truth (and counts the same wrong pairs); and
// docs/te-audit.md's class table is the one this sweep gives.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include "te_audit_sweep.hpp"

using namespace cpgold::sim::testing;

namespace {

constexpr int kRandomPerCell = 12;
constexpr uint64_t kSeed = 28;

std::string documented_table() {
  std::ifstream in(std::string(CPGOLD_SOURCE_DIR) + "/docs/te-audit.md");
  std::stringstream all;
  all << in.rdbuf();
  const std::string text = all.str();
  const std::string begin = "<!-- te-audit-table begin -->\n", end = "<!-- te-audit-table end -->";
  const size_t b = text.find(begin), e = text.find(end);
  if (b == std::string::npos || e == std::string::npos || e < b) return "(no table between the markers)";
  return text.substr(b + begin.size(), e - b - begin.size());
}

}  // namespace

TEST_CASE("te audit sweep: exact exactly where the computed pairs equal the truth, and the docs table matches") {
  const SweepTable t = run_te_sweep(te_sweep_cases(kRandomPerCell, kSeed));
  INFO("first mismatch: " << t.first_mismatch);
  CHECK(t.mismatches == 0);
  CHECK(t.cases > 1000);
  const std::string table = te_sweep_markdown(t);
  const std::string documented = documented_table();
  if (documented != table) MESSAGE("docs/te-audit.md's table differs from the sweep; the sweep gives:\n" << table);
  CHECK(documented == table);
}
