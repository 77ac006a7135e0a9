#pragma once
// Findings of the visible-pairs audit (sim/te/te_audit.hpp) as the tests of the replay and the audit look at them: the
// finding of one call, and the facts a worked example states about it.
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>

#include "sim/te/te_audit.hpp"

namespace cpgold::sim::testing {

// The finding of the call of (pass, rank, step), of `sequence` where given; nullptr where there is none.
inline const TeFinding* find_finding(const TeAudit& audit, const TeReplay& replay, PassKind pass, int rank, int step,
                                     std::optional<int> sequence = std::nullopt) {
  for (const TeFinding& f : audit.findings) {
    const TeCall& c = replay.calls(f.pass)[static_cast<size_t>(f.call)];
    if (f.pass == pass && c.rank == rank && c.step == step && (!sequence || f.sequence == *sequence)) return &f;
  }
  return nullptr;
}

// What a worked example states about one finding; a fact left out is not checked.
struct FindingFacts {
  std::optional<int64_t> extra{}, missing{}, duplicate{};  // pairs
  std::optional<int64_t> query_row{}, query_position{};
  std::optional<TeKeySet> expected{}, computed{};
};

// `f` exists and agrees with every fact given.
inline void check_finding(const TeFinding* f, const FindingFacts& facts) {
  REQUIRE(f);
  CAPTURE(f->call);
  CAPTURE(f->sequence);
  if (facts.extra) CHECK(f->extra_pairs == *facts.extra);
  if (facts.missing) CHECK(f->missing_pairs == *facts.missing);
  if (facts.duplicate) CHECK(f->duplicate_pairs == *facts.duplicate);
  if (facts.query_row) CHECK(f->query_row == *facts.query_row);
  if (facts.query_position) CHECK(f->query_position == *facts.query_position);
  if (facts.expected) CHECK(f->expected == *facts.expected);
  if (facts.computed) CHECK(f->computed == *facts.computed);
}

}  // namespace cpgold::sim::testing
