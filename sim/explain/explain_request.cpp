#include "sim/explain/explain_request.hpp"

#include "sim/explain/explain.hpp"

namespace cpgold::sim {

bool explains_summary(const ExplainRequest& request) {
  return request.summary || (!request.full && plan_units(request.spec) > kSummaryPlanUnits);
}

Explanation explain(const ExplainRequest& request) {
  Explanation out;
  if (explains_summary(request)) out.summary = summarize_layout(request.spec);
  else out.plan = make_plan(request.spec);
  return out;
}

nlohmann::ordered_json explanation_json(const ExplainRequest& request, const Explanation& explanation) {
  return explanation.summary ? summary_json(request.spec, *explanation.summary)
                             : explain_json(request.spec, *explanation.plan);
}

std::string explanation_text(const ExplainRequest& request, const Explanation& explanation) {
  return explanation.summary ? summary_text(request.spec, *explanation.summary)
                             : explain_text(request.spec, *explanation.plan, request.te);
}

}  // namespace cpgold::sim
