#pragma once
// A check as the command line (`cpgold check`) and the Python package (cpgold.check_*) ask for it: the options as
// given (text and numbers), turned into CheckOptions in one place, each validated once, every error naming the field
// as that door spells it.
#include <string>

#include "check/engine.hpp"

namespace cpgold::fx {

struct CheckRequest {
  std::string tensors;                  // "o,lse"; "" = all five
  std::string ranks;                    // "0,2"; "" = every rank of the fixture
  std::string empty_row_lse = "neg-inf";
  std::string pad_rows = "zero";
  bool allow_same_file = false;
  bool diagnose = true;
  double diagnosis_budget = 30;         // seconds, 0 to 86400
};

// How a door names the request's fields in its errors.
struct CheckRequestFields {
  const char* tensors;
  const char* ranks;
  const char* empty_row_lse;
  const char* pad_rows;
  const char* diagnosis_budget;
  const char* diagnosis_budget_expected;  // what the budget's error says it expected
};
inline constexpr CheckRequestFields kCommandLineFields{"--tensors", "--ranks", "--empty-row-lse", "--pad-rows",
                                                        "--diagnosis-budget", "seconds from 0 to 86400"};
inline constexpr CheckRequestFields kPythonFields{"tensors", "ranks", "empty_row_lse", "pad_rows", "diagnosis",
                                                  "True, False or seconds from 0 to 86400 for the replay"};

// InputError naming the field (as `fields` spells it) and the value for the first option that is wrong, in the order
// conventions, diagnosis budget, tensors, ranks.
CheckOptions check_options(const CheckRequest& request, const CheckRequestFields& fields);

}  // namespace cpgold::fx
