// tail_rows_missing: the wrong rows are the last k valid rows of sequences, left unwritten (docs/diagnosis.md).
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
// tail_rows_missing: in every group of rows (a sequence globally, or a sequence on a rank in rank-local order, or
// one chunk of it), the failing valid rows are the last k, the rows before them right, and the k rows unwritten.
void Diagnoser::test_tail_rows() {
  struct Group {
    std::vector<int64_t> rows;  // subject rows of the valid rows, in order
    int rank = -1, sequence = -1;
    int64_t expected = -1;      // rows a cu // W count leaves out (-1: no such prediction)
  };
  // The rank-local view of `rank`: per sequence (or per chunk with halves) the valid local rows in order, mapped by
  // `to_subject` to rows of the subject.
  auto rank_groups = [&](const Side& sd, int rank, bool halves, const std::function<int64_t(int64_t)>& to_subject) {
    std::vector<Group> out;
    const sim::SidePartition& part = *sd.part;
    const int w = part.cp_size();
    const std::vector<int32_t>& cu = sd.seqs->cu_seqlens;
    for (int b = 0; b < sd.seqs->batch(); ++b) {
      const int64_t start = sd.seqs->offset(b) / w;
      const int64_t c = part.chunk_size(b);
      for (int half = 0; half < (halves ? 2 : 1); ++half) {
        Group g;
        g.rank = rank;
        g.sequence = b;
        const int64_t first = start + (halves ? half * c : 0), count = halves ? c : 2 * c;
        const int64_t shortcut = halves ? cu[static_cast<size_t>(b + 1)] / (2 * w) - cu[static_cast<size_t>(b)] / (2 * w)
                                        : cu[static_cast<size_t>(b + 1)] / w - cu[static_cast<size_t>(b)] / w;
        g.expected = 0;
        for (int64_t x = first; x < first + count; ++x) {
          const int64_t global = sd.gather[static_cast<size_t>(rank)][static_cast<size_t>(x)];
          if (!sd.valid[static_cast<size_t>(global)]) continue;
          g.rows.push_back(to_subject(x));
          if (x - first >= shortcut) ++g.expected;
        }
        out.push_back(std::move(g));
      }
    }
    return out;
  };
  struct Fit {
    bool ok = false;
    bool some_kept = true;  // constant k: a group keeps a right row (else it needs another result that does)
    std::string pattern;
    std::vector<uint8_t> rows;
    std::vector<int64_t> ks;
    std::set<int> sequences, ranks;
  };
  auto missing_row = [](const Subject& s, int64_t row) {
    if (s.lse) {
      const double first = s.cand(row, 0, 0);
      if (!(first == 0 || std::isinf(first))) return false;
      for (int64_t h = 0; h < s.cand.heads; ++h)
        if (double(s.cand(row, h, 0)) != first) return false;
      return true;
    }
    for (int64_t h = 0; h < s.cand.heads; ++h)
      for (int64_t x = 0; x < s.cand.dim; ++x)
        if (s.cand(row, h, x) != 0.f) return false;
    return true;
  };
  // Per group: k_bad trailing failing rows (every failing row of the group among them, each unwritten), k_miss
  // trailing unwritten rows (a tail row whose golden value is itself 0, a row without keys, counts as either).
  auto fit = [&](const Subject& s, const std::vector<Group>& groups, bool use_expected) {
    struct Tail {
      int64_t bad = 0, missing = 0, size = 0, expected = -1;
      int rank = -1, sequence = -1;
    };
    std::vector<Tail> tails;
    int64_t bad_rows = 0, covered = 0;
    for (uint8_t b : s.row_bad) bad_rows += b;
    for (const Group& g : groups) {
      Tail t;
      t.size = static_cast<int64_t>(g.rows.size());
      t.expected = g.expected;
      t.rank = g.rank;
      t.sequence = g.sequence;
      auto from_end = [&](int64_t i) { return g.rows[g.rows.size() - 1 - static_cast<size_t>(i)]; };
      while (t.bad < t.size && s.row_bad[static_cast<size_t>(from_end(t.bad))]) {
        if (!missing_row(s, from_end(t.bad))) return Fit{};
        ++t.bad;
      }
      for (int64_t i = t.bad; i < t.size; ++i)
        if (s.row_bad[static_cast<size_t>(from_end(i))]) return Fit{};  // a failing row before the tail
      t.missing = t.bad;
      while (t.missing < t.size && missing_row(s, from_end(t.missing))) ++t.missing;
      covered += t.bad;
      tails.push_back(t);
    }
    if (covered == 0 || covered != bad_rows) return Fit{};
    Fit f;
    f.rows = flags(s.failing.size());
    auto take = [&](const Group& g, const Tail& t, int64_t k) {
      for (int64_t i = 0; i < std::min(k, t.size); ++i) f.rows[static_cast<size_t>(g.rows[g.rows.size() - 1 - static_cast<size_t>(i)])] = 1;
      if (k > 0) {
        f.ks.push_back(k);
        f.sequences.insert(t.sequence);
        if (t.rank >= 0) f.ranks.insert(t.rank);
      }
    };
    bool cu = use_expected;
    for (const Tail& t : tails) cu &= t.bad <= t.expected && t.expected <= std::max(t.bad, t.missing);
    if (cu) {
      f.pattern = "cu";
      for (size_t i = 0; i < tails.size(); ++i) take(groups[i], tails[i], tails[i].expected);
      f.ok = true;
      return f;
    }
    int64_t k = 0;
    for (const Tail& t : tails) k = std::max(k, t.bad);
    bool constant = true, some_kept = false;
    for (const Tail& t : tails) {
      if (t.bad == 0) continue;
      constant &= k <= std::max(t.bad, t.missing);
      some_kept |= k < t.size;
    }
    if (!constant) return Fit{};
    f.some_kept = some_kept;  // whole sequences at 0 are no tail unless another result shows the same k with a kept row
    f.pattern = "constant";
    for (size_t i = 0; i < tails.size(); ++i)
      if (tails[i].bad > 0) take(groups[i], tails[i], k);
    f.ok = true;
    return f;
  };

  Finding finding;
  finding.kind = DiagnosisKind::tail_rows_missing;
  std::map<std::string, std::vector<std::string>> by_pattern;  // pattern text -> subjects
  std::set<int> sequences, ranks;
  struct Chosen {
    size_t subject;
    std::string view;
    Fit fit;
  };
  std::vector<Chosen> chosen;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    if (s.bad_items == 0 || s.mean_only) continue;
    const Side& sd = side(s.kv);
    const int w = plan().cp_size;
    std::vector<std::pair<std::string, Fit>> fits;  // most specific first
    auto try_ranks = [&](bool halves, const std::string& name) {
      std::vector<Group> groups;
      for (int r = 0; r < w; ++r) {
        if (s.rank >= 0 && r != s.rank) continue;
        std::vector<Group> gr = rank_groups(sd, r, halves, [&](int64_t x) {
          return s.rank >= 0 ? x : sd.gather[static_cast<size_t>(r)][static_cast<size_t>(x)];
        });
        groups.insert(groups.end(), gr.begin(), gr.end());
      }
      Fit f = fit(s, groups, w > 1);
      if (f.ok) fits.push_back({name, std::move(f)});
    };
    if (w > 1 || s.rank >= 0) try_ranks(false, w > 1 ? "rank" : "global");
    if (w > 1) try_ranks(true, "chunk");
    if (s.rank < 0) {
      std::vector<Group> groups;
      for (int b = 0; b < sd.seqs->batch(); ++b) {
        Group g;
        g.sequence = b;
        for (int32_t x = 0; x < sd.seqs->length(b); ++x) g.rows.push_back(sd.seqs->offset(b) + x);
        groups.push_back(std::move(g));
      }
      Fit f = fit(s, groups, false);
      if (f.ok) fits.push_back({"global", std::move(f)});
    }
    if (fits.empty()) continue;
    // cu // W first, then a constant k over rank-local sequences, then over global sequences.
    std::stable_sort(fits.begin(), fits.end(), [](const auto& a, const auto& b) { return (a.second.pattern == "cu") > (b.second.pattern == "cu"); });
    const auto& [view, f] = fits.front();
    chosen.push_back({i, view, f});
  }
  // A result whose every affected group lost all its rows counts when another one shows the same k with rows kept.
  std::set<std::string> kept_patterns;
  for (const Chosen& c : chosen)
    if (c.fit.some_kept) kept_patterns.insert(c.view + "/" + c.fit.pattern + "/" + std::to_string(c.fit.ks.empty() ? 0 : c.fit.ks.front()));
  for (const Chosen& c : chosen) {
    const size_t i = c.subject;
    const Subject& s = subjects_[i];
    const std::string& view = c.view;
    const Fit& f = c.fit;
    if (!f.some_kept && !kept_patterns.count(view + "/" + f.pattern + "/" + std::to_string(f.ks.empty() ? 0 : f.ks.front())))
      continue;
    std::string text;
    if (f.pattern == "cu")
      text = view == "chunk" ? "the valid rows past cu_seqlens // (2W) of each chunk on each rank"
                             : "the valid rows past cu_seqlens // W of each sequence on each rank";
    else
      text = "the last " + std::to_string(f.ks.front()) + " valid row(s) of each affected sequence" +
             (view == "global" ? "" : view == "rank" ? " on each rank (rank-local order)" : " in each chunk");
    by_pattern[text].push_back(s.name);
    sequences.insert(f.sequences.begin(), f.sequences.end());
    ranks.insert(f.ranks.begin(), f.ranks.end());
    finding.rows[i] = f.rows;
  }
  if (finding.rows.empty()) return;
  int64_t rows = 0;
  for (const auto& [index, marks] : finding.rows)
    for (uint8_t m : marks) rows += m;
  const std::string tail = " hold 0 (never written) while every other valid row is right (" + std::to_string(rows) +
                           " row(s) of sequence(s) " + list_text(std::vector<int>(sequences.begin(), sequences.end())) +
                           ")";
  add(std::move(finding), clauses_text(by_pattern, [](const std::string& text, const std::vector<std::string>& names) {
        return text + " in " + names_text(names);
      }) + tail);
}

}  // namespace cpgold::fx::diagnosis_detail
