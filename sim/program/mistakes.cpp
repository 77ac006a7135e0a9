#include "sim/program/mistakes.hpp"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <map>
#include <utility>

namespace cpgold::sim {

std::string_view mistake_family_name(MistakeFamily family) {
  switch (family) {
    case MistakeFamily::layout: return "layout";
    case MistakeFamily::counts: return "counts";
    case MistakeFamily::mask: return "mask";
    case MistakeFamily::merge: return "merge";
    case MistakeFamily::rows: return "rows";
  }
  return "?";
}

namespace {

// ---- layout: which chunks a rank holds -------------------------------------------------------------------------

// The chunks rank r holds in its two slots (the correct layout holds r, 2W-1-r).
using ChunkMap = std::function<std::pair<int, int>(int r, int W)>;

// [W][local row] -> global row when rank r holds chunks map(r) in its slots: the partition's rows with each sequence
// row moved to the same offset in the mapped chunk (tail rows as they are).
std::vector<std::vector<int64_t>> rows_held(const SidePartition& side, const ChunkMap& map) {
  const int W = side.cp_size();
  const PackedSequences& g = side.global();
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < W; ++r) {
    std::vector<int64_t> rows = side.gather_indices(r);
    const auto [first, second] = map(r, W);
    for (int64_t x = 0; x < side.local_sequence_rows(); ++x) {
      const int b = side.sequence_of_local_row(x);
      if (b < 0) continue;
      const int64_t c = side.chunk_size(b);
      const int64_t at = rows[static_cast<size_t>(x)] - g.cu_seqlens_padded[b];  // padded position
      const int chunk = static_cast<int>(at / c);
      const int slot = chunk == r ? 0 : 1;
      rows[static_cast<size_t>(x)] = g.cu_seqlens_padded[b] + (slot == 0 ? first : second) * c + at % c;
    }
    out.push_back(std::move(rows));
  }
  return out;
}

std::optional<RunVariation> layout_variation(const Plan& plan, const std::string& name) {
  ChunkMap map;
  if (name == "contiguous_chunks") map = [](int r, int) { return std::pair{2 * r, 2 * r + 1}; };
  else if (name == "chunks_swapped") map = [](int r, int W) { return std::pair{2 * W - 1 - r, r}; };
  else if (name == "ranks_reversed") map = [](int r, int W) { return std::pair{W - 1 - r, W + r}; };
  else return std::nullopt;
  RunVariation v;
  v.q_rows = rows_held(plan.partition.q, map);
  v.kv_rows = rows_held(plan.partition.kv, map);
  bool differs = false;
  for (int r = 0; r < plan.cp_size && !differs; ++r)
    differs = v.q_rows[static_cast<size_t>(r)] != plan.partition.q.gather_indices(r);
  if (!differs) return std::nullopt;  // W = 1, or a map that is the correct one for this W
  return v;
}

// ---- counts: the cu // W shortcut ------------------------------------------------------------------------------

// The segments of one side of sequence b when a kernel reads `n` rows of the sequence's block as tokens: the block
// holds the chunks `chunks` (one or two) of C rows each from row `base`; rows past a chunk's valid rows are its pad
// rows, read as tokens at the positions that follow.
std::vector<RowSegment> shortcut_segments(int64_t base, int32_t c, const int* chunks, int nchunks, int32_t n) {
  std::vector<RowSegment> out;
  for (int k = 0; k < nchunks && n > 0; ++k) {
    const int32_t take = std::min(n, c);
    out.push_back({base + k * c, take, chunks[k] * c});
    n -= take;
  }
  return out;
}

// The side's block start and chunks of a tile side, or false where the side is not a ring shard (sequence order).
bool ring_block(const SidePartition& side, StepSpace space, HalfSelect half, const int* chunk_ids, int b,
                int64_t& base, int& nchunks) {
  if (space == StepSpace::sequence_order) return false;
  const int W = side.cp_size();
  if (half == HalfSelect::full) {
    base = side.global().cu_seqlens_padded[b] / W;
    nchunks = 2;
  } else {
    base = side.global().cu_seqlens_padded[b] / (2 * W);
    nchunks = 1;
  }
  return chunk_ids[0] >= 0;
}

// per_chunk false: one count per rank and sequence, n = cu[b+1] // W - cu[b] // W, a half reading its part of the
// first n rows of the block (counts_cu_div_w); true: TransformerEngine's shortcut, cu // W for a step that reads the
// whole shard and cu // (2W) for one that reads a half (counts_cu_div_2w).
bool apply_count_shortcut(const Plan& plan, Plan& out, bool per_chunk, std::vector<TileRef>& changed) {
  // cu // W (whole) and cu // 2W of each side partition, computed once.
  std::map<std::pair<const SidePartition*, bool>, std::vector<int32_t>> shortcuts;
  auto shortcut = [&](const SidePartition& side, bool whole) -> const std::vector<int32_t>& {
    auto [it, fresh] = shortcuts.try_emplace({&side, whole});
    if (fresh) it->second = side.cu_seqlens_shortcut(true, whole);
    return it->second;
  };
  bool any = false;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    PassPlan& pp = pass == PassKind::forward ? out.forward : out.backward;
    for (Tile& t : pp.tiles) {
      if (!t.computed) continue;
      const bool group = t.q_space == StepSpace::group_local;
      const SidePartition& qs = group ? plan.group_partition.q : plan.partition.q;
      const SidePartition& ks = group ? plan.group_partition.kv : plan.partition.kv;
      // The rows of sequence b a side reads under the mistake.
      auto count = [&](const SidePartition& side, HalfSelect half, int b) {
        const bool whole = half == HalfSelect::full || !per_chunk;
        const std::vector<int32_t>& cu = shortcut(side, whole);
        const int32_t n = cu[static_cast<size_t>(b) + 1] - cu[static_cast<size_t>(b)];
        if (half == HalfSelect::full || per_chunk) return n;
        const int32_t c = side.chunk_size(b);
        return half == HalfSelect::first ? std::min(n, c) : std::max(0, n - c);
      };
      bool tile_changed = false;
      for (size_t b = 0; b < t.call.sequences.size(); ++b) {
        SequenceTile& seq = t.call.sequences[b];
        const int bi = static_cast<int>(b);
        int64_t base = 0;
        int nchunks = 0;
        std::vector<RowSegment> q = seq.q, kv = seq.kv;
        if (ring_block(qs, t.q_space, t.q_half, t.q_chunks, bi, base, nchunks))
          q = shortcut_segments(base, qs.chunk_size(bi), t.q_chunks, nchunks, count(qs, t.q_half, bi));
        if (ring_block(ks, t.kv_space, t.kv_half, t.kv_chunks, bi, base, nchunks))
          kv = shortcut_segments(base, ks.chunk_size(bi), t.kv_chunks, nchunks, count(ks, t.kv_half, bi));
        if (q == seq.q && kv == seq.kv) continue;
        // Rows read past the sequence's end are tokens at the positions that follow: the lengths grow to cover them
        // (both sides alike where a mask aligns them, so the diagonal stays where it was).
        int32_t end_q = seq.length_q, end_kv = seq.length_kv;
        for (const RowSegment& s : q) end_q = std::max(end_q, s.position + s.count);
        for (const RowSegment& s : kv) end_kv = std::max(end_kv, s.position + s.count);
        if (t.call.window.left >= 0 || t.call.window.right >= 0) {
          const int32_t grow = std::max(end_q - seq.length_q, end_kv - seq.length_kv);
          end_q = seq.length_q + grow;
          end_kv = seq.length_kv + grow;
        }
        seq.q = std::move(q);
        seq.kv = std::move(kv);
        seq.length_q = end_q;
        seq.length_kv = end_kv;
        tile_changed = true;
      }
      if (tile_changed) {
        changed.push_back({pass, t.rank, t.step});
        any = true;
      }
    }
  }
  return any;
}

