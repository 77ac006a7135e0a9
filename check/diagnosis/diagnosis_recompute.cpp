// The diagnosis's recomputations (docs/diagnosis.md): attention of sampled rows in float64 on the fixture's inputs
// under each alternative (softmax scale, mask edge, KV head, LSE form), gradient factors, and other inputs.
#include "check/diagnosis/diagnosis_engine.hpp"

#include "fixtures/schema/fixture_schema.hpp"

#include "reference/input_error.hpp"
#include "reference/mask.hpp"

namespace cpgold::fx::diagnosis_detail {

// ---------------------------------------------------------------------------------------------------------------
// Recomputation: attention of one query row under a variant, in float64 on the fixture's inputs.

Variant Diagnoser::base_variant() const {
  Variant v;
  v.scale = scale_;
  v.window = window_;
  v.kv_head_of.resize(static_cast<size_t>(hq_));
  for (int h = 0; h < hq_; ++h) v.kv_head_of[static_cast<size_t>(h)] = h / group_;
  return v;
}

bool Diagnoser::visible(const Variant& v, int b, int64_t i, int64_t j) const {
  const int64_t lq = fx().layout.q.length(b), lkv = fx().layout.kv.length(b);
  const int64_t delta = v.top_left ? 0 : lkv - lq;
  const int64_t diag = i + delta;
  if (!v.drop_right && v.window.right >= 0 && j > diag + v.window.right + v.right_shift) return false;
  if (!v.drop_left && v.window.left >= 0 && j < diag - v.window.left - v.left_shift) return false;
  return true;
}

QueryRow Diagnoser::query_row(const Variant& v, int64_t global_row, int64_t head, bool with_dq) const {
  QueryRow out;
  out.o.assign(static_cast<size_t>(dv_), 0.0);
  const int b = q_.sequence[static_cast<size_t>(global_row)];
  const int64_t i = q_.position[static_cast<size_t>(global_row)];
  const int64_t k0 = fx().layout.kv.offset(b);
  const int64_t keys = v.pad_keys ? fx().layout.kv.padded_length(b) : fx().layout.kv.length(b);
  const int g = v.kv_head_of[static_cast<size_t>(head)];
  const float* q = iq_.at(global_row, head);
  std::vector<double> scores(static_cast<size_t>(keys), -kInf);
  double m = -kInf;
  for (int64_t j = 0; j < keys; ++j) {
    if (!visible(v, b, i, j)) continue;
    const float* k = ik_.at(k0 + j, g);
    double dot = 0;
    for (int x = 0; x < dqk_; ++x) dot += double(q[x]) * double(k[x]);
    scores[static_cast<size_t>(j)] = v.scale * dot;
    m = std::max(m, scores[static_cast<size_t>(j)]);
  }
  bool poisoned = false;  // a visible score that is not finite (pad keys holding NaN/Inf): everything is NaN
  for (double x : scores) poisoned |= std::isnan(x) || x == kInf;
  if (poisoned) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    out.o.assign(static_cast<size_t>(dv_), nan);
    if (with_dq) out.dq.assign(static_cast<size_t>(dqk_), nan);
    out.lse = nan;
    return out;
  }
  if (m == -kInf) {
    if (with_dq) out.dq.assign(static_cast<size_t>(dqk_), 0.0);
    return out;
  }
  double l = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (scores[static_cast<size_t>(j)] != -kInf) l += std::exp(scores[static_cast<size_t>(j)] - m);
  out.lse = m + std::log(l);
  out.max_score = m;
  for (int64_t j = 0; j < keys; ++j) {
    if (scores[static_cast<size_t>(j)] == -kInf) continue;
    const double p = std::exp(scores[static_cast<size_t>(j)] - out.lse);
    const float* vv = iv_.at(k0 + j, g);
    for (int x = 0; x < dv_; ++x) out.o[static_cast<size_t>(x)] += p * double(vv[x]);
  }
  if (v.lse_mixed_domain) out.lse = kLog2e * m + std::log(l);
  if (!with_dq) return out;
  out.dq.assign(static_cast<size_t>(dqk_), 0.0);
  const float* dout = idout_.at(global_row, head);
  double d = 0;
  for (int x = 0; x < dv_; ++x) d += double(dout[x]) * out.o[static_cast<size_t>(x)];
  const double lse = out.lse;  // the backward recomputes P from the LSE the forward wrote
  for (int64_t j = 0; j < keys; ++j) {
    if (scores[static_cast<size_t>(j)] == -kInf) continue;
    const double p = std::exp(scores[static_cast<size_t>(j)] - lse);
    const float* vv = iv_.at(k0 + j, g);
    double dp = 0;
    for (int x = 0; x < dv_; ++x) dp += double(dout[x]) * double(vv[x]);
    const double ds = p * (dp - d);
    const float* k = ik_.at(k0 + j, g);
    for (int x = 0; x < dqk_; ++x) out.dq[static_cast<size_t>(x)] += v.scale * ds * double(k[x]);
  }
  return out;
}

