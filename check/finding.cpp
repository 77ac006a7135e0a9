#include "check/finding.hpp"

namespace cpgold::fx {

std::string_view diagnosis_kind_name(DiagnosisKind kind) {
  switch (kind) {
    case DiagnosisKind::inputs_mismatch: return "inputs_mismatch";
    case DiagnosisKind::chunk_order: return "chunk_order";
    case DiagnosisKind::head_mapping: return "head_mapping";
    case DiagnosisKind::softmax_scale: return "softmax_scale";
    case DiagnosisKind::mask_edge: return "mask_edge";
    case DiagnosisKind::lse_convention: return "lse_convention";
    case DiagnosisKind::merge: return "merge";
    case DiagnosisKind::per_rank_counts: return "per_rank_counts";
    case DiagnosisKind::tail_rows_missing: return "tail_rows_missing";
    case DiagnosisKind::pad_rows_not_zero: return "pad_rows_not_zero";
    case DiagnosisKind::nonfinite_leak: return "nonfinite_leak";
    case DiagnosisKind::unexplained: return "unexplained";
  }
  return "?";
}

std::optional<DiagnosisKind> parse_diagnosis_kind(std::string_view name) {
  for (DiagnosisKind kind : kAllDiagnosisKinds)
    if (diagnosis_kind_name(kind) == name) return kind;
  return std::nullopt;
}

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
