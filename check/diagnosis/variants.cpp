// softmax_scale, mask_edge and head_mapping (KV side) by attention recomputed under each alternative on sampled
// rows (perturbed_attention.cpp).
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

// softmax_scale, mask_edge and head_mapping (KV side) by recomputation on sampled rows.
void Diagnoser::test_variants() {
  const std::vector<size_t> ids = subjects_of({Quantity::o, Quantity::lse, Quantity::dq, Quantity::dk, Quantity::dv});
  std::vector<size_t> usable;
  for (size_t id : ids)
    if (subjects_[id].bad_items > 0) usable.push_back(id);
  if (usable.empty()) return;
  load_inputs();
  // The failing results' items and, as evidence against a variant, right items of every result (a variant that one
  // result fits and another contradicts is no explanation: the scale of one gradient that happens to be the golden
  // times a constant while O is wrong otherwise).
  std::vector<size_t> passing;
  for (size_t id = 0; id < subjects_.size(); ++id)
    if (subjects_[id].passing) passing.push_back(id);
  std::vector<Item> items = sample(usable, 8, 4);
  if (items.empty()) return;
  for (const Item& item : sample(passing, 0, 4)) items.push_back(item);
  auto consistent = [](const std::map<size_t, Verdict>& verdicts) {
    for (const auto& [id, verdict] : verdicts)
      if (verdict.contradicted) return false;
    return true;
  };

  // Families: one finding per family, from its variant that explains the most.
  struct Best {
    std::string label;
    std::map<size_t, Verdict> verdicts;
    int64_t explained = 0;
    double scale = 0;
  };
  auto consider = [&](Best& best, const Variant& v, double scale_value) {
    const std::map<size_t, Verdict> verdicts = judge(v, items);
    if (!consistent(verdicts)) return;
    int64_t explained = 0;
    for (const auto& [id, verdict] : verdicts) explained += verdict.match ? verdict.explained : 0;
    if (explained > best.explained) best = {v.label, verdicts, explained, scale_value};
  };
  auto report = [&](DiagnosisKind kind, const Best& best, const std::string& prefix, nlohmann::ordered_json extra) {
    if (best.explained == 0) return;
    Finding f;
    f.kind = kind;
    std::vector<std::string> names;
    int64_t sampled = 0, near = 0;
    for (const auto& [id, verdict] : best.verdicts) {
      if (!verdict.match) continue;
      const Subject& s = subjects_[id];
      names.push_back(s.name);
      sampled += verdict.items;
      near += verdict.near;
      std::vector<uint8_t> rows = flags(s.failing.size());
      for (int64_t row = 0; row < s.cand.rows; ++row) rows[static_cast<size_t>(row)] = s.row_bad[static_cast<size_t>(row)];
      f.rows[id] = rows;
    }
    f.evidence = names_text(names) + " match" + (names.size() == 1 ? "es" : "") + " attention recomputed " + prefix +
                 best.label + (near == 0 ? " on every one of " + std::to_string(sampled)
                                         : " on " + std::to_string(sampled - near) + " of " + std::to_string(sampled)) +
                 " sampled rows x heads (" + std::to_string(best.explained) + " of them failing against the golden" +
                 (near == 0 ? std::string(")") : "; the others within 4 times the tolerance of it)") +
                 "; every result the candidate holds agrees with it";
    f.where = where_of(f.rows);
    for (auto& [key, value] : extra.items()) f.where[key] = value;
    add(std::move(f));
  };

  Best scale_best;
  for (const auto& [label, value] : scale_alternatives()) {
    Variant v = base_variant();
    v.label = label;
    v.scale = value;
    consider(scale_best, v, value);
  }
  report(DiagnosisKind::softmax_scale, scale_best, "with softmax_scale ",
         {{"softmax_scale", scale_best.scale}, {"case_softmax_scale", scale_}, {"variant", scale_best.label}});

  Best mask_best;
  for (const Variant& v : mask_alternatives()) consider(mask_best, v, scale_);
  report(DiagnosisKind::mask_edge, mask_best, "with the mask changed: ", {{"variant", mask_best.label}});

  // KV head of each query head: per failing head, the KV head whose attention the candidate holds.
  if (hkv_ > 1) {
    std::vector<Item> head_items;  // query-side items, a few per head
    for (const Item& item : sample(usable, 2, 1, true))
      if (!subjects_[item.subject].kv) head_items.push_back(item);
    std::map<int64_t, int> remap;  // query head -> kv head found
    std::set<int64_t> failing_heads;
    for (const Item& item : head_items)
      if (item.bad) failing_heads.insert(item.head);
    bool all = !failing_heads.empty();
    std::map<size_t, int64_t> explained_by_subject;
    for (int64_t h : failing_heads) {
      std::vector<Item> mine;
      for (const Item& item : head_items)
        if (item.head == h) mine.push_back(item);
      int found = -1;
      std::map<size_t, Verdict> verdicts;
      for (int g = 0; g < hkv_ && found < 0; ++g) {
        if (g == h / group_) continue;
        Variant v = base_variant();
        v.kv_head_of[static_cast<size_t>(h)] = g;
        verdicts = judge(v, mine);
        int64_t explained = 0;
        bool contradicted = false;
        for (const auto& [id, verdict] : verdicts) explained += verdict.explained, contradicted |= verdict.contradicted;
        if (explained > 0 && !contradicted) found = g;
      }
      if (found < 0) {
        all = false;
        break;
      }
      remap[h] = found;
      for (const auto& [id, verdict] : verdicts) explained_by_subject[id] += verdict.explained;
    }
    if (all && !remap.empty()) {
      // The whole map on the KV side: dK and dV of a KV head gather the query heads that read it.
      Variant full = base_variant();
      for (const auto& [h, g] : remap) full.kv_head_of[static_cast<size_t>(h)] = g;
      std::vector<Item> kv_items;
      for (const Item& item : items)
        if (subjects_[item.subject].kv) kv_items.push_back(item);
      for (const auto& [id, verdict] : judge(full, kv_items))
        if (verdict.match) explained_by_subject[id] += verdict.explained;
      // Every result, the passing ones too, must agree with the whole map.
      if (!consistent(judge(full, items))) explained_by_subject.clear();
      bool interleaved = true;
      std::vector<std::string> moves;
      for (const auto& [h, g] : remap) {
        interleaved &= g == h % hkv_;
        moves.push_back("q head " + std::to_string(h) + " -> kv head " + std::to_string(g) + " (expected " +
                        std::to_string(h / group_) + ")");
      }
      Finding f;
      f.kind = DiagnosisKind::head_mapping;
      std::vector<std::string> names;
      for (const auto& [id, n] : explained_by_subject) {
        if (n == 0) continue;
        names.push_back(subjects_[id].name);
        f.rows[id] = subjects_[id].row_bad;
      }
      f.evidence = names_text(names) + " match attention recomputed with query heads reading other KV heads: " +
                   list_text(moves, 4) +
                   (interleaved && group_ > 1 ? "; the map is h % h_kv (interleaved) instead of h / g (contiguous groups of " +
                                                    std::to_string(group_) + ")"
                                              : "");
      f.where = where_of(f.rows);
      nlohmann::ordered_json map = nlohmann::ordered_json::object();
      for (const auto& [h, g] : remap) map[std::to_string(h)] = g;
      f.where["kv_head_of"] = map;
      if (!f.rows.empty()) add(std::move(f));
    }
  }

  // LSE with the exp2-domain max mixed with ln(l).
  {
    Variant v = base_variant();
    v.label = "LSE = log2(e) m + ln(l): the row max of the exp2 domain mixed with the natural log of the sum";
    v.lse_mixed_domain = true;
    bool lse_items = false;
    for (const Item& item : items) lse_items |= subjects_[item.subject].lse;
    if (lse_items) {  // the backward recomputes P from that LSE: dQ, dK, dV follow it
      std::map<size_t, Verdict> verdicts = judge(v, items);
      bool lse_matched = false;
      for (const auto& [id, verdict] : verdicts) lse_matched |= verdict.match && subjects_[id].lse;
      if (!lse_matched || !consistent(verdicts)) verdicts.clear();
      Finding f;
      f.kind = DiagnosisKind::lse_convention;
      std::vector<std::string> names;
      for (const auto& [id, verdict] : verdicts)
        if (verdict.match) names.push_back(subjects_[id].name), f.rows[id] = subjects_[id].row_bad;
      if (!f.rows.empty()) {
        f.evidence = names_text(names) + " match attention recomputed with " + v.label +
                     " (golden + (log2(e) - 1) x row max on every sampled row; the backward's P follows that LSE)";
        f.where = where_of(f.rows);
        f.where["form"] = "exp2_max_natural_log";
        add(std::move(f));
      }
    }
  }
}

}  // namespace cpgold::fx::diagnosis_detail