// Up to `bad_per_subject` failing items (spread over the failing items in layout order, the worst included) and
// `good_per_subject` right ones of each subject; only query-side subjects (O, LSE, dQ) on rows with a sequence.
std::vector<Item> Diagnoser::sample(const std::vector<size_t>& subject_ids, int bad_per_subject, int good_per_subject,
                                    bool per_head) const {
  std::vector<Item> out;
  for (size_t id : subject_ids) {
    const Subject& s = subjects_[id];
    const Side& sd = side(s.kv);
    const int64_t groups = per_head ? s.cand.heads : 1;
    for (int64_t only = 0; only < groups; ++only) {
      std::vector<int64_t> bad, good;
      for (int64_t row = 0; row < s.cand.rows; ++row) {
        const int64_t g = s.global[static_cast<size_t>(row)];
        if (!sd.valid[static_cast<size_t>(g)]) continue;
        for (int64_t h = 0; h < s.cand.heads; ++h) {
          if (per_head && h != only) continue;
          if (s.lse && !std::isfinite(double(s.golden->view(g, h, 0)))) continue;  // keyless rows: the exact rule's
          (s.item_bad[static_cast<size_t>(row * s.cand.heads + h)] ? bad : good).push_back(row * s.cand.heads + h);
        }
      }
      auto spread = [&](const std::vector<int64_t>& from, int count, bool is_bad) {
        if (from.empty() || count <= 0) return;
        const size_t n = std::min(from.size(), static_cast<size_t>(count));
        for (size_t k = 0; k < n; ++k) {
          const int64_t item = from[k * from.size() / n];
          out.push_back({id, item / s.cand.heads, item % s.cand.heads, is_bad});
        }
      };
      spread(bad, bad_per_subject, true);
      spread(good, good_per_subject, false);
    }
  }
  return out;
}

