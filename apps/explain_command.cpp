// `cpgold explain`: the chunk map, the per-rank per-step table, the work per rank and warnings for a case; for large
// layouts (W x W x sequences past sim::kSummaryPlanUnits) a summary unless --full. With --te-audit also the literal
// TransformerEngine replay and its visible-pairs audit (docs/te-audit.md); the exit code is then the audit's verdict.
#include <iostream>
#include <memory>

#include "apps/case_options.hpp"
#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "apps/machine_resources.hpp"
#include "fixtures/storage/output_file.hpp"
#include "sim/explain/explain.hpp"
#include "sim/explain/explain_request.hpp"
#include "sim/explain/explain_summary.hpp"
#include "sim/explain/explain_te.hpp"
#include "sim/plan/plan.hpp"
#include "sim/te/te_replay.hpp"

namespace cpgold::app {
namespace {

struct ExplainOptions {
  std::string format = "text";
  std::string svg;
  bool full = false, summary = false, force = false;
  bool te_audit = false;
  bool te = false;
  std::string te_pad_between_seqs = "true";
};

RegisterCommand reg{"explain", [](CLI::App& app) {
  auto* sub = app.add_subcommand("explain", "Show how a case is split over CP ranks: chunk map, per-step tables, work, warnings");
  auto flags = std::make_shared<CaseFlags>();
  auto options = std::make_shared<ExplainOptions>();
  add_case_flags(*sub, flags);
  sub->add_option("--format", options->format, "text | json")->check(CLI::IsMember({"text", "json"}));
  sub->add_option("--svg", options->svg, "also write an SVG of the chunk map and the per-step tiles to this file");
  sub->add_flag("--full", options->full, "every tile also for a large layout (default there: a summary)");
  sub->add_flag("--summary", options->summary, "per-rank totals and the first and worst sequences, whatever the size");
  sub->add_flag("--te", options->te,
                "TransformerEngine-specific output: list the per-rank counts where TE's pad_between_seqs=False "
                "shortcut (cu_seqlens // W) differs from the exact ones (without it, one line counts them; --te-audit "
                "implies it)");
  sub->add_flag("--te-audit", options->te_audit,
                "also replay what TransformerEngine 2.20 passes to every attention call (cuDNN and FlashAttention-3) and "
                "audit the pairs each call computes against the case's mask; exit 1 on a finding, 0 when exact");
  sub->add_option("--te-pad-between-seqs", options->te_pad_between_seqs,
                  "true | false: the pad_between_seqs the --te-audit verdict is about (true: what TE sets itself when "
                  "padded offsets are passed; false: the cu // W shortcut); both are reported")
      ->check(CLI::IsMember({"true", "false"}));
  sub->add_flag("--force", options->force, "with --svg: replace an existing file (a regular file only)");
  return std::function<int()>([flags, options] {
    if (options->full && options->summary) fail_input("--full", "cannot be combined with --summary: give one of them");
    if (options->force && options->svg.empty()) fail_input("--force", "replaces the --svg file only: give --svg FILE");
    if (options->te_audit && options->summary)
      fail_input("--te-audit", "needs every tile and cannot be combined with --summary");
    const nlohmann::json case_object = case_object_from_flags(*flags);
    const sim::CaseSpec spec = sim::parse_case(case_object);
    // The SVG's destination by gen's rules, before any work: no existing path replaced without --force, only a
    // regular file with it, nothing left behind by a failed write (fx::write_text_file). The SVG is written before the
    // report is printed: a failed write then prints no report (with --format json, one {"error": ...} object instead).
    if (!options->svg.empty()) fx::check_destination(options->svg, options->force);
    if (options->te_audit && spec.cp_size < 2)
      fail_input("--te-audit", "cp_size ", spec.cp_size, " runs TransformerEngine without context parallelism; the "
                 "replay covers CP (cp_size >= 2)");
    // A full plan grows with W x W x sequences: large layouts get the summary, computed from the partition alone
    // (--te-audit needs every tile, as --full does).
    const bool full = options->full || options->te_audit;
    const sim::ExplainRequest request{spec, options->summary, full, options->te || options->te_audit};
    if (sim::explains_summary(request)) {
      const sim::Explanation summary = sim::explain(request);
      if (!options->svg.empty())
        fx::write_text_file(options->svg, sim::summary_svg(spec, *summary.summary), options->force);
      if (options->format == "json") std::cout << json_text(sim::explanation_json(request, summary));
      else std::cout << sim::explanation_text(request, summary);
      return kExitPass;
    }
    const MachineResources machine = machine_resources(".");
    if (full && sim::full_explain_bytes(spec) > double(machine.memory_available))
      fail_input(options->full ? "--full" : "--te-audit", "the full plan of this case needs about ",
                 sim::full_explain_bytes(spec) / 1e9, " GB (", sim::plan_units(spec), " units of W x W x sequences) but ",
                 double(machine.memory_available) / 1e9, " GB are available (", machine.memory_source,
                 "); use the summary (drop ", options->full ? "--full" : "--te-audit", ")");
    const sim::Explanation explanation = sim::explain(request);
    const sim::Plan& plan = *explanation.plan;
    std::unique_ptr<sim::TeAuditReport> te;
    if (options->te_audit)
      te = std::make_unique<sim::TeAuditReport>(sim::te_audit_report(spec, plan, sim::te_user_arguments(case_object),
                                                                     options->te_pad_between_seqs == "true"));
    if (!options->svg.empty())
      fx::write_text_file(options->svg, sim::explain_svg(spec, plan, te.get()), options->force);
    if (options->format == "json") {
      nlohmann::ordered_json j = sim::explanation_json(request, explanation);
      if (te) j["te_audit"] = sim::te_audit_json(*te);
      std::cout << json_text(j);
    } else {
      std::cout << sim::explanation_text(request, explanation);
      if (te) std::cout << sim::te_audit_text(*te);
    }
    return te && !te->exact() ? kExitFail : kExitPass;
  });
}};

}  // namespace
}  // namespace cpgold::app
