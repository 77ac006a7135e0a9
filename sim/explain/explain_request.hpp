#pragma once
// What `cpgold explain` and cpgold.explain ask for, and what they answer: the case explained tile by tile (its Plan),
// or, for a large layout (sim::plan_units past sim::kSummaryPlanUnits) or on request, summarised from the partition
// alone. The rule that picks one is here, once.
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "sim/case/case_spec.hpp"
#include "sim/explain/explain_summary.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::sim {

struct ExplainRequest {
  CaseSpec spec;          // validated (sim::parse_case)
  bool summary = false;   // the summary whatever the size
  bool full = false;      // every tile whatever the size
  bool te = false;        // the TransformerEngine-specific lines of the text
};

// request.summary, or a layout too large for every tile without request.full.
bool explains_summary(const ExplainRequest& request);

struct Explanation {
  std::optional<LayoutSummary> summary;  // exactly one of summary and plan
  std::optional<Plan> plan;
};
Explanation explain(const ExplainRequest& request);

// explain_json / summary_json, and explain_text / summary_text, of the explanation.
nlohmann::ordered_json explanation_json(const ExplainRequest& request, const Explanation& explanation);
std::string explanation_text(const ExplainRequest& request, const Explanation& explanation);

}  // namespace cpgold::sim