// dK, dV rows of a variant (Diagnoser::key_rows).
std::map<std::pair<int64_t, int64_t>, std::pair<std::vector<double>, std::vector<double>>> Diagnoser::key_rows(
    const Variant& v, const std::vector<Item>& items) const {
  std::map<std::pair<int64_t, int64_t>, std::pair<std::vector<double>, std::vector<double>>> out;
  // (sequence, kv head) -> requested kv rows; the work of a unit is every query row of the sequence for the query
  // heads that read that KV head.
  std::map<std::pair<int, int64_t>, std::set<int64_t>> wanted;
  for (const Item& item : items) {
    const Subject& s = subjects_[item.subject];
    if (!s.kv) continue;
    const int64_t g = s.global[static_cast<size_t>(item.row)];
    wanted[{kv_.sequence[static_cast<size_t>(g)], item.head}].insert(g);
  }
  const ThdLayout& l = fx().layout;
  std::vector<std::pair<double, std::pair<int, int64_t>>> order;  // (work, unit)
  for (const auto& [unit, keys] : wanted) {
    int readers = 0;
    for (int h = 0; h < hq_; ++h) readers += v.kv_head_of[static_cast<size_t>(h)] == unit.second;
    const int b = unit.first;
    order.push_back({double(l.q.length(b)) * double(l.kv.padded_length(b)) * double(dqk_ + dv_) * double(readers), unit});
  }
  std::sort(order.begin(), order.end());
  double spent = 0;
  constexpr double kWorkCap = 4e7;  // multiply-adds per variant on the KV side
  for (const auto& [work, unit] : order) {
    if (spent + work > kWorkCap) break;
    spent += work;
    const auto [b, g] = unit;
    const int64_t q0 = l.q.offset(b), k0 = l.kv.offset(b);
    std::vector<std::pair<int64_t, int64_t>> keys;  // (global row, position)
    for (int64_t row : wanted[unit]) keys.push_back({row, kv_.position[static_cast<size_t>(row)]});
    std::vector<std::vector<double>> dk(keys.size(), std::vector<double>(static_cast<size_t>(dqk_), 0.0)),
        dvv(keys.size(), std::vector<double>(static_cast<size_t>(dv_), 0.0));
    for (int h = 0; h < hq_; ++h) {
      if (v.kv_head_of[static_cast<size_t>(h)] != g) continue;
      for (int64_t i = 0; i < l.q.length(b); ++i) {
        const QueryRow row = query_row(v, q0 + i, h, false);
        if (row.lse == -kInf) continue;  // no visible key (a NaN row makes its keys' rows NaN below)
        const float* q = iq_.at(q0 + i, h);
        const float* dout = idout_.at(q0 + i, h);
        double d = 0;
        for (int x = 0; x < dv_; ++x) d += double(dout[x]) * row.o[static_cast<size_t>(x)];
        for (size_t k = 0; k < keys.size(); ++k) {
          const int64_t j = keys[k].second;
          if (j >= (v.pad_keys ? l.kv.padded_length(b) : l.kv.length(b)) || !visible(v, b, i, j)) continue;
          const float* kk = ik_.at(k0 + j, g);
          const float* vv = iv_.at(k0 + j, g);
          double dot = 0, dp = 0;
          for (int x = 0; x < dqk_; ++x) dot += double(q[x]) * double(kk[x]);
          for (int x = 0; x < dv_; ++x) dp += double(dout[x]) * double(vv[x]);
          const double p = std::exp(v.scale * dot - row.lse);
          for (int x = 0; x < dv_; ++x) dvv[k][static_cast<size_t>(x)] += p * double(dout[x]);
          for (int x = 0; x < dqk_; ++x) dk[k][static_cast<size_t>(x)] += v.scale * p * (dp - d) * double(q[x]);
        }
      }
    }
    for (size_t k = 0; k < keys.size(); ++k) out[{keys[k].first, g}] = {dk[k], dvv[k]};
  }
  return out;
}

