// Attention perturbed as a hypothesis predicts, recomputed in float64 on the fixture's inputs for sampled rows (every
// recomputing test shares it), and the judgement of a variant against the candidate and the golden.
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
    double moved = 0, to_variant = 0, to_golden = 0, ratio = 0;
    for (int64_t x = 0; x < s.cand.dim; ++x) {
      const double predicted = s.lse ? lse : (*p)[static_cast<size_t>(x)];
      const double c = s.cand(item.row, item.head, x), o = s.golden->view(g, item.head, x);
      const double e = distance(c, predicted);
      against_variant[item.subject].add(e);
      against_golden[item.subject].add(distance(c, o));
      if (!(e <= tol)) item_match = false;
      ratio = std::max(ratio, std::isfinite(e) ? e / tol : kInf);
      moved = std::max(moved, distance(predicted, o));
      to_variant = std::max(to_variant, e);
      to_golden = std::max(to_golden, distance(c, o));
    }
    // A failing item is explained where the variant moves it away from the golden (by half the limit at least: a
    // candidate just past the limit is the variant's move plus its own rounding) and the candidate sits nearer the
    // variant than the golden. An item off the variant by a few tolerances is a near miss (the implementation's own
    // rounding of a computation the budget was not made for, a scale of 1 on long rows); one off by more contradicts it.
    if (!item_match) (ratio > 4 ? verdict.far : verdict.near) += 1;
    else if (item.bad && moved > 0.5 * differs_by && to_variant < to_golden) ++verdict.explained;
  }
  for (auto& [id, verdict] : out) {
    const Subject& s = subjects_[id];
    verdict.contradicted = verdict.far > 0 || 8 * verdict.near > verdict.items;
    verdict.match = !verdict.contradicted && verdict.explained > 0;
    // Clearly closer to the variant than to the golden, and within the mean limit against it.
    if (verdict.match && against_variant[id].mean() > std::max(1.25 * s.mean_limit, 0.5 * against_golden[id].mean()))
      verdict.match = false, verdict.contradicted = true;
    if (!verdict.match) verdict.explained = 0;
  }
  return out;
}

}  // namespace cpgold::fx::diagnosis_detail