// ---- rows: the last valid query row of each sequence on each rank left out ----------------------------------------

bool apply_last_row_dropped(const Plan& plan, Plan& out, std::vector<TileRef>& changed) {
  bool any = false;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    PassPlan& pp = pass == PassKind::forward ? out.forward : out.backward;
    for (Tile& t : pp.tiles) {
      if (!t.computed || t.q_space == StepSpace::sequence_order || t.q_chunks[0] < 0) continue;
      const SidePartition& qs = t.q_space == StepSpace::group_local ? plan.group_partition.q : plan.partition.q;
      const int P = qs.cp_size();
      bool tile_changed = false;
      for (size_t b = 0; b < t.call.sequences.size(); ++b) {
        const int bi = static_cast<int>(b);
        const int32_t c = qs.chunk_size(bi), length = qs.global().length(bi);
        // The rank's two chunks (a half step names one of them) and its last valid position over both.
        const int chunks[2] = {t.q_chunks[0], 2 * P - 1 - t.q_chunks[0]};
        int32_t last = -1;
        for (int chunk : chunks)
          if (static_cast<int64_t>(chunk) * c < length) last = std::max(last, std::min((chunk + 1) * c, length) - 1);
        if (last < 0) continue;
        std::vector<RowSegment>& q = t.call.sequences[b].q;
        for (size_t i = 0; i < q.size(); ++i)
          if (q[i].position + q[i].count - 1 == last) {
            if (--q[i].count == 0) q.erase(q.begin() + static_cast<std::ptrdiff_t>(i));
            tile_changed = true;
            break;
          }
      }
      if (tile_changed) {
        changed.push_back({pass, t.rank, t.step});
        any = true;
      }
    }
  }
  return any;
}