// Whether the candidate matches the variant on every sampled item of a subject, and on how many failing items the
// variant differs from the golden (what it explains).
std::map<size_t, Diagnoser::Verdict> Diagnoser::judge(const Variant& v, const std::vector<Item>& items) const {
  std::map<size_t, Verdict> out;
  std::map<size_t, Stats> against_variant, against_golden;
  std::map<std::pair<int64_t, int64_t>, QueryRow> rows;  // (global row, head): one recomputation per distinct row
  const auto keys = key_rows(v, items);
  for (const Item& item : items) {
    const Subject& s = subjects_[item.subject];
    const int64_t g = s.global[static_cast<size_t>(item.row)];
    const std::vector<double>* p = nullptr;
    double lse = 0;
    if (s.kv) {
      const auto found = keys.find({g, item.head});
      if (found == keys.end()) continue;  // past the work cap
      p = s.quantity == Quantity::dk ? &found->second.first : &found->second.second;
    } else {
      auto key = std::make_pair(g, item.head);
      auto found = rows.find(key);
      if (found == rows.end()) found = rows.emplace(key, query_row(v, g, item.head, true)).first;
      p = s.quantity == Quantity::o ? &found->second.o : &found->second.dq;
      lse = found->second.lse;
    }
    Verdict& verdict = out[item.subject];
    ++verdict.items;
    double magnitude = 0;
    for (int64_t x = 0; x < s.cand.dim; ++x) magnitude = std::max(magnitude, std::fabs(s.lse ? lse : (*p)[static_cast<size_t>(x)]));
    if (!std::isfinite(magnitude)) magnitude = 0;
    const double tol = tol_of(s, magnitude);
    const double differs_by = s.mean_only ? s.mean_limit : s.limit;
    bool item_match = true;
    double moved = 0, to_variant = 0, to_golden = 0;
    for (int64_t x = 0; x < s.cand.dim; ++x) {
      const double predicted = s.lse ? lse : (*p)[static_cast<size_t>(x)];
      const double c = s.cand(item.row, item.head, x), o = s.golden->view(g, item.head, x);
      const double e = distance(c, predicted);
      against_variant[item.subject].add(e);
      against_golden[item.subject].add(distance(c, o));
      if (!(e <= tol)) item_match = false;
      moved = std::max(moved, distance(predicted, o));
      to_variant = std::max(to_variant, e);
      to_golden = std::max(to_golden, distance(c, o));
    }
    // A failing item is explained where the variant moves it away from the golden (by half the limit at least: a
    // candidate just past the limit is the variant's move plus its own rounding) and the candidate sits nearer the
    // variant than the golden.
    if (!item_match) verdict.contradicted = true;
    else if (item.bad && moved > 0.5 * differs_by && to_variant < to_golden) ++verdict.explained;
  }
  for (auto& [id, verdict] : out) {
    const Subject& s = subjects_[id];
    verdict.match = !verdict.contradicted && verdict.explained > 0;
    // Clearly closer to the variant than to the golden, and within the mean limit against it.
    if (verdict.match && against_variant[id].mean() > std::max(1.25 * s.mean_limit, 0.5 * against_golden[id].mean()))
      verdict.match = false, verdict.contradicted = true;
    if (!verdict.match) verdict.explained = 0;
  }
  return out;
}

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

