#pragma once
// The command line of a benchmark program: options that take a value ("--reps 3") and flags ("--keep"), each bound to
// a variable of the program. Any other argument, or an option whose value is missing, is a usage error.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace cpgold::bench {

class CommandLine {
 public:
  CommandLine(int argc, char** argv) : args_(argv + 1, argv + argc) {}

  CommandLine& text(const char* name, std::string& to) {
    return bind(name, true, [&to](const char* value) { to = value; });
  }
  CommandLine& number(const char* name, int& to) {  // std::atoi's reading (no range check)
    return bind(name, true, [&to](const char* value) { to = std::atoi(value); });
  }
  CommandLine& flag(const char* name, bool& to) {
    return bind(name, false, [&to](const char*) { to = true; });
  }

  // Sets the bound variables from the arguments, in order; on a usage error prints `usage` (one line) to stderr and
  // returns false.
  bool parse(const char* usage) const {
    for (size_t i = 0; i < args_.size(); ++i) {
      const Option* match = nullptr;
      for (const Option& o : options_)
        if (args_[i] == o.name && (!o.takes_value || i + 1 < args_.size())) match = &o;
      if (match == nullptr) {
        std::fprintf(stderr, "%s\n", usage);
        return false;
      }
      match->set(match->takes_value ? args_[++i].c_str() : nullptr);
    }
    return true;
  }

 private:
  struct Option {
    std::string name;
    bool takes_value;
    std::function<void(const char*)> set;
  };
  CommandLine& bind(const char* name, bool takes_value, std::function<void(const char*)> set) {
    options_.push_back({name, takes_value, std::move(set)});
    return *this;
  }

  std::vector<std::string> args_;
  std::vector<Option> options_;
};

}  // namespace cpgold::bench
