#pragma once
// The CP Plan: pure metadata, no tensors. For every rank and step of the forward and the backward: the section, the
// KV owner, which tensors the step reads (rank-local, a read_half half, sequence order), the per-step cu_seqlens,
// padded offsets, max_seqlen, mask and window exactly as TransformerEngine passes them (StepMetadata), the
// AttentionCall a position-aware kernel needs (segments with global positions), and the messages between ranks.
// The CPU executor and every GPU executor run the same Plan; docs/cp-plan.md describes each comm type.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "reference/attention_call.hpp"
#include "reference/mask.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/plan/partition.hpp"

namespace cpgold::sim {

enum class StepSection { diagonal, lower, upper, all };
std::string_view section_name(StepSection section);

enum class PassKind { forward, backward };
std::string_view pass_name(PassKind pass);  // "forward", "backward"

// Row space of the tensor a step reads on its rank.
enum class StepSpace {
  rank_local,      // the rank's W-way dual-chunk shard (p2p, all_gather Q)
  group_local,     // a2a+p2p: after the a2a, the P-way dual-chunk shard of the rank's p2p index, h / a2a_size heads
  sequence_order,  // a2a: all sequences in global order, h / W heads; all_gather KV: all heads
};
std::string_view space_name(StepSpace space);  // "rank_local", "group_local", "sequence_order"

// What TransformerEngine passes to the attention call of this step (docs/cp-layout.md, "p2p (ring)" to "a2a+p2p").
struct StepMetadata {
  std::vector<int32_t> cu_seqlens_q;           // [B+1] actual per-step counts (exact clamp formula)
  std::vector<int32_t> cu_seqlens_kv;          // [B+1]
  std::vector<int32_t> cu_seqlens_q_padded;    // [B+1] offsets in the step's Q tensor
  std::vector<int32_t> cu_seqlens_kv_padded;   // [B+1] offsets in the step's KV tensor
  int32_t max_seqlen_q = 0, max_seqlen_kv = 0;              // the value TE passes (padded max rounded to 64, /W...)
  int32_t max_seqlen_q_exact = 0, max_seqlen_kv_exact = 0;  // the largest per-sequence count of the step
  std::string mask;                            // "padding_causal", "padding", "padding_causal_bottom_right"
  Window window;                               // window TE passes (all_gather: its per-step adjusted window)
};

// One attention call of one rank at one step.
struct Tile {
  int rank = 0;
  int step = 0;
  StepSection section = StepSection::all;
  int kv_owner = -1;             // global rank whose KV shard the tile reads; -1: all ranks' KV (a2a, all_gather)
  StepSpace q_space = StepSpace::rank_local, kv_space = StepSpace::rank_local;
  HalfSelect q_half = HalfSelect::full, kv_half = HalfSelect::full;  // read_half of the space's tensor
  int q_chunks[2] = {-1, -1};    // chunk ids the Q rows come from, -1 unused (W-way; for a2a+p2p the ring-level
                                 // 2*W_p2p-way ids); for explain and SVG
  int kv_chunks[2] = {-1, -1};
  int head_begin = 0, head_end = 0;        // global q heads of the tile
  int kv_head_begin = 0, kv_head_end = 0;  // global kv heads
  bool computed = true;          // false: the window leaves the tile empty for every sequence, so it is skipped
  StepMetadata te;
  AttentionCall call;            // q_rows / kv_rows are the rows of the step's (possibly halved) tensors
};

enum class Payload { q, k, v, dout, o, lse, kv, dkv, dq, dk, dv };
std::string_view payload_name(Payload payload);

// A message: `rows` rows of `payload` (heads [head_begin, head_end) of the payload's tensor) belonging to the shard of
// `shard_owner` go from `from_rank` to `to_rank`, delivered after step `after_step` computes (-1: before step 0;
// == steps: after the last step).
struct Message {
  int after_step = -1;
  int from_rank = 0, to_rank = 0;
  Payload payload = Payload::kv;
  int shard_owner = 0;
  int head_begin = 0, head_end = 0;
  int64_t rows = 0;
};

struct PassPlan {
  int steps = 0;
  std::vector<Tile> tiles;        // sorted by (rank, step); one per rank and step, skipped ones with computed=false
  std::vector<Message> messages;  // in delivery order
  const Tile& tile(int rank, int step) const { return tiles[static_cast<size_t>(rank * steps + step)]; }
};

struct Plan {
  CommType comm = CommType::p2p;
  int cp_size = 1;
  int a2a_size = 1;   // a2a+p2p: ranks per a2a group (consecutive); 1 for p2p and all_gather; W for a2a
  int p2p_size = 1;   // ring length: W for p2p, W / a2a_size for a2a+p2p, 1 otherwise
  Partition partition;        // W-way partition of the global layout
  Partition group_partition;  // a2a+p2p: the P-way partition the ring runs on; = partition otherwise
  bool causal = false;
  Window window;              // normalised global window
  double softmax_scale = 0.0;
  int heads_q = 0, heads_kv = 0;
  PassPlan forward, backward;
  const PassPlan& pass(PassKind kind) const { return kind == PassKind::forward ? forward : backward; }
  PassPlan& pass(PassKind kind) { return kind == PassKind::forward ? forward : backward; }
};

// Builds and checks the plan of a validated case. InputError for constraints of the comm type (heads not divisible
// by the a2a size, cp_size not divisible by a2a_size, ...).
Plan make_plan(const CaseSpec& spec);

// TransformerEngine's max_seqlen of a THD call: the padded maximum rounded up to a multiple of 64 (DPA), before CP
// divides it by W or 2W.
int32_t te_max_seqlen(const PackedSequences& global);

}  // namespace cpgold::sim
