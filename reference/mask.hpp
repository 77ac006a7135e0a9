#pragma once
// Masks from global positions inside a sequence, bottom-right aligned (delta = L_kv - L_q):
// key j is visible to query i iff j < L_kv and i + delta - left <= j <= i + delta + right, a -1 side unbounded.
// Causal is the window (-1, 0); the normalised window is what every layer stores and passes on.
#include <cstdint>
#include <string>

namespace cpgold {

struct Window {
  int32_t left = -1;   // -1: unbounded
  int32_t right = -1;  // -1: unbounded; 0 with causal
  bool operator==(const Window&) const = default;
};

// causal: the user asked for a causal mask; window: (wl, wr) as given, -1 unbounded.
// Normalises as FlashAttention-3: causal forces right = 0 (a window given with causal keeps its left side).
// Throws InputError for values below -1.
Window normalize_window(bool causal, Window window);
// Window with sides that cover the whole row replaced by -1 (left >= max_len_kv - 1, right >= max_len_q - 1).
Window drop_unbounded_sides(Window window, int64_t max_len_q, int64_t max_len_kv);

inline bool is_causal(Window w) { return w.left < 0 && w.right == 0; }
inline bool has_window(Window w) { return w.left >= 0 || w.right > 0; }
std::string describe(Window w);  // "none", "causal", "window(128,0)", ...

// q_pos, k_pos: positions within the sequence; delta = L_kv - L_q of that sequence. Does not check k_pos < L_kv.
inline bool visible(Window w, int64_t q_pos, int64_t k_pos, int64_t delta) {
  const int64_t diag = q_pos + delta;
  if (w.right >= 0 && k_pos > diag + w.right) return false;
  if (w.left >= 0 && k_pos < diag - w.left) return false;
  return true;
}

}  // namespace cpgold
