// `cpgold explain`: the chunk map, the per-rank per-step table, the work per rank and warnings for a case.
#include <fstream>
#include <iostream>
#include <memory>

#include "apps/case_options.hpp"
#include "apps/command_registry.hpp"
#include "sim/explain.hpp"
#include "sim/plan.hpp"

namespace cpgold::app {
namespace {

struct ExplainOptions {
  std::string format = "text";
  std::string svg;
};

RegisterCommand reg{"explain", [](CLI::App& app) {
  auto* sub = app.add_subcommand("explain", "Show how a case is split over CP ranks: chunk map, per-step tables, work, warnings");
  auto flags = std::make_shared<CaseFlags>();
  auto options = std::make_shared<ExplainOptions>();
  add_case_flags(*sub, flags);
  sub->add_option("--format", options->format, "text | json")->check(CLI::IsMember({"text", "json"}));
  sub->add_option("--svg", options->svg, "also write an SVG of the chunk map and the per-step tiles to this file");
  return std::function<int()>([flags, options] {
    const sim::CaseSpec spec = case_from_flags(*flags);
    const sim::Plan plan = sim::make_plan(spec);
    if (options->format == "json")
      std::cout << sim::explain_json(spec, plan).dump(2) << "\n";
    else
      std::cout << sim::explain_text(spec, plan);
    if (!options->svg.empty()) {
      std::ofstream out(options->svg);
      if (!out) fail_input("--svg", "cannot write \"", options->svg, "\"");
      out << sim::explain_svg(spec, plan);
      if (!out) fail_input("--svg", "cannot write \"", options->svg, "\"");
    }
    return kExitPass;
  });
}};

}  // namespace
}  // namespace cpgold::app
