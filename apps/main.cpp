// cpgold: golden data for context-parallel attention, and checks against it. One binary, subcommands.
#include <algorithm>
#include <exception>
#include <iostream>
#include <map>
#include <new>
#include <stdexcept>

#include "apps/command_registry.hpp"
#include "apps/machine_resources.hpp"
#include "reference/input_error.hpp"

namespace cpgold::app {
std::vector<Command>& command_registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace cpgold::app

namespace {
std::string available_memory_text() {
  const cpgold::app::MachineResources machine = cpgold::app::machine_resources(".");
  return std::to_string(machine.memory_available / (1 << 20)) + " MiB";
}
}  // namespace

int main(int argc, char** argv) {
  using namespace cpgold::app;
  CLI::App app{"cpgold " CPGOLD_VERSION ": golden data and checks for context-parallel (CP) attention on THD layouts"};
  app.set_version_flag("--version", std::string(CPGOLD_VERSION));
  app.require_subcommand(1);
  auto& commands = command_registry();
  std::sort(commands.begin(), commands.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
  std::map<CLI::App*, std::function<int()>> runners;
  for (const Command& command : commands) {
    auto run = command.attach(app);
    runners.emplace(app.get_subcommand(command.name), std::move(run));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitUnusable;
  }
  for (CLI::App* sub : app.get_subcommands()) {
    try {
      return runners.at(sub)();
    } catch (const cpgold::InputError& e) {
      std::cerr << "cpgold " << sub->get_name() << ": error: " << e.what() << "\n";
      return kExitUnusable;
    } catch (const std::bad_alloc&) {
      // Input too large for this machine (gen refuses most such cases up front from its estimate).
      std::cerr << "cpgold " << sub->get_name() << ": error: out of memory: the input is too large for the memory "
                << "available (" << available_memory_text() << "); make the case smaller (total_tokens_q, "
                << "total_tokens_kv, seqlens_q, heads_q, dim_qk, cp_size)\n";
      return kExitUnusable;
    } catch (const std::length_error& e) {
      std::cerr << "cpgold " << sub->get_name() << ": error: the input is too large to hold in memory (" << e.what()
                << "); make the case smaller\n";
      return kExitUnusable;
    } catch (const std::exception& e) {
      std::cerr << "cpgold " << sub->get_name() << ": internal error: " << e.what() << "\n";
      return 3;
    }
  }
  return kExitUnusable;
}
