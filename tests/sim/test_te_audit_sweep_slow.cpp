// A larger TE audit sweep (label slow): W up to 8, more random layouts per class, another seed; the audit's verdict
// and wrong-pair count must agree with the pair-by-pair count on every replay.
#include <doctest/doctest.h>

#include "te_audit_sweep.hpp"

using namespace cpgold::sim::testing;

TEST_CASE("te audit sweep (slow): audit and pair-by-pair count agree on every replay") {
  const SweepTable t = run_te_sweep(te_sweep_cases(60, 2820, 8));
  INFO("first mismatch: " << t.first_mismatch);
  CHECK(t.mismatches == 0);
  MESSAGE(t.cases << " layouts, " << t.replays << " replays");
}
