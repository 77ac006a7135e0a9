#pragma once
// Subcommands of the `cpgold` binary register themselves here; each lives in its own apps/*_command.cpp.
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "reference/input_error.hpp"

namespace cpgold::app {

// Exit codes shared by every subcommand.
inline constexpr int kExitPass = 0;
inline constexpr int kExitFail = 1;      // a check failed
inline constexpr int kExitUnusable = 2;  // bad input: unusable arguments or files
inline constexpr int kExitUndecided = 5;  // check: a fixture of another engine cannot decide (CheckReport::undecided)

// The error of a command whose layer this build was configured without (exit 2): `layer`, what configure did not
// find (`missing`), and where build/bin/cpgold-gpu has it.
[[noreturn]] inline void fail_not_built(const char* command, const char* layer, const char* missing,
                                        const char* where_gpu_cli_has_it) {
  fail_input(command, "this cpgold was built without ", layer, " (", missing, " at configure time; build/bin/cpgold-gpu "
             "has it where ", where_gpu_cli_has_it, ", or configure with -DCPGOLD_ENABLE_CUDA=ON)");
}

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
  // A subcommand whose options fill one Args: subcommand `name` (the name given once) with `description`, whose
  // options `add_options` binds to the fields of an Args made for it (it lives as long as the runner); the runner is
  // `run` on that Args.
  template <class Args>
  RegisterCommand(const std::string& name, const std::string& description, void (*add_options)(CLI::App&, Args&),
                  int (*run)(const Args&))
      : RegisterCommand(name, [=](CLI::App& app) -> std::function<int()> {
          auto args = std::make_shared<Args>();
          add_options(*app.add_subcommand(name, description), *args);
          return [args, run] { return run(*args); };
        }) {}
};

}  // namespace cpgold::app
