#pragma once
// Bit-for-bit comparison of two candidate files (determinism): `cpgold check --identical A B`.
#include <string>
#include <vector>

namespace cpgold::fx {

// Bit-for-bit comparison of two candidate files (determinism).
struct IdenticalReport {
  int datasets = 0;
  std::vector<std::string> differences;  // one line per differing or unmatched dataset
  bool pass() const { return differences.empty(); }
};
IdenticalReport identical(const std::string& first, const std::string& second);

std::string render_text(const IdenticalReport& report);

}  // namespace cpgold::fx
