#pragma once
// `cpgold explain --te-audit`: the TransformerEngine replay (sim/te/te_replay.hpp) and its visible-pairs audit
// (sim/te/te_audit.hpp) for both of TE's backends, next to cpgold's Plan: text, JSON (docs/explain-json.md, key
// "te_audit") and marks on explain's SVG. docs/te-audit.md describes what is replayed and how the audit decides.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/plan/plan.hpp"
#include "sim/te/te_audit.hpp"
#include "sim/te/te_replay.hpp"

namespace cpgold::sim {

// One field where cpgold's Plan and TE's replay of the same call disagree.
struct TePlanDifference {
  PassKind pass = PassKind::forward;
  int rank = 0, step = 0;
  std::string field, cpgold, te;
};

struct TeAuditReport {
  TeUserArguments user;
  bool pad_between_seqs = true;   // the setting the verdict is about
  // [0]: that setting, [1]: the other one; each [backend]: fused, flash3.
  std::vector<TeReplay> replays[2];
  std::vector<TeAudit> audits[2];
  bool compared = false;          // false: every backend refuses, nothing to compare the Plan with
  TeBackend compared_backend = TeBackend::fused;  // the replay the Plan is compared with (fused unless it refuses)
  std::vector<TePlanDifference> differences;
  // Some backend accepts the case and no accepting backend has a finding (for the setting of the verdict).
  bool exact() const;
};

TeAuditReport te_audit_report(const CaseSpec& spec, const Plan& plan, const TeUserArguments& user, bool pad_between_seqs);

nlohmann::ordered_json te_audit_json(const TeAuditReport& report);
std::string te_audit_text(const TeAuditReport& report);

// Findings listed per replay in text (the JSON lists up to kTeJsonFindings).
inline constexpr size_t kTeTextFindings = 20;
inline constexpr size_t kTeJsonFindings = 1000;

}  // namespace cpgold::sim
