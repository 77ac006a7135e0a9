#pragma once
// What kind of CP bug a failed check is (docs/diagnosis.md). Runs only when a check fails: each hypothesis is tested
// by a computation over the candidate, the golden, the fixture's inputs and the Plan, never guessed from one number:
//   chunk_order        candidate rows match the golden rows of another chunk, rank or order (block matching);
//   head_mapping       candidate heads match other golden heads, or attention recomputed with other KV heads;
//   softmax_scale      candidate matches attention recomputed with another scale, or gradients the golden times a
//                      constant;
//   mask_edge          candidate matches attention recomputed with a mask edge moved (off by one, top-left, pad keys);
//   lse_convention     LSE = golden + c, golden x log2 e, the exp2-domain max mixed with ln l, +inf on keyless rows;
//   merge              the candidate's own step partials merge to the golden but its merged outputs differ, or the
//                      replay of a wrong merge rule reproduces the outputs;
//   per_rank_counts    the replay of per-rank counts from the cu_seqlens // W shortcut reproduces the outputs;
//   tail_rows_missing  the wrong rows are the last k valid rows of sequences (k constant or cu // W), left unwritten;
//   pad_rows_not_zero  finite non-zero values on pad or tail rows;
//   nonfinite_leak     NaN or Inf on pad rows or in valid rows;
//   inputs_mismatch    the inputs digests differ, or the outputs are well-formed attention that these inputs cannot
//                      give;
//   unexplained        none of the above fits.
// Findings come most specific first; a less specific finding is kept only when it explains rows that the ones before
// it do not. Before them, cause first, the replayed mistakes (check/diagnosis/replay.hpp) whose simulation the outputs match:
// a mistake's finding never hides the symptoms it causes (a NaN leak of the pad rows that wrong counts read).
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace cpgold::fx {

enum class DiagnosisKind {
  inputs_mismatch,
  chunk_order,
  head_mapping,
  softmax_scale,
  mask_edge,
  lse_convention,
  merge,
  per_rank_counts,
  tail_rows_missing,
  pad_rows_not_zero,
  nonfinite_leak,
  unexplained,
};
std::string_view diagnosis_kind_name(DiagnosisKind kind);  // "chunk_order", ...
std::optional<DiagnosisKind> parse_diagnosis_kind(std::string_view name);
inline constexpr DiagnosisKind kAllDiagnosisKinds[] = {
    DiagnosisKind::inputs_mismatch, DiagnosisKind::chunk_order,    DiagnosisKind::head_mapping,
    DiagnosisKind::softmax_scale,   DiagnosisKind::mask_edge,      DiagnosisKind::lse_convention,
    DiagnosisKind::merge,           DiagnosisKind::per_rank_counts, DiagnosisKind::tail_rows_missing,
    DiagnosisKind::pad_rows_not_zero, DiagnosisKind::nonfinite_leak, DiagnosisKind::unexplained};

// One supported hypothesis.
struct Diagnosis {
  DiagnosisKind kind = DiagnosisKind::unexplained;
  std::string evidence;          // one sentence: which rows, which chunk matched which, which scale ...
  nlohmann::ordered_json where;  // {"results": ["o@r1", ...], "ranks": [...], "sequences": [...], "rows": n, ...}
};

// "diagnosis: <kind>: <evidence>" lines.
std::string render_diagnosis_text(const std::vector<Diagnosis>& findings);
nlohmann::ordered_json diagnosis_json(const std::vector<Diagnosis>& findings);  // [{"kind", "evidence", "where"}]

}  // namespace cpgold::fx
