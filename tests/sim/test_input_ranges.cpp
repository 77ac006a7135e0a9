// One parser and one range for flags and JSON: seeds, softmax scales, list items, empty layouts, cp_size.
#include <doctest/doctest.h>

#include <string>

#include "apps/case_options.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"

using namespace cpgold;
using namespace cpgold::sim;

namespace {
// The InputError of a case given as JSON ("" if it parses).
std::string json_error(const std::string& json_text) {
  try {
    parse_case_text(json_text);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// The InputError of the same case given as flags ("" if it parses).
std::string flag_error(const std::map<std::string, std::string>& values) {
  cpgold::app::CaseFlags flags;
  flags.values = values;
  try {
    cpgold::app::case_from_flags(flags);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("seed: the same range as a flag and in JSON, up to INT64_MAX (stored as int64)") {
  CHECK(json_error(R"({"seqlens_q":[5],"seed":9223372036854775807})").empty());
  CHECK(flag_error({{"seqlens_q", "5"}, {"seed", "9223372036854775807"}}).empty());
  const std::string from_json = json_error(R"({"seqlens_q":[5],"seed":18446744073709551615})");
  const std::string from_flag = flag_error({{"seqlens_q", "5"}, {"seed", "18446744073709551615"}});
  CHECK(from_json.find("seed") == 0);
  CHECK(from_json.find("18446744073709551615") != std::string::npos);
  CHECK(from_flag == from_json);
  CHECK(json_error(R"({"seqlens_q":[5],"seed":-1})").find("seed") == 0);
  CHECK(flag_error({{"seqlens_q", "5"}, {"seed", "-1"}}) == json_error(R"({"seqlens_q":[5],"seed":-1})"));
}

TEST_CASE("softmax_scale: one supported range for flags and JSON, overflow is bad input, not an internal error") {
  for (const std::string value : {"5e-324", "1e300", "1000", "0", "-1", "65"}) {
    CAPTURE(value);
    const std::string from_json = json_error(R"({"seqlens_q":[5],"softmax_scale":)" + value + "}");
    CHECK(from_json.find("softmax_scale") == 0);
    CHECK(from_json.find("supported range") != std::string::npos);
    CHECK(flag_error({{"seqlens_q", "5"}, {"softmax_scale", value}}) == from_json);
  }
  for (const std::string value : {"1e-6", "0.125", "64"}) {
    CHECK(json_error(R"({"seqlens_q":[5],"softmax_scale":)" + value + "}").empty());
    CHECK(flag_error({{"seqlens_q", "5"}, {"softmax_scale", value}}).empty());
  }
  CHECK(json_error(R"({"seqlens_q":[5],"softmax_scale":1e400})").find("case") == 0);
  CHECK(flag_error({{"seqlens_q", "5"}, {"softmax_scale", "1e400"}}).find("softmax_scale") == 0);
}

TEST_CASE("list flags: an empty item anywhere is an error naming its index, seqlens_q needs one sequence") {
  CHECK(flag_error({{"seqlens_q", "5,8,"}}).find("seqlens_q[2]") == 0);
  CHECK(flag_error({{"seqlens_q", "5,,8"}}).find("seqlens_q[1]") == 0);
  CHECK(flag_error({{"seqlens_q", ",5"}}).find("seqlens_q[0]") == 0);
  CHECK(flag_error({{"seqlens_q", "5,8"}}).empty());
  CHECK(json_error(R"({"seqlens_q":[]})").find("seqlens_q") == 0);
  CHECK(flag_error({{"seqlens_q", ""}}).find("seqlens_q") == 0);
  CaseSpec empty;
  CHECK_THROWS_AS(validate_case(empty), InputError);
}

TEST_CASE("cp_size: bounded with a message naming the limit, the same for flags and JSON") {
  const std::string from_json = json_error(R"({"seqlens_q":[10],"cp_size":1000})");
  CHECK(from_json.find("cp_size") == 0);
  CHECK(from_json.find(std::to_string(kMaxCpSize)) != std::string::npos);
  CHECK(flag_error({{"seqlens_q", "10"}, {"cp_size", "1000"}}) == from_json);
  CHECK(json_error(R"({"seqlens_q":[10],"cp_size":128})").empty());
}
