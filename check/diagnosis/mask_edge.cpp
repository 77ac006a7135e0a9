// mask_edge: the alternative masks a kernel may have applied (an edge moved, top-left alignment, pad keys visible).
#include "check/diagnosis/diagnoser.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>

#include "fixtures/schema/fixture_schema.hpp"
#include "reference/input_error.hpp"
#include "reference/mask.hpp"

namespace cpgold::fx::diagnosis_detail {

std::vector<Variant> Diagnoser::mask_alternatives() const {
  std::vector<Variant> out;
  const Variant base = base_variant();
  const ThdLayout& l = fx().layout;
  bool cross = false, pads = false;
  for (int b = 0; b < l.batch(); ++b) {
    cross |= l.q.length(b) != l.kv.length(b);
    pads |= l.kv.padded_length(b) > l.kv.length(b);
  }
  auto with = [&](const std::string& label, const std::function<void(Variant&)>& edit) {
    Variant v = base;
    v.label = label;
    edit(v);
    out.push_back(v);
  };
  // The edges with their numbers: "j <= i + 1 instead of j <= i" for a causal self-attention case; delta (= L_kv - L_q
  // per sequence) stays a symbol only where the sequences' deltas differ.
  int64_t delta = 0;
  bool one_delta = true;
  for (int b = 0; b < l.batch(); ++b) {
    const int64_t d = static_cast<int64_t>(l.kv.length(b)) - l.q.length(b);
    if (b == 0) delta = d;
    one_delta &= d == delta;
  }
  auto edge = [&](const char* op, int64_t offset) {
    const int64_t k = one_delta ? delta + offset : offset;
    std::string text = std::string("j ") + op + " i" + (one_delta ? "" : " + delta");
    if (k != 0) text += (k > 0 ? " + " : " - ") + std::to_string(k > 0 ? k : -k);
    return text;
  };
  auto moved = [&](const char* op, int64_t offset, int64_t shift) {
    return edge(op, offset + shift) + " instead of " + edge(op, offset) +
           (one_delta ? "" : " (delta = L_kv - L_q of each sequence)");
  };
  if (window_.right >= 0) {
    with("the right edge admits one key too many (" + moved("<=", window_.right, 1) + ")",
         [](Variant& v) { v.right_shift = 1; });
    with("the right edge admits one key too few (" + moved("<=", window_.right, -1) + ")",
         [](Variant& v) { v.right_shift = -1; });
  }
  if (window_.left >= 0) {
    with("the left edge admits one key too many (" + moved(">=", -int64_t{window_.left}, -1) + ")",
         [](Variant& v) { v.left_shift = 1; });
    with("the left edge admits one key too few (" + moved(">=", -int64_t{window_.left}, 1) + ")",
         [](Variant& v) { v.left_shift = -1; });
    with("the window's left side is not applied", [](Variant& v) { v.drop_left = true; });
  }
  if ((window_.right >= 0 || window_.left >= 0) && cross)
    with("top-left alignment (delta = 0) instead of bottom-right (delta = L_kv - L_q)", [](Variant& v) { v.top_left = true; });
  if (window_.right >= 0)
    with(window_.left < 0 && window_.right == 0 ? "the causal mask is not applied" : "the window's right side is not applied",
         [](Variant& v) { v.drop_right = true; });
  if (pads) with("keys past the sequence end (pad rows of K/V) are visible", [](Variant& v) { v.pad_keys = true; });
  return out;
}

}  // namespace cpgold::fx::diagnosis_detail
