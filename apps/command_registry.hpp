#pragma once
// Subcommands of the `cpgold` binary register themselves here; each lives in its own apps/*_command.cpp.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace cpgold::app {

// Exit codes shared by every subcommand.
inline constexpr int kExitPass = 0;
inline constexpr int kExitFail = 1;      // a check failed
inline constexpr int kExitUnusable = 2;  // bad input: unusable arguments or files
inline constexpr int kExitUndecided = 3;  // check: a fixture of another engine cannot decide (CheckReport::undecided)

struct Command {
  std::string name;
  // Adds the subcommand to `app` and returns the function that runs it (returns the exit code).
  std::function<std::function<int()>(CLI::App& app)> attach;
};

std::vector<Command>& command_registry();

struct RegisterCommand {
  RegisterCommand(std::string name, std::function<std::function<int()>(CLI::App&)> attach) {
    command_registry().push_back({std::move(name), std::move(attach)});
  }
};

}  // namespace cpgold::app
