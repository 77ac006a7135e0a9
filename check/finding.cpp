#include "check/finding.hpp"

#include "reference/enum_names.hpp"

namespace cpgold::fx {

constexpr std::pair<DiagnosisKind, std::string_view> kDiagnosisKindNames[] = {
    {DiagnosisKind::inputs_mismatch, "inputs_mismatch"}, {DiagnosisKind::chunk_order, "chunk_order"},
    {DiagnosisKind::head_mapping, "head_mapping"}, {DiagnosisKind::softmax_scale, "softmax_scale"},
    {DiagnosisKind::mask_edge, "mask_edge"}, {DiagnosisKind::lse_convention, "lse_convention"},
    {DiagnosisKind::merge, "merge"}, {DiagnosisKind::per_rank_counts, "per_rank_counts"},
    {DiagnosisKind::tail_rows_missing, "tail_rows_missing"}, {DiagnosisKind::pad_rows_not_zero, "pad_rows_not_zero"},
    {DiagnosisKind::nonfinite_leak, "nonfinite_leak"}, {DiagnosisKind::unexplained, "unexplained"}};

std::string_view diagnosis_kind_name(DiagnosisKind kind) { return name_in(kDiagnosisKindNames, kind); }

std::optional<DiagnosisKind> parse_diagnosis_kind(std::string_view name) { return parse_in(kDiagnosisKindNames, name); }

std::string render_diagnosis_text(const std::vector<Diagnosis>& findings) {
  std::string out;
  for (const Diagnosis& d : findings)
    out += "diagnosis: " + std::string(diagnosis_kind_name(d.kind)) + ": " + d.evidence + "\n";
  return out;
}

nlohmann::ordered_json diagnosis_json(const std::vector<Diagnosis>& findings) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const Diagnosis& d : findings) {
    nlohmann::ordered_json j;
    j["kind"] = std::string(diagnosis_kind_name(d.kind));
    j["evidence"] = d.evidence;
    j["where"] = d.where.is_null() ? nlohmann::ordered_json::object() : d.where;
    out.push_back(j);
  }
  return out;
}

}  // namespace cpgold::fx
