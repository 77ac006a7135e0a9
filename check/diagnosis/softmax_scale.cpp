// softmax_scale: the alternative scales a kernel may have used, and gradients that are the golden times a constant
// (docs/diagnosis.md).
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

std::vector<std::pair<std::string, double>> Diagnoser::scale_alternatives() const {
  std::vector<std::pair<std::string, double>> raw = {
      {"1/sqrt(d_v) = 1/sqrt(" + std::to_string(dv_) + ")", 1 / std::sqrt(double(dv_))},
      {"1/sqrt(d_qk + 1) = 1/sqrt(" + std::to_string(dqk_ + 1) + ")", 1 / std::sqrt(double(dqk_ + 1))},
      {"1/sqrt(d_qk) (the case's softmax_scale ignored)", 1 / std::sqrt(double(dqk_))},
      {"1 (no scale)", 1.0},
      {"softmax_scale x log2(e) (log2 e applied twice)", scale_ * kLog2e},
      {"softmax_scale x ln(2) (exp2 without log2 e)", scale_ * kLn2},
      {"softmax_scale squared (applied twice)", scale_ * scale_},
      {"1/d_qk (1/d instead of 1/sqrt(d))", 1 / double(dqk_)},
  };
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [label, value] : raw) {
    bool same = std::fabs(value - scale_) <= 1e-9 * scale_;
    for (const auto& kept : out) same |= std::fabs(value - kept.second) <= 1e-9 * value;
    if (!same) out.push_back({label, value});
  }
  return out;
}

// softmax_scale in the backward: a gradient that is the golden times a constant (the scale left out or applied twice).
void Diagnoser::test_gradient_factor() {
  std::map<std::string, std::vector<std::string>> texts;
  Finding f;
  f.kind = DiagnosisKind::softmax_scale;
  const std::vector<std::pair<std::string, double>> known = {
      {"1/softmax_scale: the softmax scale left out", 1 / scale_},
      {"softmax_scale: the softmax scale applied twice", scale_},
      {"log2(e)", kLog2e},
      {"ln(2)", kLn2}};
  for (size_t id : subjects_of({Quantity::dq, Quantity::dk, Quantity::dv})) {
    const Subject& s = subjects_[id];
    if (s.bad_items == 0) continue;
    const Side& sd = side(s.kv);
    double cg = 0, gg = 0;
    for (int64_t row = 0; row < s.cand.rows; ++row) {
      if (!sd.valid[static_cast<size_t>(s.global[static_cast<size_t>(row)])]) continue;
      for (int64_t h = 0; h < s.cand.heads; ++h)
        for (int64_t x = 0; x < s.cand.dim; ++x) {
          const double c = s.cand(row, h, x), o = s.gold(row, h, x);
          cg += c * o, gg += o * o;
        }
    }
    if (!(gg > 0) || !std::isfinite(cg)) continue;
    const double fitted = cg / gg;
    // Each known factor near the least-squares one is tried as it is: every valid element within the tolerance.
    std::string name;
    double factor = 0;
    for (const auto& [label, value] : known) {
      if (std::fabs(fitted - value) > 0.02 * std::fabs(value) || std::fabs(value - 1) <= 1e-3) continue;
      bool fits = true;
      for (int64_t row = 0; row < s.cand.rows && fits; ++row) {
        if (!sd.valid[static_cast<size_t>(s.global[static_cast<size_t>(row)])]) continue;
        for (int64_t h = 0; h < s.cand.heads && fits; ++h)
          for (int64_t x = 0; x < s.cand.dim && fits; ++x) {
            const double o = s.gold(row, h, x);
            // The candidate's own rounding errors scale with the factor as well.
            fits = distance(s.cand(row, h, x), value * o) <= std::max(1.0, std::fabs(value)) * tol_of(s, value * o);
          }
      }
      if (fits) {
        name = label, factor = value;
        break;
      }
    }
    if (name.empty()) continue;
    texts["the golden x " + num(factor) + " (= " + name + ")"].push_back(s.name);
    f.rows[id] = s.failing;
  }
  if (f.rows.empty()) return;
  add(std::move(f), clauses_text(texts, [](const std::string& text, const std::vector<std::string>& names) {
        return names_text(names) + " " + (names.size() == 1 ? "is " : "are ") + text;
      }) + " on every valid row: the backward's softmax scale is wrong");
}

}  // namespace cpgold::fx::diagnosis_detail
