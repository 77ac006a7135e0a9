// cpgold: golden data for context-parallel attention, and checks against it. One binary, subcommands.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <exception>
#include <iostream>
#include <map>
#include <new>
#include <stdexcept>

#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "apps/machine_resources.hpp"
#include "reference/input_error.hpp"
#include "reference/isa_level.hpp"

namespace cpgold::app {
std::vector<Command>& command_registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace cpgold::app

namespace {
// Edit distance (insertions, deletions, substitutions) between two short names.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The closest of `known` to `given`, if it is close enough to be a typo (a third of the name, at least 2 edits).
std::string closest(const std::string& given, const std::vector<std::string>& known) {
  std::string best;
  size_t best_distance = std::max<size_t>(2, given.size() / 3) + 1;
  for (const std::string& name : known) {
    const size_t d = edit_distance(given, name);
    if (d < best_distance) best = name, best_distance = d;
  }
  return best;
}

// After a parse error: "did you mean ...?" for an unknown subcommand or an unknown --option of the subcommand given.
void suggest(CLI::App& app, int argc, char** argv) {
  if (argc < 2) return;
  std::vector<std::string> commands;
  for (const CLI::App* sub : app.get_subcommands({})) commands.push_back(sub->get_name());
  const std::string first = argv[1];
  if (first.empty() || first[0] == '-') return;
  if (std::find(commands.begin(), commands.end(), first) == commands.end()) {
    const std::string best = closest(first, commands);
    if (!best.empty()) std::cerr << "cpgold: unknown subcommand \"" << first << "\": did you mean \"" << best << "\"?\n";
    return;
  }
  CLI::App* sub = app.get_subcommand(first);
  std::vector<std::string> options;
  for (const CLI::Option* option : sub->get_options())
    for (const std::string& name : option->get_lnames()) options.push_back("--" + name);
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0 || arg == "--") continue;
    arg = arg.substr(0, arg.find('='));
    if (std::find(options.begin(), options.end(), arg) != options.end()) continue;
    const std::string best = closest(arg, options);
    if (!best.empty()) std::cerr << "cpgold " << first << ": unknown option " << arg << ": did you mean " << best << "?\n";
  }
}

std::string available_memory_text() {
  const cpgold::app::MachineResources machine = cpgold::app::machine_resources(".");
  return std::to_string(machine.memory_available / (1 << 20)) + " MiB";
}

// --format json (or --format=json) anywhere on the command line: every outcome, a parse error of the command line
// included, then prints one JSON object on standard output.
bool wants_json(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--format=json" || (arg == "--format" && i + 1 < argc && std::string(argv[i + 1]) == "json")) return true;
  }
  return false;
}

// Standard output must have taken everything (a full disk, a closed file): otherwise the command did not do its work.
int finish_output(const std::string& command, int code) {
  errno = 0;
  std::cout.flush();
  const bool failed = !std::cout.good() || std::fflush(stdout) != 0 || std::ferror(stdout);
  if (!failed) return code;
  const int error = errno;
  std::cerr << "cpgold " << command << ": error: cannot write standard output ("
            << (error ? std::strerror(error) : "a write failed: a full disk, a closed or full output") << "): the report is incomplete\n";
  return cpgold::app::kExitUnusable;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace cpgold::app;
  const bool json = wants_json(argc, argv);
  CLI::App app{"cpgold " CPGOLD_VERSION ": golden data and checks for context-parallel (CP) attention on THD layouts"};
  app.set_version_flag("--version", std::string(CPGOLD_VERSION) + " (instruction set " + cpgold::isa_level() + ")");
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
    if (json && e.get_exit_code() != 0) std::cout << json_error_text("arguments", e.what(), kExitUnusable);
    const int code = app.exit(e);
    if (code != 0) suggest(app, argc, argv);
    return finish_output("", code == 0 ? 0 : kExitUnusable);
  }
  for (CLI::App* sub : app.get_subcommands()) {
    const std::string name = sub->get_name();
    // An error: the message on stderr and, with --format json, the same as one JSON object on stdout. Whatever the
    // command printed before is left as it is (commands print their report last).
    auto error = [&](const std::string& field, const std::string& message, int code, const char* kind) {
      if (json) std::cout << json_error_text(field, message, code);
      std::cerr << "cpgold " << name << ": " << kind << message << "\n";  // std::cerr flushes std::cout first
      return finish_output(name, code);
    };
    try {
      return finish_output(name, runners.at(sub)());
    } catch (const cpgold::InputError& e) {
      return error(e.field(), e.what(), kExitUnusable, "error: ");
    } catch (const std::bad_alloc&) {
      // Input too large for this machine (gen and the fixture reader refuse most such cases up front).
      return error("memory",
                   "out of memory: the input is too large for the memory available (" + available_memory_text() +
                       "); make the case smaller (total_tokens_q, total_tokens_kv, seqlens_q, heads_q, dim_qk, "
                       "cp_size) or check a smaller file",
                   kExitUnusable, "error: ");
    } catch (const std::length_error& e) {
      return error("memory", std::string("the input is too large to hold in memory (") + e.what() + ")", kExitUnusable,
                   "error: ");
    } catch (const std::exception& e) {
      return error("internal", e.what(), 3, "internal error: ");
    }
  }
  return kExitUnusable;
}