// ---- mask: an edge one key off in some tiles -------------------------------------------------------------------

struct EdgeEdit {
  bool right = true;
  int offset = 1;
};

std::optional<StepSection> section_named(const std::string& name) {
  for (StepSection s : {StepSection::diagonal, StepSection::lower, StepSection::upper, StepSection::all})
    if (name == section_name(s)) return s;
  return std::nullopt;
}

bool apply_edge(Plan& out, EdgeEdit edit, std::optional<StepSection> section, std::vector<TileRef>& changed) {
  bool any = false;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    PassPlan& pp = pass == PassKind::forward ? out.forward : out.backward;
    for (Tile& t : pp.tiles) {
      if (!t.computed || (section && t.section != *section)) continue;
      int32_t& side = edit.right ? t.call.window.right : t.call.window.left;
      if (side < 0) continue;  // an unbounded side has no edge to move
      if (side + edit.offset >= 0) {
        side += edit.offset;
      } else if (edit.right && t.call.window.left < 0) {
        // The causal edge one key short (j <= i - 1): every key one position later, both lengths one longer so the
        // alignment stays.
        for (SequenceTile& seq : t.call.sequences) {
          for (RowSegment& s : seq.kv) ++s.position;
          ++seq.length_q;
          ++seq.length_kv;
        }
      } else {
        continue;
      }
      changed.push_back({pass, t.rank, t.step});
      any = true;
    }
  }
  return any;
}

const char* const kEdges[] = {"right_edge+1", "right_edge-1", "left_edge+1", "left_edge-1"};

bool parse_edge(const std::string& name, EdgeEdit& edit, std::optional<StepSection>& section, bool& known) {
  known = false;
  const size_t colon = name.find(':');
  if (colon == std::string::npos) return false;
  const std::string edge = name.substr(0, colon), scope = name.substr(colon + 1);
  if (edge == "right_edge+1") edit = {true, 1};
  else if (edge == "right_edge-1") edit = {true, -1};
  else if (edge == "left_edge+1") edit = {false, 1};
  else if (edge == "left_edge-1") edit = {false, -1};
  else return false;
  if (scope == "every") section.reset();
  else if (auto s = section_named(scope)) section = s;
  else return false;
  known = true;
  return true;
}

// ---- merge ---------------------------------------------------------------------------------------------------

// True if some query row of the tile sees none of the tile's keys (its partial's LSE is -inf there).
bool has_keyless_row(const Tile& t) {
  const Window w = t.call.window;
  for (const SequenceTile& seq : t.call.sequences)
    for (const RowSegment& q : seq.q)
      for (int32_t i = 0; i < q.count; ++i) {
        const int64_t diag = static_cast<int64_t>(q.position) + i + seq.delta();
        bool any = false;
        for (const RowSegment& k : seq.kv) {
          int64_t lo = k.position, hi = static_cast<int64_t>(k.position) + k.count - 1;
          if (w.left >= 0) lo = std::max(lo, diag - w.left);
          if (w.right >= 0) hi = std::min(hi, diag + w.right);
          if (lo <= hi) {
            any = true;
            break;
          }
        }
        if (!any) return true;
      }
  return false;
}

// The forward tiles whose partial a merge rule treats otherwise: those with a keyless row (keyless rules), every
// tile merged into a running result (the rescale rules: steps after the first).
std::vector<TileRef> merge_tiles(const Plan& plan, MergeRule rule) {
  std::vector<TileRef> out;
  const bool keyless = rule == MergeRule::keyless_step_lse_0 || rule == MergeRule::keyless_step_lse_inf;
  for (const Tile& t : plan.forward.tiles)
    if (t.computed && (keyless ? has_keyless_row(t) : t.step > 0)) out.push_back({PassKind::forward, t.rank, t.step});
  return out;
}

std::optional<MergeRule> merge_rule_named(const std::string& name) {
  if (name == "running_o_not_rescaled") return MergeRule::running_o_not_rescaled;
  if (name == "step_o_not_rescaled") return MergeRule::step_o_not_rescaled;
  if (name == "double_rescale") return MergeRule::double_rescale;
  if (name == "keyless_step_lse_0") return MergeRule::keyless_step_lse_0;
  if (name == "keyless_step_lse_inf") return MergeRule::keyless_step_lse_inf;
  return std::nullopt;
}

}  // namespace

