#pragma once
// Modelled CP mistakes: each is one small change of the Plan (the calls of some tiles) or of how the executor runs it
// (the rows each rank holds, the merge rule), so that the simulator can replay a case under the mistake and a failed
// check can be compared with what that mistake gives (check/diagnosis/replay.hpp; docs/diagnosis.md, "Replay").
// The catalogue:
//   layout   contiguous_chunks   rank r holds chunks 2r and 2r+1 of every sequence; the steps still assume r, 2W-1-r
//            chunks_swapped      rank r holds chunk 2W-1-r where chunk r belongs and the other way round
//            ranks_reversed      rank r holds the chunks of rank W-1-r
//            chunks_swapped:rK   rank K alone holds its chunks swapped (for the output reorder below)
//            output_chunks_swapped, output_chunks_swapped:rK   every rank (or rank K only) computes on the right
//                                rows but returns O and LSE with its two chunks swapped (a reorder of the outputs
//                                only): its dO arrives in that order, so the backward reads each row's dO from the
//                                row the swap puts there; dQ, dK, dV come back in the right rows
//   counts   counts_cu_div_w     one count per rank and sequence, cu_seqlens[b+1] // W - cu_seqlens[b] // W: the
//                                rank takes that many rows of its block of the sequence as tokens (a half step its
//                                part of them), pad rows included, and drops the valid rows past it
//            counts_cu_div_2w    TransformerEngine's pad_between_seqs=False shortcut: cu_seqlens // W for a step that
//                                reads a rank's two chunks, // 2W for one that reads one
//   offsets  q_offsets_unpadded, kv_offsets_unpadded   a side's sequence starts in the step's tensors taken from the
//                                unpadded cu_seqlens (cu // W for a rank's shard, cu // 2W for a half, cu in sequence
//                                order) instead of the padded ones: sequence b reads (and writes) rows shifted by
//                                cu[b] // d - cu_padded[b] // d, the positions unchanged
//   rows     last_row_dropped    every call leaves out the last valid query row of each sequence on each rank (a
//                                count one short): that row is never computed, its keys stay
//   mask     right_edge+1:S, right_edge-1:S, left_edge+1:S, left_edge-1:S   a mask edge one key off in the tiles of
//            section S (diagonal, lower, upper, all) or of every tile (S = every)
//            diagonal_unmasked   the diagonal tiles (a rank's own chunks, causal) computed without the mask
//            causal_local:lower, causal_local:upper   the off-diagonal tiles of a section computed with the kernel's
//                                causal mask on the block's own rows (bottom-right on the step's counts), as a step
//                                that passes causal=True where it should not
//            diagonal_keyless    the diagonal tiles' rows see no key: the causal window (-1, 0) read as the empty band
//                                [i + 1, i] (FlashAttention-4 under TransformerEngine, docs/findings/fa-3-*.md)
//   merge    running_o_not_rescaled, step_o_not_rescaled, double_rescale  the online merge of step partials with a
//            rescale left out or applied twice; keyless_step_lse_0, keyless_step_lse_inf  a step that holds none of a
//            row's keys merged with LSE 0 (adds exp(0) = 1 to the sum) or +inf instead of -inf;
//            merge_lse_in_dtype  the online merge with the LSE (each partial's and the running one) kept in the case's
//            dtype (bf16, fp16) instead of float32 (merge_o_in_dtype, the running O in the dtype, runs too but is not
//            in the catalogue: it stays inside the check's budgets on every case tried)
//   reduction dq_overwritten     each ring step's dQ partial written over the rank's dQ rows instead of added (the
//                                backward ring holds the rank's own K/V last: its partial is what remains)
//            dkv_own_only        dK/dV of a rank hold only the partials the rank computed itself on its own K/V:
//                                the other ranks' contributions never reduced into them (a dK/dV partial written over
//                                the travelling buffer instead of added gives the same: the owner writes it last)
//            dkv_kept_local      (p2p) every dK/dV partial a rank computes, whichever rank's K/V it read, added to
//                                the rank's own dK/dV rows at the same local rows: the ring never carries dK/dV home
// The offsets, merge_lse_in_dtype and reduction mistakes run on a backend of their own (run_mistake); the others are a
// Plan and a RunVariation that run_cp_oracle runs.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sim/program/executor.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::sim {

enum class MistakeFamily { layout, counts, mask, merge, rows, offsets, reduction };
std::string_view mistake_family_name(MistakeFamily family);  // "layout", "counts", "mask", "merge", "rows", ...

// The tiles a mistake changes: pass, rank, step.
struct TileRef {
  PassKind pass = PassKind::forward;
  int rank = 0, step = 0;
};

// What a mistaken run does beyond its Plan and RunVariation (run_mistake): how the step partials of the gradients
// are combined, which sequence starts the steps' calls read, in which precision the forward partials are merged.
struct RunHooks {
  enum class Gradients { summed, dq_overwritten, dkv_overwritten, dkv_own_only, dkv_kept_local };
  Gradients gradients = Gradients::summed;
  bool q_offsets_unpadded = false, kv_offsets_unpadded = false;
  bool lse_in_dtype = false, o_in_dtype = false;
  DType dtype = DType::fp32;  // the precision of lse_in_dtype / o_in_dtype
  // [W][local row] -> global row of the dO each rank reads (outputs returned in another order); empty: the partition's
  std::vector<std::vector<int64_t>> dout_rows;
  bool any() const {
    return gradients != Gradients::summed || q_offsets_unpadded || kv_offsets_unpadded || lse_in_dtype || o_in_dtype ||
           !dout_rows.empty();
  }
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
  RunHooks hooks;           // any(): run_mistake runs it on its own backend
  // [W][local row] -> global row that a rank's returned O and LSE hold (an output reorder); empty: the rows it
  // computes (the variation's or the partition's).
  std::vector<std::vector<int64_t>> output_q_rows;
};

// The catalogue's names for this plan's sections, whether or not each changes something here (make_mistake says).
// Without a dtype: the mistakes that are a Plan and a RunVariation (run_cp_oracle runs them); with the case's dtype:
// every mistake, those run by run_mistake's own backend included (the merge precision ones only below fp32).
std::vector<std::string> mistake_catalogue(const Plan& plan);
std::vector<std::string> mistake_catalogue(const Plan& plan, DType dtype);
// Every mistake of the catalogue that changes something for this plan (a mask edge of a mask the case does not have,
// the count shortcut where every length splits evenly, a merge of one step are left out).
std::vector<std::string> mistake_names(const Plan& plan);
std::vector<std::string> mistake_names(const Plan& plan, DType dtype);
// One of them built for the plan; nullopt for a name the catalogue does not hold or that changes nothing here.
std::optional<Mistake> make_mistake(const Plan& plan, const std::string& name);
std::optional<Mistake> make_mistake(const Plan& plan, const std::string& name, DType dtype);

// Runs the case under the mistake in float64: run_cp_oracle on the mistake's Plan and RunVariation, or, for a mistake
// with hooks, the CP program (sim/program/cp_program.hpp) on a backend that does what the hooks say (the same
// float64 attention per tile; merges, exchanges and accumulations otherwise as the oracle's). options.variation is
// the mistake's; options.kernel and the head range are not used by the hooks' backend.
CpRun<double> run_mistake(const Mistake& mistake, const CaseInputs& inputs, ExecutorOptions options);


}  // namespace cpgold::sim
