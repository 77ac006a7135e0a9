// `cpgold helpers-check DUMP.h5`: an outside implementation's THD CP helper kernels (TransformerEngine's tex.thd_*)
// against the CPU twins, bit for bit, from a dump of its calls (docs/helpers-check.md). Exit 0 every call passes,
// 1 any call fails, 2 unusable dump.
#include <iostream>

#include "apps/command_registry.hpp"
#include "fixtures/thd_helpers_check.hpp"
#include "reference/input_error.hpp"

namespace cpgold::app {
namespace {

struct HelpersArgs {
  std::string dump;
  std::string format = "text";
};

int run_helpers_check(const HelpersArgs& args) {
  if (args.format != "text" && args.format != "json")
    fail_input("--format", "expected text or json, got \"", args.format, "\"");
  const fx::HelpersReport report = fx::check_thd_helpers(args.dump);
  if (args.format == "json") std::cout << fx::to_json(report).dump(2) << "\n";
  else std::cout << fx::render_text(report);
  return report.pass() ? kExitPass : kExitFail;
}

const RegisterCommand registered("helpers-check", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand(
      "helpers-check", "check a dump of THD CP helper kernel calls (TransformerEngine tex.thd_*) against the CPU twins");
  auto args = std::make_shared<HelpersArgs>();
  sub->add_option("dump", args->dump, "HDF5 dump of the calls (docs/helpers-check.md)")->required();
  sub->add_option("--format", args->format, "text or json");
  return [=] {
    try {
      return run_helpers_check(*args);
    } catch (const InputError& e) {
      if (args->format != "json") throw;
      // With --format json, stdout stays one JSON document also on error; main's text still goes to stderr.
      nlohmann::ordered_json j;
      j["error"] = {{"field", e.field()}, {"message", e.what()}, {"exit_code", kExitUnusable}};
      std::cout << j.dump(2) << "\n";
      throw;
    }
  };
});

}  // namespace
}  // namespace cpgold::app
