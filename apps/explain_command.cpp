// `cpgold explain`: the chunk map, the per-rank per-step table, the work per rank and warnings for a case; for large
// layouts (W x W x sequences past sim::kSummaryPlanUnits) a summary unless --full.
#include <fstream>
#include <iostream>
#include <memory>

#include "apps/case_options.hpp"
#include "apps/command_registry.hpp"
#include "apps/machine_resources.hpp"
#include "sim/explain.hpp"
#include "sim/explain_summary.hpp"
#include "sim/plan.hpp"

namespace cpgold::app {
namespace {

struct ExplainOptions {
  std::string format = "text";
  std::string svg;
  bool full = false, summary = false;
};

void write_svg(const std::string& path, const std::string& svg) {
  std::ofstream out(path);
  if (!out) fail_input("--svg", "cannot write \"", path, "\"");
  out << svg;
  if (!out) fail_input("--svg", "cannot write \"", path, "\"");
}

RegisterCommand reg{"explain", [](CLI::App& app) {
  auto* sub = app.add_subcommand("explain", "Show how a case is split over CP ranks: chunk map, per-step tables, work, warnings");
  auto flags = std::make_shared<CaseFlags>();
  auto options = std::make_shared<ExplainOptions>();
  add_case_flags(*sub, flags);
  sub->add_option("--format", options->format, "text | json")->check(CLI::IsMember({"text", "json"}));
  sub->add_option("--svg", options->svg, "also write an SVG of the chunk map and the per-step tiles to this file");
  sub->add_flag("--full", options->full, "every tile also for a large layout (default there: a summary)");
  sub->add_flag("--summary", options->summary, "per-rank totals and the first and worst sequences, whatever the size");
  return std::function<int()>([flags, options] {
    if (options->full && options->summary) fail_input("--full", "cannot be combined with --summary: give one of them");
    const sim::CaseSpec spec = case_from_flags(*flags);
    // A full plan grows with W x W x sequences: large layouts get the summary, computed from the partition alone.
    if (options->summary || (!options->full && sim::plan_units(spec) > sim::kSummaryPlanUnits)) {
      const sim::LayoutSummary summary = sim::summarize_layout(spec);
      if (options->format == "json") std::cout << sim::summary_json(spec, summary).dump(2) << "\n";
      else std::cout << sim::summary_text(spec, summary);
      if (!options->svg.empty()) write_svg(options->svg, sim::summary_svg(spec, summary));
      return kExitPass;
    }
    const MachineResources machine = machine_resources(".");
    if (options->full && sim::full_explain_bytes(spec) > double(machine.memory_available))
      fail_input("--full", "the full plan of this case needs about ", sim::full_explain_bytes(spec) / 1e9, " GB (",
                 sim::plan_units(spec), " units of W x W x sequences) but ", double(machine.memory_available) / 1e9,
                 " GB are available (", machine.memory_source, "); use the summary (drop --full)");
    const sim::Plan plan = sim::make_plan(spec);
    if (options->format == "json")
      std::cout << sim::explain_json(spec, plan).dump(2) << "\n";
    else
      std::cout << sim::explain_text(spec, plan);
    if (!options->svg.empty()) write_svg(options->svg, sim::explain_svg(spec, plan));
    return kExitPass;
  });
}};

}  // namespace
}  // namespace cpgold::app
