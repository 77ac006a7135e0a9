#include "reference/mask.hpp"

#include "reference/input_error.hpp"

namespace cpgold {

Window normalize_window(bool causal, Window window) {
  if (window.left < -1) fail_input("window[0]", "must be >= -1 (-1 = unbounded), got ", window.left);
  if (window.right < -1) fail_input("window[1]", "must be >= -1 (-1 = unbounded), got ", window.right);
  if (causal) window.right = 0;
  return window;
}

Window drop_unbounded_sides(Window window, int64_t max_len_q, int64_t max_len_kv) {
  if (window.left >= 0 && window.left >= max_len_kv - 1) window.left = -1;
  if (window.right > 0 && window.right >= max_len_q - 1) window.right = -1;
  return window;
}

std::string describe(Window w) {
  if (w.left < 0 && w.right < 0) return "none";
  if (is_causal(w)) return "causal";
  return "window(" + std::to_string(w.left) + "," + std::to_string(w.right) + ")";
}

}  // namespace cpgold
