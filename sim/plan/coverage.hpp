#pragma once
// Coverage check of a Plan from its tile records alone: enumerate the (sequence, q position, k position, head) pairs
// each computed tile covers under the convention a kernel applies (row j of a segment is at position + j; a pair
// counts if visible(call.window, q_pos, k_pos, L_kv - L_q)) and compare with the pairs the global mask allows:
// every allowed pair exactly once per q head, no other pair.
#include <cstdint>
#include <string>

#include "sim/plan/plan.hpp"

namespace cpgold::sim {

struct CoverageReport {
  int64_t allowed_pairs = 0;   // allowed (b, q, k) pairs times heads_q
  int64_t covered_once = 0;
  int64_t missing = 0;         // allowed, covered 0 times
  int64_t duplicated = 0;      // allowed, covered more than once
  int64_t extra = 0;           // covered but not allowed (including positions past the valid lengths)
  std::string first_problem;   // "" when ok; otherwise the pass, rank, step, sequence and positions
  bool ok() const { return missing == 0 && duplicated == 0 && extra == 0; }
};

// pass: which pass's tiles to check. Meant for small layouts (memory ~ sum_b L_q * L_kv * heads_q bytes).
CoverageReport check_coverage(const Plan& plan, PassKind pass);

}  // namespace cpgold::sim
