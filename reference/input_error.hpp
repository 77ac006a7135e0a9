#pragma once
// The one error type for bad input at a boundary (API, CLI, HDF5 reader): it names the field and the value.
#include <sstream>
#include <stdexcept>
#include <string>

namespace cpgold {

class InputError : public std::runtime_error {
 public:
  // field: the offending key or path, e.g. "cu_seqlens_q[2]" or "/golden/o"; message: what is wrong with the value.
  InputError(std::string field, const std::string& message)
      : std::runtime_error(field + ": " + message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// Builds a message from streamable parts: fail_input("cu_seqlens_q[2]", "value ", v, " is below ", w).
template <class... Parts>
[[noreturn]] void fail_input(const std::string& field, const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw InputError(field, message.str());
}

}  // namespace cpgold
