#pragma once
// Checks of a refusal (reference/input_error.hpp): an action that must throw an InputError naming its field and
// saying what is wrong; shared by the tests of every layer.
#include <doctest/doctest.h>

#include <initializer_list>
#include <string>

#include "reference/input_error.hpp"

namespace cpgold::testing {

// The InputError that `action` throws; the test fails here where it throws none.
template <class Action>
InputError input_error_of(Action&& action) {
  try {
    action();
  } catch (const InputError& e) {
    return e;
  }
  FAIL("no InputError thrown");
  return InputError("", "");
}

// The message of `e` holds each of `parts`.
inline void check_says(const InputError& e, std::initializer_list<std::string> parts) {
  INFO(std::string(e.what()));
  for (const std::string& part : parts) {
    CAPTURE(part);
    CHECK(std::string(e.what()).find(part) != std::string::npos);
  }
}

// `action` throws an InputError whose message holds each of `parts`.
template <class Action>
void check_input_error_says(Action&& action, std::initializer_list<std::string> parts) {
  check_says(input_error_of(action), parts);
}

// `action` throws an InputError naming `field`, its message holding each of `parts`.
template <class Action>
void check_input_error(Action&& action, const std::string& field, std::initializer_list<std::string> parts) {
  const InputError e = input_error_of(action);
  CHECK_MESSAGE(e.field() == field, std::string(e.what()));
  check_says(e, parts);
}

}  // namespace cpgold::testing
