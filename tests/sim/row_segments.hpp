#pragma once
// The row segments of a position-aware call (reference/attention_call.hpp) against segments worked out by hand.
#include <doctest/doctest.h>

#include <vector>

#include "reference/attention_call.hpp"

namespace cpgold::sim::testing {

// One side (q or kv) of one sequence of a call holds exactly `want`, in order.
inline void check_segments(const std::vector<RowSegment>& got, const std::vector<RowSegment>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK(got[i] == want[i]);
}

}  // namespace cpgold::sim::testing
