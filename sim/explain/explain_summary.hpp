#pragma once
// `explain` for layouts too large to print tile by tile: per-rank totals and the first and the worst sequences,
// computed from the partition alone in O(rows + sequences x ranks). A Plan holds W x W tiles per pass, each with
// metadata per sequence (W^2 x sequences), which for 10,000 sequences at W = 64 is gigabytes; this never builds one.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/case/case_spec.hpp"

namespace cpgold::sim {

struct RankTotals {
  int64_t q_rows = 0, q_valid = 0, kv_rows = 0, kv_valid = 0;
  int64_t work = 0;  // forward work: visible (q, k) pairs x q heads the rank computes (as explain's work table)
};

struct SequenceSplit {
  int sequence = 0;
  int32_t length_q = 0, length_kv = 0, padded_q = 0;
  std::vector<int64_t> work;  // [W] forward work of this sequence on each rank
  double imbalance = 1.0;     // max / mean of `work` (1 when the sequence has no work)
};

struct LayoutSummary {
  int cp_size = 1;
  int batch = 0;
  int64_t tokens_q = 0, tokens_kv = 0, rows_q = 0, rows_kv = 0;
  std::vector<RankTotals> ranks;  // [W]
  double imbalance = 1.0;         // max / mean of the ranks' forward work
  std::vector<SequenceSplit> first, worst;  // the first sequences and the most unevenly split ones
  int64_t plan_units = 0;         // W x W x sequences: what a full Plan's size grows with
};

// Plans of more than this many units (W x W x sequences) are summarised unless the caller asks for everything.
inline constexpr int64_t kSummaryPlanUnits = int64_t{1} << 20;
int64_t plan_units(const CaseSpec& spec);
// Bytes a full Plan and its rendering need, measured at about 380 bytes per unit (lab/records/perf.md, explain).
double full_explain_bytes(const CaseSpec& spec);

// `shown`: how many first and worst sequences to keep.
LayoutSummary summarize_layout(const CaseSpec& spec, int shown = 3);
std::string summary_text(const CaseSpec& spec, const LayoutSummary& summary);
nlohmann::ordered_json summary_json(const CaseSpec& spec, const LayoutSummary& summary);
std::string summary_svg(const CaseSpec& spec, const LayoutSummary& summary);

}  // namespace cpgold::sim
