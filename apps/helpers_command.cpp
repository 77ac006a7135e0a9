// `cpgold helpers-check DUMP.h5`: an outside implementation's THD CP helper kernels (TransformerEngine's tex.thd_*)
// against the CPU twins, bit for bit, from a dump of its calls (docs/helpers-check.md). Exit 0 every call passes,
// 1 any call fails, 2 unusable dump.
#include <iostream>

#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "check/thd_helpers/helpers_check.hpp"
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
  if (args.format == "json") std::cout << json_text(fx::to_json(report));
  else std::cout << fx::render_text(report);
  return report.pass() ? kExitPass : kExitFail;
}

const RegisterCommand registered("helpers-check", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand(
      "helpers-check", "check a dump of THD CP helper kernel calls (TransformerEngine tex.thd_*) against the CPU twins");
  auto args = std::make_shared<HelpersArgs>();
  sub->add_option("dump", args->dump, "HDF5 dump of the calls (docs/helpers-check.md)")->required();
  sub->add_option("--format", args->format, "text or json");
  // With --format json, main prints every error as one JSON object ({"error": ...}) on stdout as well.
  return [=] { return run_helpers_check(*args); };
});

}  // namespace
}  // namespace cpgold::app