std::optional<Mistake> make_mistake(const Plan& plan, const std::string& name) {
  Mistake m;
  m.name = name;
  m.plan = plan;
  if (auto v = layout_variation(plan, name)) {
    m.family = MistakeFamily::layout;
    m.variation = std::move(*v);
    m.description = name == "contiguous_chunks"
                        ? "each rank holds chunks 2r and 2r+1 of every sequence while its steps assume chunks r and 2W-1-r"
                    : name == "chunks_swapped" ? "each rank holds its chunk 2W-1-r where chunk r belongs and the other way round"
                                               : "rank r holds the chunks of rank W-1-r";
    return m;
  }
  if (name == "counts_cu_div_w" || name == "counts_cu_div_2w") {
    const bool per_chunk = name == "counts_cu_div_2w";
    m.family = MistakeFamily::counts;
    m.description = per_chunk ? "per-step counts of TransformerEngine's pad_between_seqs=False shortcut, cu_seqlens // W "
                                "for a whole shard and // 2W for one chunk: pad rows read as tokens, valid rows past "
                                "the count dropped"
                              : "one count per rank and sequence, cu_seqlens[b+1] // W - cu_seqlens[b] // W, the first "
                                "rows of the rank's block taken as its tokens: pad rows read as tokens, valid rows "
                                "past the count dropped";
    if (!apply_count_shortcut(plan, m.plan, per_chunk, m.changed_tiles)) return std::nullopt;
    return m;
  }
  if (name == "last_row_dropped") {
    m.family = MistakeFamily::rows;
    m.description = "every call leaves out the last valid query row of each sequence on each rank (a count one short)";
    if (!apply_last_row_dropped(plan, m.plan, m.changed_tiles)) return std::nullopt;
    return m;
  }
  EdgeEdit edit;
  std::optional<StepSection> section;
  bool known = false;
  if (parse_edge(name, edit, section, known)) {
    m.family = MistakeFamily::mask;
    m.description = std::string("the ") + (edit.right ? "right" : "left") + " mask edge one key " +
                    ((edit.offset > 0) == edit.right ? "too far" : "too short") + " in " +
                    (section ? "the " + std::string(section_name(*section)) + " tiles" : std::string("every tile"));
    if (!apply_edge(m.plan, edit, section, m.changed_tiles)) return std::nullopt;
    return m;
  }
  if (auto rule = merge_rule_named(name)) {
    if (plan.forward.steps < 2) return std::nullopt;  // nothing is merged
    m.family = MistakeFamily::merge;
    m.variation.merge = *rule;
    m.changed_tiles = merge_tiles(plan, *rule);
    if (m.changed_tiles.empty()) return std::nullopt;  // no step's partial is merged otherwise
    switch (*rule) {
      case MergeRule::running_o_not_rescaled: m.description = "the online merge leaves the running output unrescaled"; break;
      case MergeRule::step_o_not_rescaled: m.description = "the online merge adds each step's output unrescaled"; break;
      case MergeRule::double_rescale: m.description = "the online merge rescales the running output twice"; break;
      case MergeRule::keyless_step_lse_0:
        m.description = "a step that holds none of a row's keys is merged with LSE 0 (exp(0) added to the sum)";
        break;
      case MergeRule::keyless_step_lse_inf:
        m.description = "a step that holds none of a row's keys is merged with LSE +inf";
        break;
      case MergeRule::lse_weighted: break;
    }
    return m;
  }
  return std::nullopt;
}

std::vector<std::string> mistake_catalogue(const Plan& plan) {
  std::vector<std::string> candidates = {"contiguous_chunks", "chunks_swapped", "ranks_reversed", "counts_cu_div_w",
                                         "counts_cu_div_2w", "last_row_dropped"};
  // Mask edges: every tile, and per section where the plan has more than one.
  std::vector<std::string> scopes = {"every"};
  bool seen[4] = {false, false, false, false};
  int sections = 0;
  for (const Tile& t : plan.forward.tiles)
    if (t.computed && !seen[static_cast<int>(t.section)]) seen[static_cast<int>(t.section)] = true, ++sections;
  if (sections > 1)
    for (int s = 0; s < 4; ++s)
      if (seen[s]) scopes.push_back(std::string(section_name(static_cast<StepSection>(s))));
  for (const char* edge : kEdges)
    for (const std::string& scope : scopes) candidates.push_back(std::string(edge) + ":" + scope);
  for (const char* merge : {"running_o_not_rescaled", "step_o_not_rescaled", "double_rescale", "keyless_step_lse_0",
                            "keyless_step_lse_inf"})
    candidates.push_back(merge);
  return candidates;
}

std::vector<std::string> mistake_names(const Plan& plan) {
  std::vector<std::string> out;
  for (const std::string& name : mistake_catalogue(plan))
    if (make_mistake(plan, name)) out.push_back(name);
  return out;
}

}  // namespace cpgold::sim
