// merge: the candidate's own step partials merge to the golden while its merged outputs differ (docs/diagnosis.md).
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
// merge: the candidate's own step partials, mapped to global rows through the Plan and merged the right way
// (LSE-weighted for the forward, summed for the backward). A merge bug: on every failing item the partials merge to
// the golden while the candidate's merged output is something else; named when that something else is a plain sum
// of the partials, the merge without one partial, or (dK/dV) a partial added to another rank's rows.
void Diagnoser::test_merge() {
  struct Partial {
    int rank = 0, step = 0;
    const DiagnosisCandidate* a = nullptr;  // forward o / backward dq, dk or dv
    const DiagnosisCandidate* b = nullptr;  // forward lse
    const sim::Tile* tile = nullptr;
  };
  struct Ref {
    size_t partial;
    int64_t row, head;  // step row and tile head
  };
  auto row_map = [&](const sim::Tile& tile, bool kv) {  // step row -> global row (-1 outside the segments)
    std::vector<int64_t> map(static_cast<size_t>(kv ? tile.call.kv_rows : tile.call.q_rows), -1);
    const PackedSequences& seqs = kv ? fx().layout.kv : fx().layout.q;
    for (size_t b = 0; b < tile.call.sequences.size(); ++b)
      for (const RowSegment& seg : kv ? tile.call.sequences[b].kv : tile.call.sequences[b].q)
        for (int32_t x = 0; x < seg.count; ++x)
          map[static_cast<size_t>(seg.first_row + x)] = seqs.offset(static_cast<int>(b)) + seg.position + x;
    return map;
  };
  auto has_partials = [&](int pass, Quantity a) {
    for (const DiagnosisCandidate& c : in_.candidates)
      if (c.step >= 0 && c.pass == pass && c.quantity == a) return true;
    return false;
  };
  std::map<std::string, std::vector<std::string>> specific_texts, generic_texts;
  Finding specific, generic;
  specific.kind = generic.kind = DiagnosisKind::merge;
  generic.priority = 10;  // "merges to the golden, differs" names no mechanism: after every other kind
  auto record = [&](size_t id, const std::string& text, bool named, const std::vector<uint8_t>& rows) {
    (named ? specific_texts : generic_texts)[text].push_back(subjects_[id].name);
    std::vector<uint8_t>& mine = (named ? specific : generic).rows[id];
    if (mine.empty()) mine = flags(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) mine[r] |= rows[r];
  };

  // Forward: O and LSE.
  if (has_partials(0, Quantity::o) && has_partials(0, Quantity::lse)) {
    std::vector<Partial> partials;
    std::map<std::pair<int64_t, int64_t>, std::vector<Ref>> covering;  // (global row, head)
    for (const sim::Tile& tile : plan().forward.tiles) {
      if (!tile.computed) continue;
      const DiagnosisCandidate* o = candidate(tile.rank, tile.step, 0, Quantity::o);
      const DiagnosisCandidate* l = candidate(tile.rank, tile.step, 0, Quantity::lse);
      if (!o || !l) continue;
      partials.push_back({tile.rank, tile.step, o, l, &tile});
      const std::vector<int64_t> map = row_map(tile, false);
      for (size_t x = 0; x < map.size(); ++x)
        if (map[x] >= 0)
          for (int h = tile.head_begin; h < tile.head_end; ++h)
            covering[{map[x], h}].push_back({partials.size() - 1, static_cast<int64_t>(x), h - tile.head_begin});
    }
    auto o_of = [&](const Ref& r, int64_t x) {
      const Partial& p = partials[r.partial];
      const int64_t heads = p.tile->head_end - p.tile->head_begin;
      return double((*p.a->values)[static_cast<size_t>((r.row * heads + r.head) * dv_ + x)]);
    };
    auto lse_of = [&](const Ref& r) {
      const Partial& p = partials[r.partial];
      const int64_t heads = p.tile->head_end - p.tile->head_begin, rows = p.tile->call.q_rows;
      return double((*p.b->values)[static_cast<size_t>(p.b->lse_row_major ? r.row * heads + r.head : r.head * rows + r.row)]);
    };
    // The merge of the partials of one (row, head), leaving out partial `skip` (SIZE_MAX: none).
    auto merge = [&](const std::vector<Ref>& refs, size_t skip, std::vector<double>& o, double& lse) {
      lse = -kInf;
      for (const Ref& r : refs) {
        const double l = lse_of(r);
        if (r.partial == skip || l == -kInf) continue;
        lse = lse == -kInf ? l : std::max(lse, l) + std::log1p(std::exp(std::min(lse, l) - std::max(lse, l)));
      }
      o.assign(static_cast<size_t>(dv_), 0.0);
      if (lse == -kInf) return;
      for (const Ref& r : refs) {
        const double l = lse_of(r);
        if (r.partial == skip || l == -kInf) continue;
        const double w = std::exp(l - lse);
        for (int x = 0; x < dv_; ++x) o[static_cast<size_t>(x)] += w * o_of(r, x);
      }
    };
    for (size_t id : subjects_of({Quantity::o, Quantity::lse})) {
      const Subject& s = subjects_[id];
      if (s.bad_items == 0 || s.mean_only) continue;
      auto matches = [&](int64_t row, int64_t h, const std::vector<double>& po, double pl) {
        if (s.lse) return distance(s.cand(row, h, 0), pl) <= tol_of(s, pl);
        for (int x = 0; x < dv_; ++x)
          if (distance(s.cand(row, h, x), po[static_cast<size_t>(x)]) > tol_of(s, po[static_cast<size_t>(x)])) return false;
        return true;
      };
      bool merge_bug = true;
      int64_t checked = 0, unweighted = 0, differs = 0;
      std::map<std::pair<int, int>, int64_t> dropped;  // (rank, step) left out -> failing items it explains
      for (int64_t row = 0; row < s.cand.rows && merge_bug; ++row)
        for (int64_t h = 0; h < s.cand.heads && merge_bug; ++h) {
          if (!s.item_bad[static_cast<size_t>(row * s.cand.heads + h)]) continue;
          const auto found = covering.find({s.global[static_cast<size_t>(row)], h});
          if (found == covering.end()) {
            merge_bug = false;
            break;
          }
          std::vector<double> o;
          double lse = 0;
          merge(found->second, SIZE_MAX, o, lse);
          std::vector<double> golden_o(static_cast<size_t>(dv_));
          for (int x = 0; x < (s.lse ? 0 : dv_); ++x) golden_o[static_cast<size_t>(x)] = s.gold(row, h, x);
          // The partials merge to the golden, and the candidate holds something else.
          const bool partials_right = s.lse ? distance(lse, s.gold(row, h, 0)) <= tol_of(s, lse) : [&] {
            for (int x = 0; x < dv_; ++x)
              if (distance(o[static_cast<size_t>(x)], golden_o[static_cast<size_t>(x)]) > tol_of(s, o[static_cast<size_t>(x)])) return false;
            return true;
          }();
          merge_bug = partials_right;
          if (!merge_bug) break;
          ++checked;
          differs += !matches(row, h, o, lse);
          if (!s.lse) {
            std::vector<double> sum(static_cast<size_t>(dv_), 0.0);
            for (const Ref& r : found->second)
              for (int x = 0; x < dv_; ++x) sum[static_cast<size_t>(x)] += o_of(r, x);
            if (matches(row, h, sum, 0)) ++unweighted;
          }
          for (const Ref& r : found->second) {
            std::vector<double> po;
            double pl = 0;
            merge(found->second, r.partial, po, pl);
            if (matches(row, h, po, pl)) ++dropped[{partials[r.partial].rank, partials[r.partial].step}];
          }
        }
      if (!merge_bug || checked == 0 || 2 * differs < checked) continue;
      std::string text;
      if (unweighted == checked) text = "the merged O is the plain sum of the step partials (no exp(lse_i - lse) weights)";
      for (const auto& [rs, n] : dropped)
        if (text.empty() && n == checked)
          text = "the merge leaves out the step-" + std::to_string(rs.second) + " partial of rank " + std::to_string(rs.first);
      const bool named = !text.empty();
      if (!named) text = "the step partials merge to the golden but the merged " + std::string(quantity_name(s.quantity)) + " differs";
      record(id, text, named, s.row_bad);
    }
  }

  // Backward: dQ, dK, dV are sums of the step partials.
  for (Quantity q : {Quantity::dq, Quantity::dk, Quantity::dv}) {
    if (!has_partials(1, q)) continue;
    const bool kv = q != Quantity::dq;
    const Side& sd = side(kv);
    const int64_t dim = q == Quantity::dv ? dv_ : dqk_;
    std::vector<Partial> partials;
    std::vector<std::vector<int64_t>> maps;
    std::map<std::pair<int64_t, int64_t>, std::vector<Ref>> covering;
    for (const sim::Tile& tile : plan().backward.tiles) {
      if (!tile.computed) continue;
      const DiagnosisCandidate* c = candidate(tile.rank, tile.step, 1, q);
      if (!c) continue;
      partials.push_back({tile.rank, tile.step, c, nullptr, &tile});
      maps.push_back(row_map(tile, kv));
      const int hb = kv ? tile.kv_head_begin : tile.head_begin, he = kv ? tile.kv_head_end : tile.head_end;
      for (size_t x = 0; x < maps.back().size(); ++x)
        if (maps.back()[x] >= 0)
          for (int h = hb; h < he; ++h) covering[{maps.back()[x], h}].push_back({partials.size() - 1, static_cast<int64_t>(x), h - hb});
    }
    auto heads_of = [&](const Partial& p) {
      return kv ? p.tile->kv_head_end - p.tile->kv_head_begin : p.tile->head_end - p.tile->head_begin;
    };
    auto value = [&](size_t partial, int64_t row, int64_t head, int64_t x) {
      const Partial& p = partials[partial];
      return double((*p.a->values)[static_cast<size_t>((row * heads_of(p) + head) * dim + x)]);
    };
    for (size_t id : subjects_of({q})) {
      const Subject& s = subjects_[id];
      bool pads_only = kv && s.bad_items == 0;  // a partial that landed on another rank's pad rows only
      if (pads_only) pads_only = std::find(s.pad_nonzero.begin(), s.pad_nonzero.end(), 1) != s.pad_nonzero.end();
      if ((s.bad_items == 0 && !pads_only) || s.mean_only) continue;
      bool merge_bug = true;
      int64_t checked = 0, differs = 0;
      std::map<size_t, int64_t> dropped;  // partial left out -> failing items it explains
      for (int64_t row = 0; row < s.cand.rows && merge_bug; ++row)
        for (int64_t h = 0; h < s.cand.heads && merge_bug; ++h) {
          if (!s.item_bad[static_cast<size_t>(row * s.cand.heads + h)]) continue;
          const auto found = covering.find({s.global[static_cast<size_t>(row)], h});
          std::vector<double> sum(static_cast<size_t>(dim), 0.0);
          if (found != covering.end())
            for (const Ref& r : found->second)
              for (int64_t x = 0; x < dim; ++x) sum[static_cast<size_t>(x)] += value(r.partial, r.row, r.head, x);
          bool partials_right = true, candidate_is_sum = true;
          for (int64_t x = 0; x < dim; ++x) {
            const double p = sum[static_cast<size_t>(x)];
            partials_right &= distance(p, s.gold(row, h, x)) <= tol_of(s, p);
            candidate_is_sum &= distance(s.cand(row, h, x), p) <= tol_of(s, p);
          }
          merge_bug = partials_right;
          if (!merge_bug) break;
          ++checked;
          differs += !candidate_is_sum;
          if (found == covering.end()) continue;
          for (const Ref& r : found->second) {
            bool ok = true;
            for (int64_t x = 0; x < dim && ok; ++x) {
              const double p = sum[static_cast<size_t>(x)] - value(r.partial, r.row, r.head, x);
              ok = distance(s.cand(row, h, x), p) <= tol_of(s, p);
            }
            if (ok) ++dropped[r.partial];
          }
        }
      // The partials merge to the golden on every failing item, and the candidate holds something else on most
      // (an item just past the limit can sit within the tolerance of both).
      if (!merge_bug || (checked == 0 && !pads_only) || 2 * differs < checked) continue;
      std::string text;
      std::vector<uint8_t> rows = s.row_bad;
      for (const auto& [index, n] : dropped)
        if (text.empty() && n == checked) {
          const Partial& p = partials[index];
          text = "the step-" + std::to_string(p.step) + " " + std::string(quantity_name(q)) + " partial of rank " +
                 std::to_string(p.rank) + (kv && p.tile->kv_owner >= 0 ? " (KV of rank " + std::to_string(p.tile->kv_owner) + ")" : "") +
                 " is missing from its rows";
        }
      if (text.empty() && kv) {
        // A partial added at the rows that another rank holds at the same local index (a wrong owner): every failing
        // item there is the golden plus the partial, and pad rows hit by it hold exactly the partial.
        for (size_t index = 0; index < partials.size() && text.empty(); ++index) {
          const Partial& p = partials[index];
          if (p.tile->kv_owner < 0) continue;
          for (int other = 0; other < plan().cp_size && text.empty(); ++other) {
            if (other == p.tile->kv_owner) continue;
            int64_t hits = 0, misses = 0;
            std::vector<uint8_t> target_rows = flags(s.failing.size());
            const std::vector<int64_t>& map = maps[index];
            for (size_t x = 0; x < map.size(); ++x) {
              if (map[x] < 0 || sd.owner[static_cast<size_t>(map[x])] != p.tile->kv_owner) continue;  // the owner's rows
              const int64_t local = sd.local[static_cast<size_t>(map[x])];
              if (local < 0) continue;
              const int64_t target = sd.gather[static_cast<size_t>(other)][static_cast<size_t>(local)];
              const int64_t srow = s.rank < 0 ? target : s.rank == other ? local : -1;
              if (srow < 0) continue;
              const bool valid = sd.valid[static_cast<size_t>(target)];
              for (int h = p.tile->kv_head_begin; h < p.tile->kv_head_end; ++h) {
                const bool bad = valid ? s.item_bad[static_cast<size_t>(srow * s.cand.heads + h)] != 0 : s.pad_nonzero[static_cast<size_t>(srow)] != 0;
                if (!bad) continue;
                bool ok = true;
                for (int64_t d = 0; d < dim && ok; ++d) {
                  const double expect = (valid ? double(s.gold(srow, h, d)) : 0.0) +
                                        value(index, static_cast<int64_t>(x), h - p.tile->kv_head_begin, d);
                  ok = distance(s.cand(srow, h, d), expect) <= tol_of(s, expect);
                }
                (ok ? hits : misses) += 1;
                if (ok) target_rows[static_cast<size_t>(srow)] = 1;
              }
            }
            if (hits > 0 && misses == 0) {
              text = "the step-" + std::to_string(p.step) + " " + std::string(quantity_name(q)) + " partial of rank " +
                     std::to_string(p.rank) + " (KV of rank " + std::to_string(p.tile->kv_owner) + ") is added to rank " +
                     std::to_string(other) + "'s rows: a wrong owner";
              for (size_t r = 0; r < rows.size(); ++r) rows[r] |= target_rows[r];
            }
          }
        }
      }
      const bool named = !text.empty();
      if (!named && pads_only) continue;
      if (!named) text = "the step partials sum to the golden but the accumulated " + std::string(quantity_name(q)) + " differs";
      record(id, text, named, rows);
    }
  }
  for (auto* pair : {&specific_texts, &generic_texts}) {
    Finding& f = pair == &specific_texts ? specific : generic;
    if (f.rows.empty()) continue;
    add(std::move(f), clauses_text(*pair, [](const std::string& text, const std::vector<std::string>& names) {
          return names_text(names) + ": " + text;
        }) + " (the candidate's own step partials, merged through the Plan, give the golden)");
  }
}

}  // namespace cpgold::fx::diagnosis_detail
