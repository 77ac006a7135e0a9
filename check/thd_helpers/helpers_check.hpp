#pragma once
// `cpgold helpers-check`: every call of a THD helper dump (check/thd_helpers/helpers_dump.hpp) recomputed from its stored
// inputs by the CPU twins of sim/ (partition, reorder, lse_halves, out_correction, grad_correction) and compared
// with the stored output bit for bit: float32 bit patterns (NaN payloads included), integer indices as values.
// Only the elements the op defines are compared (docs/helpers-check.md).
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "check/thd_helpers/helpers_dump.hpp"

namespace cpgold::fx {

// Where an element of a call's output sits. `index` is the full index in the output's own dimensions, named
// ("row", "head", "dim"; "head", "column"; "sequence", "head", "column"; "row"). sequence / row_in_sequence place the
// row (or LSE column) in the sequences of the call's offsets, in the output tensor's own layout (a half tensor counts
// rows within the half); -1 where the row belongs to no sequence. rank: the rank of a rank-order row, else -1.
struct ElementPlace {
  std::vector<std::pair<std::string, int64_t>> index;
  int sequence = -1;
  int64_t row_in_sequence = -1;
  int rank = -1;
};

struct HelperMismatch {
  int64_t flat = 0;  // row-major index into the output
  ElementPlace place;
  bool integer = false;
  int64_t expected_int = 0, observed_int = 0;  // integer outputs
  float expected = 0, observed = 0;            // float outputs (compare the bits)
};

using ParamValue = std::variant<int64_t, std::string>;

struct HelperCallResult {
  std::string name;
  HelperOp op = HelperOp::read_half;
  std::vector<std::pair<std::string, ParamValue>> params;  // the call's attributes and sizes, in a fixed order
  int64_t compared = 0;                                     // output elements compared
  int64_t left_out = 0;                                     // output elements the op does not define
  std::string left_out_reason;                              // why, when left_out > 0
  int64_t mismatches = 0;
  std::optional<HelperMismatch> first;  // the first mismatch in row-major order
  // Float outputs: the largest distance in units in the last place among mismatches where neither value is NaN.
  std::optional<int64_t> max_ulp;
  bool pass() const { return mismatches == 0; }
};

struct HelpersReport {
  std::string path;
  std::string implementation;
  std::vector<HelperCallResult> calls;
  int passed() const;
  int failed() const { return static_cast<int>(calls.size()) - passed(); }
  bool pass() const { return failed() == 0; }
};

// Recomputes and compares one call (already validated by read_helpers_dump).
HelperCallResult check_helper_call(const HelperCall& call);
// Reads the dump (InputError when unusable) and checks every call.
HelpersReport check_thd_helpers(const std::string& path);

// One line per call (`PASS|FAIL <name> <op> <params>`, a failure's detail on an indented line) and the summary line
// `helpers-check: N calls, P passed, F failed (<implementation>)`.
std::string render_text(const HelpersReport& report);
// The same content as one JSON object; non-finite floats as the strings "nan", "inf", "-inf".
nlohmann::ordered_json to_json(const HelpersReport& report);

// Units in the last place between two non-NaN floats (+0 and -0 are 1 apart); nullopt when either is NaN.
std::optional<int64_t> ulp_distance(float a, float b);

}  // namespace cpgold::fx
