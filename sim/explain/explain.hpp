#pragma once
// Renderings of a Plan for `cpgold explain`: the chunk map (which global rows each rank holds, valid vs pad), the
// per-rank per-step table with the metadata each attention call receives, the work per rank and step (visible mask
// area) with its imbalance, and warnings where the cu_seqlens // W shortcut differs from the exact counts.
// docs/explain-json.md documents the JSON keys; they are stable.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/plan/plan.hpp"

namespace cpgold::sim {

// Visible (q, k) pairs of one tile times its q heads; 0 for a skipped tile.
int64_t tile_work(const Tile& tile);

// Warnings for layouts where get_cu_seqlens_on_cp_rank's pad_between_seqs=False shortcut (cu // W, cu // (2W)) gives
// other counts than the exact clamp formula (TransformerEngine issue 3331).
std::vector<std::string> shortcut_count_warnings(const Plan& plan);

nlohmann::ordered_json explain_json(const CaseSpec& spec, const Plan& plan);
// te: list shortcut_count_warnings (they concern TransformerEngine's pad_between_seqs only); without it one line says
// how many there are and how to list them.
std::string explain_text(const CaseSpec& spec, const Plan& plan, bool te = false);
struct TeAuditReport;
// SVG: the chunk map, then per forward step the (q chunk, k chunk) tiles each rank computes; with a TE audit, the
// (q chunk, k chunk) cells holding wrong pairs of TE's forward calls are outlined in red.
std::string explain_svg(const CaseSpec& spec, const Plan& plan, const TeAuditReport* te_audit = nullptr);

}  // namespace cpgold::sim
