#pragma once
// A list of values as text, for messages and renderings: "[1,2,3]" (or "[1, 2, 3]" with the separator ", ").
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace cpgold {

template <class T>
std::string bracketed_list(const std::vector<T>& values, std::string_view separator = ",") {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < values.size(); ++i) os << (i ? separator : "") << values[i];
  os << "]";
  return os.str();
}

}  // namespace cpgold
