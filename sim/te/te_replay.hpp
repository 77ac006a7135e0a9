#pragma once
// A literal replay of TransformerEngine's THD context-parallel attention (TE 2.20, main at d0067d0, the commit
// docs/cp-layout.md names): for a case, the arguments TE's own code computes for every attention call of every rank,
// step and pass, for each of its two attention backends on Hopper (cuDNN FusedAttention and FlashAttention-3),
// with TE's normalisations and, where TE stops, its assert or gating message instead of a call. Pure metadata: it
// reproduces TE's arithmetic (get_cu_seqlens_on_cp_rank, the section choice, the halving of offsets and
// max_seqlen, all_gather's per-step windows) from the source lines it cites, independently of cpgold's Plan, so the
// two can be compared and the calls audited (sim/te/te_audit.hpp). docs/te-audit.md describes both.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "reference/mask.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/plan/partition.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::sim {

// The version replayed, named in every rendering.
inline constexpr std::string_view kTeVersion = "TransformerEngine 2.20 (main at d0067d0da6cb, 2026-08-22)";
// What the replay assumes of the machine and the call; gates of other configurations are not replayed.
inline constexpr std::string_view kTeEnvironment =
    "sm90 (Hopper), cuDNN >= 9.15.1, FlashAttention-3 installed, bf16/fp16, training, no bias, no dropout, "
    "vanilla softmax, no fp8, no max_logit";

enum class TeBackend { fused, flash3 };
std::string_view te_backend_name(TeBackend backend);  // "fused", "flash3"
std::string_view te_backend_title(TeBackend backend);  // "cuDNN FusedAttention (F16_arbitrary_seqlen)", ...

// What a user of DotProductAttention passes for the case, before TE normalises it.
struct TeUserArguments {
  std::string attn_mask_type = "padding";  // "padding" or "padding_causal" (THD needs a padding mask)
  std::optional<Window> window_size;       // as given; nullopt: not given
};
// From the case object as given (its "mask" and "window" keys before cpgold normalises them: mask none with window
// (-1, 0) stays a padding mask with that window). The object must already have passed parse_case.
TeUserArguments te_user_arguments(const nlohmann::json& case_object);
// From a parsed case: its normalised mask and window (the window is passed only when it is not the mask's default).
TeUserArguments te_user_arguments(const CaseSpec& spec);

// The tensor a call reads its Q rows (or K/V rows) from.
enum class TeTensor {
  rank_local,      // the shard of one rank: chunk p then chunk 2P-1-p of every sequence (P: ranks of the ring)
  first_half,      // thd_read_half_tensor(x, cu_padded, 0): chunk p of every sequence, compacted at cuP / (2P)
  second_half,     // thd_read_half_tensor(x, cu_padded, 1): chunk 2P-1-p of every sequence
  sequence_order,  // every sequence in global order at cuP (a2a after its all-to-all; all_gather's gathered K/V)
};
std::string_view te_tensor_name(TeTensor tensor);  // "full", "first_half", "second_half", "sequence_order"
// TE's name of the part of a rank-local tensor a step reads: "full", "first_half", "second_half"
std::string_view te_half_name(HalfSelect half);

// One attention call as TE makes it.
struct TeCall {
  PassKind pass = PassKind::forward;
  int rank = 0;          // global rank
  int step = 0;
  std::string section;   // TE's name: "diagonal", "lower-triangle", "upper-triangle", "all" (p2p rings), "a2a",
                         // "chunk c" (all_gather)
  int kv_owner = -1;     // global rank whose K/V shard the call reads; -1: every rank's (a2a, all_gather)
  int head_group = 0;    // a2a index: heads [head_begin, head_end) of q
  int head_begin = 0, head_end = 0;
  TeTensor q_tensor = TeTensor::rank_local, kv_tensor = TeTensor::rank_local;
  int q_shard = 0, kv_shard = 0;  // ring rank whose shard the tensor is (unused for sequence_order)
  // Which pairs are this call's to compute (for attributing a missing pair): the query chunks and key chunks of the
  // partition the call works on; -1 entries unused, both -1: every chunk.
  int q_scope[2] = {-1, -1}, kv_scope[2] = {-1, -1};

  // The arguments, as the backend receives them.
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_kv;                // fused: actual counts; flash3: row offsets
  std::vector<int32_t> cu_seqlens_q_padded, cu_seqlens_kv_padded;  // fused only (row offsets)
  std::vector<int32_t> seqused_q, seqused_k;                       // flash3 with pad_between_seqs; else empty
  int32_t max_seqlen_q = 0, max_seqlen_kv = 0;
  std::string attn_mask_type;  // fused: the mask type; flash3: empty (it takes `causal`)
  bool causal = false;         // flash3: the causal flag; fused: "causal" in the mask type
  Window window;               // fused: window_size; flash3: (window_size_left, window_size_right)
  bool bottom_right = false;   // fused: bottom_right_diagonal after fused_attn.py:325-329; flash3: always true
  std::string source;          // TE file:line the arguments come from
};

struct TeNote {
  std::string text;    // what TE does
  std::string source;  // TE file:line
};

struct TeReplay {
  TeBackend backend = TeBackend::fused;
  bool pad_between_seqs = true;
  TeUserArguments user;
  std::vector<TeNote> normalisations;  // TE's own changes of the user's arguments, in the order TE makes them
  std::optional<TeNote> refusal;       // TE's assert or gating message: then no calls
  std::optional<TeNote> misread;       // the offsets TE works with are not the layout's (then the audit cannot map
                                       // rows to tokens and reports that instead)
  std::string attn_mask_type;          // after normalisation
  Window window_size;                  // after normalisation
  int32_t max_seqlen_q = 0, max_seqlen_kv = 0;  // DotProductAttention's (padded maximum rounded up to 64)
  CommType comm = CommType::p2p;       // the comm type TE runs (a2a+p2p with a group of 1 falls back)
  int cp_size = 1, a2a_size = 1, p2p_size = 1;
  Partition level;                     // the partition the calls' rank_local and half tensors belong to
  ThdLayout global;                    // the global layout (sequence_order tensors)
  std::vector<TeCall> forward, backward;
  const std::vector<TeCall>& calls(PassKind pass) const { return pass == PassKind::forward ? forward : backward; }
};

// Replays a validated case with cp_size >= 2. pad_between_seqs: true is what DotProductAttention sets itself when
// padded offsets are passed (dot_product_attention.py:2014-2024, required by CP on THD); false replays the
// `cu // W` shortcut a stack gets by passing pad_between_seqs=False.
TeReplay replay_te(const CaseSpec& spec, const TeUserArguments& user, TeBackend backend, bool pad_between_seqs);

// The arguments in backend-neutral terms: per sequence, the first row, the row count, and the key side likewise.
struct TeSequenceArgs {
  int64_t q_first_row = 0, kv_first_row = 0;
  int64_t q_count = 0, kv_count = 0;
};
TeSequenceArgs te_sequence_args(const TeCall& call, TeBackend backend, int sequence);

}  // namespace cpgold::sim
