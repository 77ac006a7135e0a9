// cpgold: golden data for context-parallel attention, and checks against it. One binary, subcommands.
#include <algorithm>
#include <exception>
#include <iostream>
#include <map>

#include "apps/command_registry.hpp"
#include "reference/input_error.hpp"

namespace cpgold::app {
std::vector<Command>& command_registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace cpgold::app

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
    } catch (const std::exception& e) {
      std::cerr << "cpgold " << sub->get_name() << ": internal error: " << e.what() << "\n";
      return 3;
    }
  }
  return kExitUnusable;
}
