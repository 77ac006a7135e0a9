#pragma once
// Which (query, key) pairs one attention call computes, from its arguments alone, under the documented mask
// semantics of each of TransformerEngine's two attention backends on Hopper. Query i and key j are indices within
// one sequence of the call (0 <= i < q_count, 0 <= j < kv_count, counted from the sequence's first row).
//
// cuDNN FusedAttention (how TE sets it up: fused_attn_f16_arbitrary_seqlen.cu:67-79, 299-316; what the options mean:
// https://github.com/NVIDIA/cudnn-frontend/blob/main/docs/operations/Attention.md, "Diagonal masking options"):
//   set_causal_mask / set_causal_mask_bottom_right put the right bound at 0; set_diagonal_alignment(bottom_right_diagonal)
//   then decides the alignment; window_size (wl, wr) sets left bound wl + 1 and right bound wr where not -1.
//   The diagonal of query i is i (top-left) or i + kv_count - q_count (bottom-right, per sequence); key j is masked
//   beyond diagonal + right bound and at or before diagonal - left bound, and at j >= kv_count (padding mask).
// FlashAttention-3 (hopper/flash_api.cpp, mha_fwd and mha_bwd):
//   window sides >= max_seqlen - 1 become -1; with max_seqlen_q == 1 and no window, causal is switched off; causal
//   sets the right side to 0; is_causal = (left < 0 && right == 0), is_local = (left >= 0 || right >= 0) && !is_causal,
//   and a local window's -1 side becomes max_seqlen_k - 1 (left) or max_seqlen_q - 1 (right). The diagonal is always
//   bottom-right with the used lengths (seqused if given): i + kv_count - q_count.
#include <cstdint>
#include <string>

#include "sim/te/te_replay.hpp"

namespace cpgold::sim {

struct TeKernelMask {
  bool bottom_right = false;  // diagonal at i + kv_count - q_count (else at i)
  int64_t left = -1;          // keys j >= diagonal - left visible; -1: unbounded
  int64_t right = -1;         // keys j <= diagonal + right visible; -1: unbounded
  std::string rule;           // how the backend got there, for renderings
};

// The mask the backend applies for this call (the same for every sequence of the call).
TeKernelMask te_kernel_mask(const TeCall& call, TeBackend backend);

// Visible keys [first, last] of query i in a sequence with the given counts; first > last when none (and when i is
// not a computed row, i >= q_count).
struct TeKeyRange {
  int64_t first = 0, last = -1;
  bool empty() const { return last < first; }
};
TeKeyRange te_visible_keys(const TeKernelMask& mask, int64_t query, int64_t q_count, int64_t kv_count);

}  // namespace cpgold::sim
