// chunk_order: candidate rows that match the golden rows of another chunk, rank or order (docs/diagnosis.md).
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
// chunk_order: block matching. Every chunk-sized block of a failing result is compared with the golden rows of each
// chunk of the same sequence; a block that holds another chunk's rows names it. Whole-tensor orders as well: a global
// tensor in rank order (the ranks' local rows concatenated), a rank holding a contiguous slice in sequence order.
void Diagnoser::test_chunk_order() {
  const int w = plan().cp_size;
  // Does `count` rows of the subject from `first` hold the golden rows of chunk `chunk` of sequence b?
  // informative: the source has valid rows with values past the limit (an all-pad or all-zero source only says that
  // the block is zero).
  auto holds = [&](const Subject& s, int64_t first, int b, int chunk, bool& informative) {
    const Side& sd = side(s.kv);
    const int64_t c = sd.part->chunk_size(b);
    informative = false;
    for (int64_t i = 0; i < c; ++i) {
      const int64_t row = first + i;
      const int64_t pos = chunk * c + i;
      const int64_t g = sd.seqs->offset(b) + pos;
      const bool valid = pos < sd.seqs->length(b);
      if (!valid) {
        if (s.lse) continue;
        for (int64_t h = 0; h < s.cand.heads; ++h)
          for (int64_t x = 0; x < s.cand.dim; ++x)
            if (s.cand(row, h, x) != 0.f) return false;
        continue;
      }
      for (int64_t h = 0; h < s.cand.heads; ++h)
        for (int64_t x = 0; x < s.cand.dim; ++x) {
          const double o = s.golden->view(g, h, x);
          if (distance(s.cand(row, h, x), o) > s.limit) {
            if (s.lse && !std::isfinite(o) && !std::isfinite(double(s.cand(row, h, x)))) continue;
            return false;
          }
          // A zero golden row (one visible key gives dQ = 0) matches any zero block: it names nothing.
          if (s.lse ? std::isfinite(o) : std::fabs(o) > s.limit) informative = true;
        }
    }
    return true;
  };
  struct SlotMatch {
    int rank = 0, sequence = 0, slot = 0, expected = 0;
    int holds = -1;             // informative match
    std::vector<int> all_pad;   // all-pad chunks the (zero) block matches
  };
  Finding finding;
  finding.kind = DiagnosisKind::chunk_order;
  std::map<std::string, std::vector<std::string>> texts;  // description (or @rule) -> subject names
  std::map<std::string, std::set<int>> rule_ranks;        // @rule -> ranks that follow it
  std::vector<nlohmann::ordered_json> detail;
  struct Block {  // the moved blocks of one subject and rank
    size_t subject = 0;
    int rank = 0;
    std::vector<SlotMatch> moved;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    if (s.passing) continue;
    const Side& sd = side(s.kv);
    std::vector<uint8_t> rows = flags(s.failing.size());
    // Whole-tensor orders first.
    const int64_t tpr = sd.part->local_sequence_rows();
    auto whole = [&](const std::function<int64_t(int64_t)>& source, int64_t count) {
      bool informative = false;
      for (int64_t row = 0; row < count; ++row) {
        const int64_t g = source(row);
        if (g < 0 || g >= static_cast<int64_t>(sd.valid.size())) return false;
        const bool valid = sd.valid[static_cast<size_t>(g)];
        for (int64_t h = 0; h < s.cand.heads; ++h)
          for (int64_t x = 0; x < s.cand.dim; ++x) {
            const double c = s.cand(row, h, x);
            if (!valid) {
              if (!s.lse && c != 0) return false;
              continue;
            }
            const double o = s.golden->view(g, h, x);
            if (s.lse && !std::isfinite(o) && !std::isfinite(c)) continue;
            if (distance(c, o) > s.limit) return false;
            if (s.global[static_cast<size_t>(row)] != g && (s.lse ? std::isfinite(o) : std::fabs(o) > s.limit)) informative = true;
          }
      }
      return informative;
    };
    if (w > 1 && s.rank < 0) {
      const std::vector<int64_t> map = sd.part->rank_order_to_sequence_order();
      if (whole([&](int64_t x) { return map[static_cast<size_t>(x)]; }, static_cast<int64_t>(map.size()))) {
        for (size_t x = 0; x < map.size(); ++x) rows[x] = 1;
        texts["the global tensor is in rank order (the ranks' local rows one after the other), not in sequence order"]
            .push_back(s.name);
        finding.rows[i] = rows;
        continue;
      }
    }
    if (w > 1 && s.rank >= 0) {
      const int r = s.rank;
      if (whole([&](int64_t x) { return r * tpr + x; }, tpr)) {
        for (int64_t x = 0; x < tpr; ++x) rows[static_cast<size_t>(x)] = 1;
        texts["@slice"].push_back(s.name);
        rule_ranks["@slice"].insert(r);
        finding.rows[i] = rows;
        continue;
      }
    }
    // Block matching, per rank and sequence: the blocks of chunks r and 2W-1-r.
    for (int r = 0; r < w; ++r) {
      if (s.rank >= 0 && r != s.rank) continue;
      std::vector<SlotMatch> moved;
      for (int b = 0; b < sd.seqs->batch(); ++b) {
        const int64_t c = sd.part->chunk_size(b);
        if (c == 0) continue;
        for (int slot = 0; slot < 2; ++slot) {
          const int expected = slot == 0 ? r : 2 * w - 1 - r;
          const int64_t first = s.rank >= 0 ? sd.seqs->offset(b) / w + slot * c : sd.seqs->offset(b) + expected * c;
          bool block_failing = false;
          for (int64_t x = first; x < first + c; ++x) block_failing |= s.failing[static_cast<size_t>(x)] != 0;
          if (!block_failing) continue;
          bool informative = false;
          if (holds(s, first, b, expected, informative)) continue;
          SlotMatch m{r, b, slot, expected, -1, {}};
          for (int chunk = 0; chunk < 2 * w; ++chunk) {
            if (chunk == expected) continue;
            if (!holds(s, first, b, chunk, informative)) continue;
            if (informative) {
              m.holds = chunk;
              break;
            }
            m.all_pad.push_back(chunk);
          }
          if (m.holds >= 0 || !m.all_pad.empty()) moved.push_back(m);
        }
      }
      if (!moved.empty()) blocks.push_back({i, r, std::move(moved)});
    }
  }
  // Name each rank's pattern from the blocks that match a chunk with values (swapped pair, another rank's chunks, a
  // contiguous split, or a list); blocks that only match all-pad chunks (an LSE row holding a pad chunk's -inf, a zero
  // block) count where they fit the pattern another result of the same rank showed.
  struct Pattern {
    std::string text;
    std::function<int(const SlotMatch&)> source;  // empty: a list, not reusable
  };
  std::map<int, Pattern> patterns;
  std::map<int, int> holds_rank_of;  // rank -> the rank whose rows its place holds (a permutation seen with values)
  bool seen_swap = false, seen_contiguous = false;  // rank-independent rules seen on some rank
  auto fits = [&](const std::vector<SlotMatch>& moved, const std::function<int(const SlotMatch&)>& want) {
    for (const SlotMatch& m : moved) {
      const int c = want(m);
      if (m.holds >= 0 ? m.holds != c : std::find(m.all_pad.begin(), m.all_pad.end(), c) == m.all_pad.end()) return false;
    }
    return true;
  };
  auto accept = [&](const Block& block, const std::string& text) {
    const Subject& s = subjects_[block.subject];
    const Side& sd = side(s.kv);
    texts[text].push_back(s.name);
    if (text[0] == '@') rule_ranks[text].insert(block.rank);
    std::vector<uint8_t>& rows = finding.rows[block.subject];
    if (rows.empty()) rows = flags(s.failing.size());
    for (const SlotMatch& m : block.moved) {
      const int64_t c = sd.part->chunk_size(m.sequence);
      const int64_t first = s.rank >= 0 ? sd.seqs->offset(m.sequence) / w + m.slot * c : sd.seqs->offset(m.sequence) + m.expected * c;
      for (int64_t x = first; x < first + c; ++x) rows[static_cast<size_t>(x)] = 1;
      if (detail.size() < 32) {
        nlohmann::ordered_json d;
        d["result"] = s.name;
        d["rank"] = m.rank;
        d["sequence"] = m.sequence;
        d["expected_chunk"] = m.expected;
        d["holds_chunk"] = m.holds >= 0 ? nlohmann::ordered_json(m.holds) : nlohmann::ordered_json(m.all_pad);
        detail.push_back(d);
      }
    }
  };
  for (const Block& block : blocks) {
    const std::vector<SlotMatch>& moved = block.moved;
    const int r = block.rank;
    bool informative = false;
    for (const SlotMatch& m : moved) informative |= m.holds >= 0;
    if (!informative) continue;
    Pattern p;
    const std::function<int(const SlotMatch&)> swap = [w, r](const SlotMatch& m) { return m.slot == 0 ? 2 * w - 1 - r : r; };
    const std::function<int(const SlotMatch&)> contiguous = [r](const SlotMatch& m) { return m.slot == 0 ? 2 * r : 2 * r + 1; };
    int other = -1;
    for (const SlotMatch& m : moved)
      if (m.holds >= 0) other = m.slot == 0 ? m.holds : 2 * w - 1 - m.holds;
    const std::function<int(const SlotMatch&)> permuted = [w, other](const SlotMatch& m) { return m.slot == 0 ? other : 2 * w - 1 - other; };
    if (fits(moved, swap)) p = {"@swap", swap};
    else if (w > 1 && fits(moved, contiguous)) p = {"@contiguous", contiguous};
    else if (other >= 0 && other < w && other != r && fits(moved, permuted)) {
      p = {"the place of rank " + std::to_string(r) + " holds rank " + std::to_string(other) + "'s rows (chunks " +
               std::to_string(other) + " and " + std::to_string(2 * w - 1 - other) + "): ranks permuted",
           permuted};
      holds_rank_of[r] = other;
    }
    else {
      std::vector<std::string> moves;
      for (const SlotMatch& m : moved)
        if (m.holds >= 0)
          moves.push_back("chunk " + std::to_string(m.holds) + " in the place of chunk " + std::to_string(m.expected) +
                          " (sequence " + std::to_string(m.sequence) + ")");
      p.text = "rank " + std::to_string(r) + ": " + list_text(moves, 4);
    }
    accept(block, p.text);
    if (p.source && !patterns.count(r)) patterns[r] = p;
    seen_swap |= p.text == "@swap";
    seen_contiguous |= p.text == "@contiguous";
  }
  for (const Block& block : blocks) {
    bool informative = false;
    for (const SlotMatch& m : block.moved) informative |= m.holds >= 0;
    if (informative) continue;
    const int r = block.rank;
    const auto found = patterns.find(r);
    if (found != patterns.end() && fits(block.moved, found->second.source)) {
      accept(block, found->second.text);
      continue;
    }
    // Two ranks exchanged: the place of rank a holds rank r's rows, and r's place (whose blocks show no values of their
    // own: padding, zeros) holds a's.
    bool exchanged = false;
    for (const auto& [a, held] : holds_rank_of) {
      if (held != r || exchanged) continue;
      const int from = a;
      if (!fits(block.moved, [w, from](const SlotMatch& m) { return m.slot == 0 ? from : 2 * w - 1 - from; })) continue;
      accept(block, "the place of rank " + std::to_string(r) + " holds rank " + std::to_string(a) + "'s rows (chunks " +
                        std::to_string(a) + " and " + std::to_string(2 * w - 1 - a) + "): ranks permuted");
      exchanged = true;
    }
    if (exchanged) continue;
    // A rule the other ranks follow (a rank whose chunks are all padding shows no values of its own).
    if (seen_contiguous && w > 1 && fits(block.moved, [r](const SlotMatch& m) { return m.slot == 0 ? 2 * r : 2 * r + 1; }))
      accept(block, "@contiguous");
    else if (seen_swap && fits(block.moved, [w, r](const SlotMatch& m) { return m.slot == 0 ? 2 * w - 1 - r : r; }))
      accept(block, "@swap");
  }
  if (finding.rows.empty()) return;
  std::ostringstream e;
  bool first = true;
  const int64_t tpr = q_.part->local_sequence_rows();
  for (const auto& [key, all_names] : texts) {
    std::vector<std::string> names;
    for (const std::string& n : all_names)
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    std::string text = key;
    if (key[0] == '@') {
      // The rule with each rank's numbers (rank 2 of W = 4 holds chunks 2 and 5), not its symbols.
      const std::set<int>& rs = rule_ranks[key];
      auto per_rank = [&](const std::function<std::string(int)>& of) {
        std::vector<std::string> parts;
        for (int r : rs) parts.push_back("rank " + std::to_string(r) + " " + of(r));
        return list_text(parts, 4);
      };
      auto own = [w](int r) { return "chunks " + std::to_string(r) + " and " + std::to_string(2 * w - 1 - r); };
      if (key == "@swap")
        text = per_rank([&](int r) { return own(r) + " swapped"; }) +
               " (each of the two chunks holds the other's rows)";
      if (key == "@contiguous")
        text = per_rank([&](int r) {
                 return "holds chunks " + std::to_string(2 * r) + " and " + std::to_string(2 * r + 1) + " instead of " +
                        own(r);
               }) + " (a contiguous split in sequence order)";
      if (key == "@slice")
        text = per_rank([&](int r) {
                 return "holds rows [" + std::to_string(r * tpr) + ", " + std::to_string((r + 1) * tpr) +
                        ") of the global tensor instead of " + own(r);
               }) + " (a contiguous slice in sequence order)";
    }
    e << (first ? "" : "; ") << text << " in " << names_text(names);
    first = false;
  }
  finding.evidence = e.str();
  finding.where = where_of(finding.rows);
  finding.where["chunks"] = detail;
  add(std::move(finding));
}

}  // namespace cpgold::fx::diagnosis_detail
