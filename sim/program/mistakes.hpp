#pragma once
// Modelled CP mistakes: each is one small change of the Plan (the calls of some tiles) or of how the executor runs it
// (the rows each rank holds, the merge rule), so that the simulator can replay a case under the mistake and a failed
// check can be compared with what that mistake gives (check/diagnosis/replay.hpp; docs/diagnosis.md, "Replay").
// The catalogue:
//   layout   contiguous_chunks   rank r holds chunks 2r and 2r+1 of every sequence; the steps still assume r, 2W-1-r
//            chunks_swapped      rank r holds chunk 2W-1-r where chunk r belongs and the other way round
//            ranks_reversed      rank r holds the chunks of rank W-1-r
//   counts   counts_cu_div_w     one count per rank and sequence, cu_seqlens[b+1] // W - cu_seqlens[b] // W: the
//                                rank takes that many rows of its block of the sequence as tokens (a half step its
//                                part of them), pad rows included, and drops the valid rows past it
//            counts_cu_div_2w    TransformerEngine's pad_between_seqs=False shortcut: cu_seqlens // W for a step that
//                                reads a rank's two chunks, // 2W for a step that reads one
//   rows     last_row_dropped    every call leaves out the last valid query row of each sequence on each rank (a
//                                count one short): that row is never computed, its keys stay
//   mask     right_edge+1:S, right_edge-1:S, left_edge+1:S, left_edge-1:S   a mask edge one key off in the tiles of
//            section S (diagonal, lower, upper, all) or of every tile (S = every)
//   merge    running_o_not_rescaled, step_o_not_rescaled, double_rescale  the online merge of step partials with a
//            rescale left out or applied twice; keyless_step_lse_0, keyless_step_lse_inf  a step that holds none of a
//            row's keys merged with LSE 0 (adds exp(0) = 1 to the sum) or +inf instead of -inf
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sim/program/executor.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::sim {

enum class MistakeFamily { layout, counts, mask, merge, rows };
std::string_view mistake_family_name(MistakeFamily family);  // "layout", "counts", "mask", "merge"

// The tiles a mistake changes: pass, rank, step.
struct TileRef {
  PassKind pass = PassKind::forward;
  int rank = 0, step = 0;
};

struct Mistake {
  std::string name;         // "contiguous_chunks", "right_edge+1:diagonal", ...
  MistakeFamily family = MistakeFamily::layout;
  std::string description;  // one sentence, for reports
  Plan plan;                // the Plan with the mistake's calls (= the correct Plan for layout and merge mistakes)
  RunVariation variation;   // rows held and merge rule
  // The tiles where the mistake acts: whose call it changes (mask, counts), whose forward partial it merges otherwise
  // (merge); empty for layout mistakes (every tile of every rank).
  std::vector<TileRef> changed_tiles;
};

// The catalogue's names for this plan's sections, whether or not each changes something here (make_mistake says).
std::vector<std::string> mistake_catalogue(const Plan& plan);
// Every mistake of the catalogue that changes something for this plan (a mask edge of a mask the case does not have,
// the count shortcut where every length splits evenly, a merge of one step are left out).
std::vector<std::string> mistake_names(const Plan& plan);
// One of them built for the plan; nullopt for a name the catalogue does not hold or that changes nothing here.
std::optional<Mistake> make_mistake(const Plan& plan, const std::string& name);


}  // namespace cpgold::sim
