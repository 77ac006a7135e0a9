#include "sim/te/te_kernel_mask.hpp"

#include <algorithm>

namespace cpgold::sim {

TeKernelMask te_kernel_mask(const TeCall& call, TeBackend backend) {
  TeKernelMask m;
  if (backend == TeBackend::fused) {
    const std::string& t = call.attn_mask_type;
    const bool is_causal = t == "causal" || t == "padding_causal";
    const bool is_bottom_right = t == "causal_bottom_right" || t == "padding_causal_bottom_right";
    const bool is_padding = t == "padding" || t == "padding_causal" || t == "padding_causal_bottom_right";
    bool alignment_bottom_right = call.bottom_right;
    int64_t right = -1;
    bool causal_right = is_causal || is_bottom_right;
    // fused_attn_f16_arbitrary_seqlen.cu:75-79: a bottom-right mask without padding on a square problem is plain
    // causal. TE's THD calls always carry a padding mask, so this never applies to them.
    if (is_bottom_right && !is_padding && call.max_seqlen_q == call.max_seqlen_kv) alignment_bottom_right = false;
    if (causal_right) right = 0;                                  // set_causal_mask(_bottom_right): right bound 0
    if (call.window.right != -1) right = call.window.right;       // set_diagonal_band_right_bound(wr)
    m.bottom_right = alignment_bottom_right;                      // set_diagonal_alignment(bottom_right_diagonal)
    m.left = call.window.left;                                    // set_diagonal_band_left_bound(wl + 1)
    m.right = right;
    m.rule = std::string("cuDNN: mask ") + t + ", " + (m.bottom_right ? "bottom-right" : "top-left") +
             " diagonal, left bound " + (m.left < 0 ? std::string("none") : std::to_string(m.left) + " + 1") +
             ", right bound " + (m.right < 0 ? std::string("none") : std::to_string(m.right));
    return m;
  }
  // FlashAttention-3 mha_fwd / mha_bwd window normalisation.
  int64_t left = call.window.left, right = call.window.right;
  bool causal = call.causal;
  if (left >= call.max_seqlen_kv - 1) left = -1;
  if (right >= call.max_seqlen_q - 1) right = -1;
  if (call.max_seqlen_q == 1 && left == -1 && right == -1) causal = false;
  if (causal) right = 0;
  const bool is_causal = left < 0 && right == 0;
  const bool is_local = (left >= 0 || right >= 0) && !is_causal;
  m.bottom_right = true;
  if (is_causal) {
    m.left = -1;
    m.right = 0;
  } else if (is_local) {
    m.left = left < 0 ? call.max_seqlen_kv - 1 : left;
    m.right = right < 0 ? call.max_seqlen_q - 1 : right;
  }
  m.rule = std::string("FlashAttention-3: ") + (is_causal ? "causal" : (is_local ? "local" : "no mask")) +
           ", bottom-right diagonal" +
           (is_local ? ", window (" + std::to_string(m.left) + ", " + std::to_string(m.right) + ")" : std::string());
  return m;
}

TeKeyRange te_visible_keys(const TeKernelMask& m, int64_t i, int64_t q_count, int64_t kv_count) {
  TeKeyRange k;
  if (i < 0 || i >= q_count || kv_count <= 0) return k;
  const int64_t diagonal = i + (m.bottom_right ? kv_count - q_count : 0);
  k.first = m.left >= 0 ? std::max<int64_t>(0, diagonal - m.left) : 0;
  k.last = m.right >= 0 ? std::min<int64_t>(kv_count - 1, diagonal + m.right) : kv_count - 1;
  return k;
}

}  // namespace cpgold::sim