// softmax_scale, mask_edge and head_mapping (KV side) by recomputation on sampled rows.
void Diagnoser::test_variants() {
  const std::vector<size_t> ids = subjects_of({Quantity::o, Quantity::lse, Quantity::dq, Quantity::dk, Quantity::dv});
  std::vector<size_t> usable;
  for (size_t id : ids)
    if (subjects_[id].bad_items > 0) usable.push_back(id);
  if (usable.empty()) return;
  load_inputs();
  const std::vector<Item> items = sample(usable, 8, 4);
  if (items.empty()) return;

  // Families: one finding per family, from its variant that explains the most.
  struct Best {
    std::string label;
    std::map<size_t, Verdict> verdicts;
    int64_t explained = 0;
    double scale = 0;
  };
  auto consider = [&](Best& best, const Variant& v, double scale_value) {
    const std::map<size_t, Verdict> verdicts = judge(v, items);
    int64_t explained = 0;
    for (const auto& [id, verdict] : verdicts) explained += verdict.match ? verdict.explained : 0;
    if (explained > best.explained) best = {v.label, verdicts, explained, scale_value};
  };
  auto report = [&](DiagnosisKind kind, const Best& best, const std::string& prefix, nlohmann::ordered_json extra) {
    if (best.explained == 0) return;
    Finding f;
    f.kind = kind;
    std::vector<std::string> names;
    int64_t sampled = 0;
    for (const auto& [id, verdict] : best.verdicts) {
      if (!verdict.match) continue;
      const Subject& s = subjects_[id];
      names.push_back(s.name);
      sampled += verdict.items;
      std::vector<uint8_t> rows = flags(s.failing.size());
      for (int64_t row = 0; row < s.cand.rows; ++row) rows[static_cast<size_t>(row)] = s.row_bad[static_cast<size_t>(row)];
      f.rows[id] = rows;
    }
    f.evidence = names_text(names) + " match" + (names.size() == 1 ? "es" : "") + " attention recomputed " + prefix +
                 best.label + " on every one of " + std::to_string(sampled) + " sampled rows x heads (" +
                 std::to_string(best.explained) + " of them failing against the golden)";
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
      if (!lse_matched) verdicts.clear();
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
  std::ostringstream e;
  bool first = true;
  for (const auto& [text, names] : texts) {
    e << (first ? "" : "; ") << names_text(names) << " " << (names.size() == 1 ? "is " : "are ") << text;
    first = false;
  }
  f.evidence = e.str() + " on every valid row: the backward's softmax scale is wrong";
  f.where = where_of(f.rows);
  add(std::move(f));
}

// lse_convention: LSE = golden + c, golden x log2(e), golden x ln(2); +inf / -inf on keyless rows.
void Diagnoser::test_lse_forms() {
  Finding f;
  f.kind = DiagnosisKind::lse_convention;
  std::map<std::string, std::vector<std::string>> texts;
  const double empty = in_.empty_row_lse == EmptyRowLse::neg_inf ? -kInf : kInf;
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
      std::vector<double> sorted = diffs;
      std::nth_element(sorted.begin(), sorted.begin() + static_cast<long>(sorted.size() / 2), sorted.end());
      const double c = sorted[sorted.size() / 2];
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
      if (std::isfinite(c) && std::fabs(c) > s.limit && every([&](double o) { return o + c; }))
        form = "the golden + " + num(c) + " on every row (a constant offset)";
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
  std::ostringstream e;
  bool first = true;
  for (const auto& [text, names] : texts) {
    e << (first ? "" : "; ") << names_text(names) << ": LSE is " << text;
    first = false;
  }
  f.evidence = e.str();
  f.where = where_of(f.rows);
  add(std::move(f));
}

// ---------------------------------------------------------------------------------------------------------------
// inputs_mismatch without digests: well-formed attention outputs (finite, pads zero, the keyless rows of the golden,
// sum over keys of dK = 0) that these inputs cannot give: O rows outside the range of their visible V rows, or dV
// summing to another dO than the fixture's (sum over keys of dV = sum over rows with keys of dO, per sequence and KV
// head). Tested only when nothing more specific fits.
void Diagnoser::test_inputs_by_recomputation() {
  for (const Subject& s : subjects_)
    for (size_t r = 0; r < s.failing.size(); ++r)
      if (s.pad_nonzero[r] || s.nonfinite[r]) return;  // not well-formed
  for (const TensorResult& r : report_.results)
    if (!r.missing && !r.evaluation.exact_ok()) return;
  load_inputs();
  const ThdLayout& l = fx().layout;
  // A global tensor of a quantity: the global candidate, or the ranks' candidates put together.
  auto global_of = [&](Quantity q, std::vector<double>& out, std::vector<int64_t>& dims) {
    const bool kv = is_kv_side(q);
    const Side& sd = side(kv);
    const std::vector<int64_t> gd = in_.golden->info(golden_path(q)).dims;
    dims = gd;
    out.assign(static_cast<size_t>(gd[0] * gd[1] * gd[2]), 0.0);
    if (const DiagnosisCandidate* c = candidate(-1, -1, 0, q)) {
      const TensorView<float> v = candidate_view(*c, gd, q);
      for (int64_t row = 0; row < gd[0]; ++row)
        for (int64_t h = 0; h < gd[1]; ++h)
          for (int64_t x = 0; x < gd[2]; ++x) out[static_cast<size_t>((row * gd[1] + h) * gd[2] + x)] = v(row, h, x);
      return true;
    }
    for (int r = 0; r < plan().cp_size; ++r) {
      const DiagnosisCandidate* c = candidate(r, -1, 0, q);
      if (!c) return false;
      const TensorView<float> v = candidate_view(*c, in_.golden->info(rank_output_path(r, q)).dims, q);
      for (int64_t row = 0; row < v.rows; ++row) {
        const int64_t g = sd.gather[static_cast<size_t>(r)][static_cast<size_t>(row)];
        for (int64_t h = 0; h < gd[1]; ++h)
          for (int64_t x = 0; x < gd[2]; ++x) out[static_cast<size_t>((g * gd[1] + h) * gd[2] + x)] = v(row, h, x);
      }
    }
    return true;
  };
  auto limit_of = [&](Quantity q, bool mean) {
    double limit = 0;
    for (const TensorResult& r : report_.results)
      if (r.tensor == quantity_name(q) && r.step < 0 && !r.missing)
        limit = std::max(limit, mean ? r.evaluation.limits.mean : r.evaluation.limits.max);
    return limit;
  };
  const Variant base = base_variant();
  std::vector<std::string> evidence;
  // Backward: dK sums to zero over each sequence's keys (well-formed), dV to the sum of dO over rows with keys.
  std::vector<double> dk, dvv;
  std::vector<int64_t> dkd, dvd;
  bool backward_wellformed = true;
  if (global_of(Quantity::dk, dk, dkd)) {
    const double limit = limit_of(Quantity::dk, false);
    for (int b = 0; b < l.batch() && backward_wellformed; ++b) {
      const int64_t n = l.kv.length(b);
      for (int64_t g = 0; g < dkd[1] && backward_wellformed; ++g)
        for (int64_t x = 0; x < dkd[2]; ++x) {
          double sum = 0;
          for (int64_t j = 0; j < n; ++j) sum += dk[static_cast<size_t>(((l.kv.offset(b) + j) * dkd[1] + g) * dkd[2] + x)];
          if (std::fabs(sum) > double(n) * limit + 1e-6) {
            backward_wellformed = false;
            break;
          }
        }
    }
    if (!backward_wellformed) return;
  }
  int64_t dout_components = 0, dout_off = 0;
  if (global_of(Quantity::dv, dvv, dvd)) {
    const double limit = limit_of(Quantity::dv, false), mean_limit = limit_of(Quantity::dv, true);
    const GoldenTensor& glse = golden(Quantity::lse);
    for (int b = 0; b < l.batch(); ++b) {
      const int64_t n = l.kv.length(b);
      if (n == 0) continue;
      for (int64_t g = 0; g < dvd[1]; ++g)
        for (int64_t x = 0; x < dvd[2]; ++x) {
          double sum_dv = 0, sum_do = 0;
          for (int64_t j = 0; j < n; ++j) sum_dv += dvv[static_cast<size_t>(((l.kv.offset(b) + j) * dvd[1] + g) * dvd[2] + x)];
          for (int h = static_cast<int>(g) * group_; h < (static_cast<int>(g) + 1) * group_; ++h)
            for (int64_t i = 0; i < l.q.length(b); ++i) {
              const int64_t row = l.q.offset(b) + i;
              if (!std::isfinite(double(glse.view(row, h, 0)))) continue;  // no key: no contribution
              sum_do += idout_(row, h, x);
            }
          const double tol = std::max(4 * std::sqrt(double(n)) * limit, double(n) * mean_limit) + 1e-6;
          ++dout_components;
          if (std::fabs(sum_dv - sum_do) > tol) ++dout_off;
        }
    }
  }
  const bool dout_differs = dout_components > 0 && 2 * dout_off >= dout_components;
  if (dout_differs)
    evidence.push_back("dV sums over each sequence's keys to another dO than the fixture's (" + std::to_string(dout_off) +
                       " of " + std::to_string(dout_components) + " sequence x KV head x dim sums off by more than the budget" +
                       (dkd.empty() ? "" : ", while dK sums to 0 as attention's backward must") + "): dout differs");
  // Forward: O and LSE wrong nearly everywhere, and O rows outside the range of the fixture's visible V rows.
  int64_t o_items = 0, o_bad = 0, lse_items = 0, lse_bad = 0;
  for (const Subject& s : subjects_) {
    if (s.quantity != Quantity::o && s.quantity != Quantity::lse) continue;
    for (int64_t row = 0; row < s.cand.rows; ++row) {
      const int64_t g = s.global[static_cast<size_t>(row)];
      if (!q_.valid[static_cast<size_t>(g)]) continue;
      for (int64_t h = 0; h < s.cand.heads; ++h) {
        if (!std::isfinite(double(golden(Quantity::lse).view(g, h, 0)))) continue;
        (s.lse ? lse_items : o_items) += 1;
        if (s.item_bad[static_cast<size_t>(row * s.cand.heads + h)]) (s.lse ? lse_bad : o_bad) += 1;
      }
    }
  }
  bool forward_other = false;
  if (o_items > 0 && lse_items > 0 && 10 * o_bad >= 9 * o_items && 10 * lse_bad >= 9 * lse_items) {
    std::vector<double> o;
    std::vector<int64_t> od;
    if (global_of(Quantity::o, o, od)) {
      const double limit = limit_of(Quantity::o, false);
      int64_t outside = 0, tested = 0;
      // Rows with the fewest visible keys say the most: the first rows of each sequence first, 512 at most.
      std::vector<std::pair<int64_t, int64_t>> rows;  // (visible keys, global row)
      for (int b = 0; b < l.batch(); ++b)
        for (int64_t i = 0; i < l.q.length(b); ++i) {
          int64_t keys = 0;
          for (int64_t j = 0; j < l.kv.length(b); ++j) keys += visible(base, b, i, j);
          if (keys > 0) rows.push_back({keys, l.q.offset(b) + i});
        }
      std::sort(rows.begin(), rows.end());
      if (rows.size() > 512) rows.resize(512);
      for (const auto& [keys, row] : rows) {
        const int b = q_.sequence[static_cast<size_t>(row)];
        const int64_t i = q_.position[static_cast<size_t>(row)];
        for (int64_t h = 0; h < od[1]; ++h) {
          const int g = h / group_;
          bool out = false;
          for (int64_t x = 0; x < od[2] && !out; ++x) {
            double lo = kInf, hi = -kInf;
            for (int64_t j = 0; j < l.kv.length(b); ++j)
              if (visible(base, b, i, j)) {
                const double v = iv_(l.kv.offset(b) + j, g, x);
                lo = std::min(lo, v), hi = std::max(hi, v);
              }
            const double c = o[static_cast<size_t>((row * od[1] + h) * od[2] + x)];
            out = c < lo - limit || c > hi + limit;
          }
          ++tested;
          outside += out;
        }
      }
      if (outside > 0) {
        forward_other = true;
        evidence.push_back("O and LSE are wrong on " + std::to_string(o_bad) + " of " + std::to_string(o_items) + " and " +
                           std::to_string(lse_bad) + " of " + std::to_string(lse_items) +
                           " valid rows x heads, and " + std::to_string(outside) + " of " + std::to_string(tested) +
                           " tested O rows lie outside the range of their visible V rows, which attention over these "
                           "inputs cannot give");
      }
    }
  }
  if (!forward_other && !dout_differs) return;
  Finding f;
  f.kind = DiagnosisKind::inputs_mismatch;
  f.evidence = "the outputs are well-formed attention (finite, pad rows 0, the golden's keyless rows) computed from other "
               "inputs: " + list_text(evidence, 2);
  for (size_t i = 0; i < subjects_.size(); ++i) f.rows[i] = subjects_[i].failing;
  f.where = where_of(f.rows);
  f.where["method"] = "recomputation";
  f.where["dout_differs"] = dout_differs;
  f.where["forward_differs"] = forward_other;
  add(std::move(f));
}

}  // namespace cpgold::fx::diagnosis_detail
