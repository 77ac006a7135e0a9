// lse_convention: LSE in another form than the contract's (docs/diagnosis.md).
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

// lse_convention: LSE = golden + c, golden x log2(e), golden x ln(2); +inf / -inf on keyless rows.
void Diagnoser::test_lse_forms() {
  Finding f;
  f.kind = DiagnosisKind::lse_convention;
  std::map<std::string, std::vector<std::string>> texts;
  const double empty = in_.empty_row_lse == EmptyRowLse::neg_inf ? -kInf : kInf;
  // A constant offset is one number for the whole candidate: the median of every LSE result's differences, and
  // over-determined only by all of them together (at least 3 finite rows x heads whose golden values differ by more
  // than the limit); one token's LSE is off from the golden by a constant whatever the bug.
  double common = kInf;
  bool offset_determined = false;
  {
    std::vector<double> all;
    double lo = kInf, hi = -kInf, limit = 0;
    for (size_t id : subjects_of({Quantity::lse})) {
      const Subject& s = subjects_[id];
      if (s.passing) continue;
      limit = std::max(limit, s.limit);
      for (int64_t row = 0; row < s.cand.rows; ++row) {
        if (!side(false).valid[static_cast<size_t>(s.global[static_cast<size_t>(row)])]) continue;
        for (int64_t h = 0; h < s.cand.heads; ++h) {
          const double c = s.cand(row, h, 0), o = s.gold(row, h, 0);
          if (!std::isfinite(o) || !std::isfinite(c)) continue;
          all.push_back(c - o);
          lo = std::min(lo, o), hi = std::max(hi, o);
        }
      }
    }
    if (!all.empty()) {
      std::nth_element(all.begin(), all.begin() + static_cast<long>(all.size() / 2), all.end());
      common = all[all.size() / 2];
    }
    offset_determined = all.size() >= 3 && hi - lo > 2 * limit;
  }
  for (size_t id : subjects_of({Quantity::lse})) {
    const Subject& s = subjects_[id];
    const Side& sd = side(false);
    std::vector<double> diffs;
    std::vector<uint8_t> keyless_rows = flags(s.failing.size());
    int64_t keyless_wrong = 0, keyless_other = 0;
    for (int64_t row = 0; row < s.cand.rows; ++row) {
      const int64_t g = s.global[static_cast<size_t>(row)];
      if (!sd.valid[static_cast<size_t>(g)]) continue;
      for (int64_t h = 0; h < s.cand.heads; ++h) {
        const double c = s.cand(row, h, 0), o = s.gold(row, h, 0);
        if (!std::isfinite(o)) {
          if (c == empty) continue;
          if (c == -empty) ++keyless_wrong, keyless_rows[static_cast<size_t>(row)] = 1;
          else ++keyless_other;
          continue;
        }
        diffs.push_back(std::isfinite(c) ? c - o : kInf);
      }
    }
    // Rows with keys: which form explains all of them?
    std::string form;
    std::vector<uint8_t> rows = flags(s.failing.size());
    bool finite_rows_bad = false;
    for (int64_t row = 0; row < s.cand.rows; ++row) finite_rows_bad |= s.row_bad[static_cast<size_t>(row)] && !keyless_rows[static_cast<size_t>(row)];
    if (finite_rows_bad && !diffs.empty()) {
      auto every = [&](const std::function<double(double)>& predict) {
        for (int64_t row = 0; row < s.cand.rows; ++row) {
          const int64_t g = s.global[static_cast<size_t>(row)];
          if (!sd.valid[static_cast<size_t>(g)]) continue;
          for (int64_t h = 0; h < s.cand.heads; ++h) {
            const double o = s.gold(row, h, 0);
            if (!std::isfinite(o)) continue;
            const double p = predict(o);
            if (distance(s.cand(row, h, 0), p) > tol_of(s, p)) return false;
          }
        }
        return true;
      };
      if (offset_determined && std::isfinite(common) && std::fabs(common) > s.limit &&
          every([&](double o) { return o + common; }))
        form = "the golden + " + num(common) + " on every row (a constant offset)";
      else if (every([](double o) { return o * kLog2e; }))
        form = "the golden x log2(e): a base-2 log where the contract has the natural log";
      else if (every([](double o) { return o * kLn2; }))
        form = "the golden x ln(2)";
      if (form.empty()) continue;
      for (int64_t row = 0; row < s.cand.rows; ++row) rows[static_cast<size_t>(row)] = s.row_bad[static_cast<size_t>(row)];
    }
    if (keyless_wrong > 0 && keyless_other == 0) {
      const std::string text = empty < 0 ? "valid rows without keys hold +inf (FlashAttention-2's convention; the contract has "
                                           "-inf, `--empty-row-lse pos-inf` accepts +inf)"
                                         : "valid rows without keys hold -inf where --empty-row-lse pos-inf expects +inf";
      form = form.empty() ? text : form + "; " + text;
      for (size_t r = 0; r < rows.size(); ++r) rows[r] |= keyless_rows[r];
    }
    if (form.empty()) continue;
    texts[form].push_back(s.name);
    f.rows[id] = rows;
  }
  if (f.rows.empty()) return;
  add(std::move(f), clauses_text(texts, [](const std::string& text, const std::vector<std::string>& names) {
        return names_text(names) + ": LSE is " + text;
      }));
}

}  // namespace cpgold::fx::diagnosis_detail
