// head_mapping on the output side: candidate heads that match other golden heads (docs/diagnosis.md); the KV side is
// recomputed with the other variants (variants.cpp).
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

// ---------------------------------------------------------------------------------------------------------------
// head_mapping, output side: a head of the candidate holds another head's golden rows (a2a head scatter, heads
// permuted on the way out).
void Diagnoser::test_output_heads() {
  Finding finding;
  finding.kind = DiagnosisKind::head_mapping;
  std::map<std::string, std::vector<std::string>> texts;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    if (s.cand.heads < 2 || s.bad_items == 0 || s.mean_only) continue;
    const Side& sd = side(s.kv);
    std::vector<int> bad_heads;
    for (int64_t h = 0; h < s.cand.heads; ++h) {
      bool bad = false;
      for (int64_t row = 0; row < s.cand.rows && !bad; ++row) bad = s.item_bad[static_cast<size_t>(row * s.cand.heads + h)];
      if (bad) bad_heads.push_back(static_cast<int>(h));
    }
    std::vector<std::string> moves;
    bool all = true;
    for (int h : bad_heads) {
      int found = -1;
      for (int64_t other = 0; other < s.cand.heads && found < 0; ++other) {
        if (other == h) continue;
        bool ok = true, informative = false;
        for (int64_t row = 0; row < s.cand.rows && ok; ++row) {
          const int64_t g = s.global[static_cast<size_t>(row)];
          if (!sd.valid[static_cast<size_t>(g)]) continue;
          for (int64_t x = 0; x < s.cand.dim && ok; ++x) {
            const double c = s.cand(row, h, x), o = s.golden->view(g, other, x);
            if (s.lse && !std::isfinite(o) && !std::isfinite(c)) continue;
            ok = distance(c, o) <= s.limit;
            informative |= s.lse ? std::isfinite(o) : std::fabs(o) > s.limit;
          }
        }
        if (ok && informative) found = static_cast<int>(other);
      }
      if (found < 0) {
        all = false;
        break;
      }
      moves.push_back("head " + std::to_string(h) + " holds head " + std::to_string(found));
    }
    if (!all || moves.empty()) continue;
    texts[list_text(moves, 6)].push_back(s.name);
    finding.rows[i] = s.row_bad;
  }
  if (finding.rows.empty()) return;
  add(std::move(finding), clauses_text(texts, [](const std::string& text, const std::vector<std::string>& names) {
        return names_text(names) + ": " + text + "'s golden output";
      }) + " (heads exchanged on the way out)");
}

}  // namespace cpgold::fx::diagnosis_detail
