#include "sim/program/mistakes.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "reference/attention.hpp"
#include "reference/lse_merge.hpp"
#include "sim/program/cp_program.hpp"
#include "sim/program/host_backend.hpp"
#include "sim/program/rendezvous.hpp"

namespace cpgold::sim {

std::string_view mistake_family_name(MistakeFamily family) {
  switch (family) {
    case MistakeFamily::layout: return "layout";
    case MistakeFamily::counts: return "counts";
    case MistakeFamily::mask: return "mask";
    case MistakeFamily::merge: return "merge";
    case MistakeFamily::rows: return "rows";
    case MistakeFamily::offsets: return "offsets";
    case MistakeFamily::reduction: return "reduction";
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
  else if (name.rfind("chunks_swapped:r", 0) == 0) {
    // One rank's chunks swapped, the others right ("chunks_swapped:r1").
    int only = -1;
    try {
      only = std::stoi(name.substr(16));
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (only < 0 || only >= plan.cp_size || name.substr(16) != std::to_string(only)) return std::nullopt;
    map = [only](int r, int W) { return r == only ? std::pair{2 * W - 1 - r, r} : std::pair{r, 2 * W - 1 - r}; };
  } else return std::nullopt;
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
    PassPlan& pp = out.pass(pass);
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
    PassPlan& pp = out.pass(pass);
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
    PassPlan& pp = out.pass(pass);
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


// ---- mask: one section's tiles computed with another mask --------------------------------------------------------

// diagonal_unmasked: the diagonal tiles without their (causal or window) mask. diagonal_keyless: the diagonal tiles
// with no key visible to any row (their partials are empty: O 0, LSE -inf; their gradients 0).
bool apply_diagonal(Plan& out, bool keyless, std::vector<TileRef>& changed) {
  bool any = false;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    PassPlan& pp = out.pass(pass);
    for (Tile& t : pp.tiles) {
      if (!t.computed || t.section != StepSection::diagonal) continue;
      if (t.call.window.left < 0 && t.call.window.right < 0) continue;  // no mask: nothing to leave out or misread
      bool has_keys = false;
      for (const SequenceTile& seq : t.call.sequences) has_keys |= !seq.kv.empty() && !seq.q.empty();
      if (keyless) {
        if (!has_keys) continue;
        for (SequenceTile& seq : t.call.sequences) seq.kv.clear();
      } else {
        t.call.window = Window{-1, -1};
      }
      changed.push_back({pass, t.rank, t.step});
      any = true;
    }
  }
  return any;
}

// causal_local: the tiles of a section computed with causal=True on the step's own rows: the kernel numbers each
// sequence's rows of the step from 0 (its counts) and aligns the diagonal bottom-right on those counts.
bool apply_causal_local(const Plan& plan, Plan& out, StepSection section, std::vector<TileRef>& changed) {
  if (!plan.causal) return false;
  bool any = false;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    PassPlan& pp = out.pass(pass);
    for (Tile& t : pp.tiles) {
      if (!t.computed || t.section != section) continue;
      AttentionCall call = t.call;
      call.window = Window{-1, 0};
      for (SequenceTile& seq : call.sequences) {
        int32_t nq = 0, nk = 0;
        for (RowSegment& s : seq.q) s.position = nq, nq += s.count;
        for (RowSegment& s : seq.kv) s.position = nk, nk += s.count;
        seq.length_q = nq;
        seq.length_kv = nk;
      }
      t.call = std::move(call);
      changed.push_back({pass, t.rank, t.step});
      any = true;
    }
  }
  return any;
}

// ---- offsets: sequence starts from the unpadded cu_seqlens -----------------------------------------------------

// The rows sequence b of a tile side is shifted by when its start comes from the unpadded cu_seqlens: cu[b] // d -
// cu_padded[b] // d, d the divisor of the side's tensor (W for a rank's shard, 2W for a half, 1 in sequence order).
int64_t offset_shift(const Plan& plan, const Tile& t, bool kv, int b) {
  const StepSpace space = kv ? t.kv_space : t.q_space;
  const HalfSelect half = kv ? t.kv_half : t.q_half;
  const Partition& partition = space == StepSpace::group_local ? plan.group_partition : plan.partition;
  const SidePartition& side = kv ? partition.kv : partition.q;
  const int64_t d = space == StepSpace::sequence_order ? 1 : int64_t{side.cp_size()} * (half == HalfSelect::full ? 1 : 2);
  const PackedSequences& g = side.global();
  return g.cu_seqlens[static_cast<size_t>(b)] / d - g.cu_seqlens_padded[static_cast<size_t>(b)] / d;
}

bool offsets_change(const Plan& plan, bool q_side, bool kv_side, std::vector<TileRef>& changed) {
  bool any = false;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    const PassPlan& pp = plan.pass(pass);
    for (const Tile& t : pp.tiles) {
      if (!t.computed) continue;
      bool moved = false;
      for (size_t b = 0; b < t.call.sequences.size() && !moved; ++b) {
        const SequenceTile& seq = t.call.sequences[b];
        if (seq.q.empty() || seq.kv.empty()) continue;  // nothing computed for this sequence in this tile
        moved = (q_side && offset_shift(plan, t, false, static_cast<int>(b)) != 0) ||
                (kv_side && offset_shift(plan, t, true, static_cast<int>(b)) != 0);
      }
      if (moved) {
        changed.push_back({pass, t.rank, t.step});
        any = true;
      }
    }
  }
  return any;
}

// ---- merge ---------------------------------------------------------------------------------------------------

// True if some row of the tile's Q tensor has no key in the tile (its partial's LSE is -inf there): a query row that
// sees none of the tile's keys, or a row no segment reads (pad and tail rows, which every merge also takes).
bool has_keyless_row(const Tile& t, bool unread_rows) {
  const Window w = t.call.window;
  int64_t read = 0;
  for (const SequenceTile& seq : t.call.sequences)
    for (const RowSegment& q : seq.q) read += q.count;
  if (unread_rows && read < t.call.q_rows) return true;
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
// unread_rows: pad and tail rows count as keyless rows (the replay's catalogue: +inf there turns pad rows of O into
// NaN); without it only query rows with no key of the tile count.
std::vector<TileRef> merge_tiles(const Plan& plan, MergeRule rule, bool unread_rows = false) {
  std::vector<TileRef> out;
  const bool keyless = rule == MergeRule::keyless_step_lse_0 || rule == MergeRule::keyless_step_lse_inf;
  for (const Tile& t : plan.forward.tiles)
    if (t.computed && (keyless ? has_keyless_row(t, unread_rows) : t.step > 0))
      out.push_back({PassKind::forward, t.rank, t.step});
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

// ---- the hooks' backend ----------------------------------------------------------------------------------------

double rounded(DType dtype, double x) { return std::isfinite(x) ? double(round_to(dtype, x)) : x; }

// The CP program's backend for a mistake with hooks (RunHooks): float64 attention per tile as the oracle's
// (reference/attention.hpp), exchanges as host copies, and what the hooks change: the sequence starts each call reads,
// the merge's precision, how the gradients' step partials are combined.
class HookBackend : public HostBackend<HookBackend, double> {
 public:
  HookBackend(int rank, const Plan& plan, const RunHooks& hooks, const RankShards<double>& shards,
              Rendezvous<HostCopy>& rendezvous, bool record_trace,
              std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max())
      : HostBackend(rank, shards, rendezvous, record_trace), plan_(plan), hooks_(hooks), deadline_(deadline) {}

  // dst[rows[i]] += src[i]; right after a backward the program adds that step's dQ (ring), dK and dV partials: the
  // overwritten hooks write them instead.
  void scatter_add(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) {
    const int which = adds_after_backward_ >= 0 ? adds_after_backward_++ : -1;
    const bool ring = plan_.comm != CommType::all_gather;
    // ring: 0 dQ, 1 dK, 2 dV; all_gather: 0 dK, 1 dV (its dQ rows are written, never added)
    const bool is_dq = ring && which == 0, is_dkv = ring ? (which == 1 || which == 2) : (which == 0 || which == 1);
    const bool assign = (is_dq && hooks_.gradients == RunHooks::Gradients::dq_overwritten) ||
                        (is_dkv && hooks_.gradients == RunHooks::Gradients::dkv_overwritten);
    const int64_t s = dst.row_stride();
    for (size_t i = 0; i < rows.size(); ++i) {
      double* d = dst.values.data() + rows[i] * s;
      const double* x = src.values.data() + static_cast<int64_t>(i) * s;
      for (int64_t e = 0; e < s; ++e) d[e] = assign ? x[e] : d[e] + x[e];
    }
    if ((ring && which == 2) || (!ring && which == 1)) adds_after_backward_ = -1;
  }

  Forward forward(const Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) const {
    stop_past(deadline_);
    if (!shifted(t)) return attention_forward(t.call, q, k, v);
    // Each sequence alone (its shifted rows may be another sequence's): O and LSE written at the rows it reads, in
    // sequence order.
    Forward out{Tensor(q.rows, q.heads, v.dim), Lse(q.heads, q.rows, -std::numeric_limits<double>::infinity())};
    for (size_t b = 0; b < t.call.sequences.size(); ++b) {
      const AttentionCall one = sequence_call(t, static_cast<int>(b));
      if (one.sequences.empty()) continue;
      stop_past(deadline_);
      const Forward part = attention_forward(one, q, k, v);
      for (const RowSegment& seg : one.sequences[0].q)
        for (int32_t x = 0; x < seg.count; ++x) {
          const int64_t row = seg.first_row + x;
          std::copy_n(part.o.at(row, 0), part.o.row_stride(), out.o.at(row, 0));
          for (int64_t h = 0; h < q.heads; ++h) out.lse(h, row) = part.lse(h, row);
        }
    }
    return out;
  }
  Backward backward(const Tile& t, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Lse& lse,
                    const Tensor& dout) {
    stop_past(deadline_);
    Backward res{Tensor(q.rows, q.heads, q.dim), Tensor(k.rows, k.heads, k.dim), Tensor(v.rows, v.heads, v.dim)};
    if (!shifted(t)) {
      res = attention_backward(t.call, q, k, v, o, lse, dout);
    } else {
      for (size_t b = 0; b < t.call.sequences.size(); ++b) {
        const AttentionCall one = sequence_call(t, static_cast<int>(b));
        if (one.sequences.empty()) continue;
        stop_past(deadline_);
        const Backward part = attention_backward(one, q, k, v, o, lse, dout);
        for (size_t i = 0; i < res.dq.values.size(); ++i) res.dq.values[i] += part.dq.values[i];
        for (size_t i = 0; i < res.dk.values.size(); ++i) res.dk.values[i] += part.dk.values[i];
        for (size_t i = 0; i < res.dv.values.size(); ++i) res.dv.values[i] += part.dv.values[i];
      }
    }
    using G = RunHooks::Gradients;
    if (hooks_.gradients == G::dkv_own_only) {
      if (t.kv_owner >= 0 && t.kv_owner != rank_) {
        std::fill(res.dk.values.begin(), res.dk.values.end(), 0.0);
        std::fill(res.dv.values.begin(), res.dv.values.end(), 0.0);
      } else if (t.kv_owner < 0 && plan_.comm == CommType::all_gather) {
        // K/V in sequence order: only the rows of the rank's own shard keep their partial.
        const std::vector<int64_t> map = plan_.partition.kv.rank_order_to_sequence_order();
        const int64_t rk = plan_.partition.kv.local_sequence_rows();
        std::vector<uint8_t> own(static_cast<size_t>(res.dk.rows), 0);
        for (int64_t x = rank_ * rk; x < (rank_ + 1) * rk; ++x) own[static_cast<size_t>(map[static_cast<size_t>(x)])] = 1;
        for (int64_t row = 0; row < res.dk.rows; ++row)
          if (!own[static_cast<size_t>(row)]) {
            std::fill_n(res.dk.at(row, 0), res.dk.row_stride(), 0.0);
            std::fill_n(res.dv.at(row, 0), res.dv.row_stride(), 0.0);
          }
      }
    }
    if (hooks_.gradients == G::dkv_kept_local && t.kv_owner >= 0 && t.kv_owner != rank_) {
      // Added to the rank's own dK/dV at the same local rows (finalize adds them), never to the travelling ones.
      const SidePartition& ks = plan_.group_partition.kv;
      const std::vector<int64_t> rows = program_detail::half_rows(ks, t.kv_half, res.dk.rows);
      if (kept_dk_.values.empty()) {
        kept_dk_ = Tensor(ks.local_rows(), res.dk.heads, res.dk.dim);
        kept_dv_ = Tensor(ks.local_rows(), res.dv.heads, res.dv.dim);
      }
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t e = 0; e < res.dk.row_stride(); ++e) kept_dk_.at(rows[i], 0)[e] += res.dk.at(static_cast<int64_t>(i), 0)[e];
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t e = 0; e < res.dv.row_stride(); ++e) kept_dv_.at(rows[i], 0)[e] += res.dv.at(static_cast<int64_t>(i), 0)[e];
      std::fill(res.dk.values.begin(), res.dk.values.end(), 0.0);
      std::fill(res.dv.values.begin(), res.dv.values.end(), 0.0);
    }
    adds_after_backward_ = 0;
    return res;
  }

  void merge_forward(const std::vector<MergePart<HookBackend>>& parts, Tensor& o, Lse& lse) const {
    const double inf = std::numeric_limits<double>::infinity();
    if (!hooks_.lse_in_dtype && !hooks_.o_in_dtype) {
      // The oracle's merge: LSE first, then O = sum O_i exp(lse_i - lse).
      for (const auto& part : parts)
        for (int64_t h = 0; h < lse.heads; ++h)
          for (size_t i = 0; i < part.rows.size(); ++i)
            lse(h, part.rows[i]) = lse_merge(lse(h, part.rows[i]), (*part.lse)(h, static_cast<int64_t>(i)));
      for (const auto& part : parts)
        for (size_t i = 0; i < part.rows.size(); ++i)
          for (int64_t h = 0; h < o.heads; ++h) {
            const double w = lse_weight((*part.lse)(h, static_cast<int64_t>(i)), lse(h, part.rows[i]));
            if (w == 0) continue;
            const double* src = part.o->at(static_cast<int64_t>(i), h);
            double* dst = o.at(part.rows[i], h);
            for (int64_t x = 0; x < o.dim; ++x)
              if (src[x] != 0) dst[x] += src[x] * w;
          }
      return;
    }
    // The online merge in step order with the LSE, or the running O, kept in the dtype.
    for (const auto& part : parts)
      for (size_t i = 0; i < part.rows.size(); ++i)
        for (int64_t h = 0; h < o.heads; ++h) {
          double li = (*part.lse)(h, static_cast<int64_t>(i));
          if (hooks_.lse_in_dtype) li = rounded(hooks_.dtype, li);
          double& l = lse(h, part.rows[i]);
          double merged = lse_merge(l, li);
          if (hooks_.lse_in_dtype) merged = rounded(hooks_.dtype, merged);
          const double a = l == -inf ? 0.0 : std::exp(l - merged);
          const double b = li == -inf ? 0.0 : std::exp(li - merged);
          const double* src = part.o->at(static_cast<int64_t>(i), h);
          double* dst = o.at(part.rows[i], h);
          for (int64_t x = 0; x < o.dim; ++x) {
            const double y = (a == 0 ? 0.0 : dst[x] * a) + (b == 0 ? 0.0 : src[x] * b);
            dst[x] = hooks_.o_in_dtype ? rounded(hooks_.dtype, y) : y;
          }
          l = merged;
        }
  }
  // The program finalizes dQ, dK and dV in that order at the end of the backward: the kept-local hook adds what the
  // rank kept to its own dK and dV there.
  void finalize(Tensor& x) {
    ++finalized_;
    if (hooks_.gradients == RunHooks::Gradients::dkv_kept_local && plan_.comm != CommType::all_gather &&
        (finalized_ == 2 || finalized_ == 3)) {
      const Tensor& kept = finalized_ == 2 ? kept_dk_ : kept_dv_;
      if (!kept.values.empty() && kept.values.size() == x.values.size())
        for (size_t i = 0; i < x.values.size(); ++i) x.values[i] += kept.values[i];
    }
  }

 private:
  bool shifted(const Tile& t) const { return hooks_.q_offsets_unpadded || hooks_.kv_offsets_unpadded; }
  // The tile's call for sequence b alone, its segments moved to the rows an unpadded start gives; empty when the
  // sequence has no rows on a side.
  AttentionCall sequence_call(const Tile& t, int b) const {
    AttentionCall one = t.call;
    one.sequences.clear();
    SequenceTile seq = t.call.sequences[static_cast<size_t>(b)];
    if (seq.q.empty() || seq.kv.empty()) return one;
    const int64_t dq = hooks_.q_offsets_unpadded ? offset_shift(plan_, t, false, b) : 0;
    const int64_t dk = hooks_.kv_offsets_unpadded ? offset_shift(plan_, t, true, b) : 0;
    for (RowSegment& s : seq.q) s.first_row += dq;
    for (RowSegment& s : seq.kv) s.first_row += dk;
    one.sequences.push_back(std::move(seq));
    return one;
  }

  const Plan& plan_;
  const RunHooks& hooks_;
  std::chrono::steady_clock::time_point deadline_;
  int adds_after_backward_ = -1;
  int finalized_ = 0;
  Tensor kept_dk_, kept_dv_;
};

CpRun<double> run_with_hooks(const Mistake& m, const CaseInputs& inputs, const ExecutorOptions& options) {
  const Plan& plan = m.plan;
  const int W = plan.cp_size;
  RankShards<double> shards;
  for (int r = 0; r < W; ++r) {
    const std::vector<int64_t> rq = plan.partition.q.gather_indices(r), rk = plan.partition.kv.gather_indices(r);
    const std::vector<int64_t>& rows_dout = m.hooks.dout_rows.empty() ? rq : m.hooks.dout_rows[static_cast<size_t>(r)];
    shards.q.push_back(gather_rows_as<double>(inputs.q, rq));
    shards.k.push_back(gather_rows_as<double>(inputs.k, rk));
    shards.v.push_back(gather_rows_as<double>(inputs.v, rk));
    shards.dout.push_back(gather_rows_as<double>(inputs.dout, rows_dout));
  }
  Rendezvous<HostCopy> rendezvous(W, std::chrono::minutes(10));
  std::vector<std::unique_ptr<HookBackend>> backends;
  for (int g = 0; g < W; ++g)
    backends.push_back(
        std::make_unique<HookBackend>(g, plan, m.hooks, shards, rendezvous, options.record_trace, options.deadline));
  return run_backends<double>(plan, backends, rendezvous, options.backward, options.record_trace);
}

}  // namespace

namespace {

// The mistakes that are a Plan and a RunVariation.
std::optional<Mistake> make_plan_mistake(const Plan& plan, const std::string& name, bool unread_rows = false) {
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
  if (name == "diagonal_unmasked" || name == "diagonal_keyless") {
    const bool keyless = name == "diagonal_keyless";
    m.family = MistakeFamily::mask;
    m.description = keyless ? "the diagonal tiles' rows see no key (a causal window (-1, 0) read as the empty band [i + 1, i], "
                              "FlashAttention-4's reading under TransformerEngine: docs/findings/fa-3-causal-window-minus-one.md)"
                            : "the diagonal tiles (each rank's own chunks) computed without their mask";
    if (!apply_diagonal(m.plan, keyless, m.changed_tiles)) return std::nullopt;
    return m;
  }
  if (name == "causal_local:lower" || name == "causal_local:upper") {
    const StepSection section = name == "causal_local:lower" ? StepSection::lower : StepSection::upper;
    m.family = MistakeFamily::mask;
    m.description = "the " + std::string(section_name(section)) +
                    " tiles computed with the kernel's causal mask on the step's own rows (causal=True on an "
                    "off-diagonal block, aligned bottom-right on its counts)";
    if (!apply_causal_local(plan, m.plan, section, m.changed_tiles)) return std::nullopt;
    return m;
  }
  if (auto rule = merge_rule_named(name)) {
    if (plan.forward.steps < 2) return std::nullopt;  // nothing is merged
    m.family = MistakeFamily::merge;
    m.variation.merge = *rule;
    m.changed_tiles = merge_tiles(plan, *rule, unread_rows);
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

// The mistakes run_mistake's backend runs (RunHooks).
std::optional<Mistake> make_hook_mistake(const Plan& plan, const std::string& name, DType dtype) {
  Mistake m;
  m.name = name;
  m.plan = plan;
  if (name == "output_chunks_swapped" || name.rfind("output_chunks_swapped:r", 0) == 0) {
    std::optional<RunVariation> v = layout_variation(plan, name.substr(7));
    if (!v) return std::nullopt;
    m.family = MistakeFamily::layout;
    m.output_q_rows = v->q_rows;
    m.hooks.dout_rows = v->q_rows;
    const std::string layout = name.substr(7);
    const bool one = layout.rfind("chunks_swapped:r", 0) == 0;
    m.description = std::string(one ? "rank " + layout.substr(16) : "each rank") +
                    " computes on the right rows but returns O and LSE with its chunks r and 2W-1-r swapped (its dO "
                    "arrives in that order; dQ, dK, dV in the right rows)";
    return m;
  }
  using G = RunHooks::Gradients;
  if (name == "q_offsets_unpadded" || name == "kv_offsets_unpadded") {
    const bool q = name == "q_offsets_unpadded";
    m.family = MistakeFamily::offsets;
    m.hooks.q_offsets_unpadded = q;
    m.hooks.kv_offsets_unpadded = !q;
    m.description = std::string("each step reads ") + (q ? "Q (and writes O, dQ)" : "K and V (and writes dK, dV)") +
                    " of sequence b from the start the unpadded cu_seqlens give (cu[b] // W in a rank's shard, // 2W in a "
                    "half) instead of the padded one: rows shifted by cu[b] // W - cu_padded[b] // W";
    if (!offsets_change(plan, q, !q, m.changed_tiles)) return std::nullopt;
    return m;
  }
  if (name == "merge_lse_in_dtype" || name == "merge_o_in_dtype") {
    if (dtype == DType::fp32 || plan.comm == CommType::all_gather || plan.forward.steps < 2) return std::nullopt;
    const bool lse = name == "merge_lse_in_dtype";
    m.family = MistakeFamily::merge;
    m.hooks.lse_in_dtype = lse;
    m.hooks.o_in_dtype = !lse;
    m.hooks.dtype = dtype;
    m.description = std::string("the online merge of the step partials keeps ") +
                    (lse ? "the LSE (each step's and the running one)" : "the running O") + " in " +
                    std::string(dtype_name(dtype)) + " instead of float32";
    m.changed_tiles = merge_tiles(plan, MergeRule::running_o_not_rescaled);
    if (m.changed_tiles.empty()) return std::nullopt;
    return m;
  }
  const bool ring = plan.comm == CommType::p2p || plan.comm == CommType::a2a_p2p;
  std::optional<G> g;
  if (name == "dq_overwritten") g = G::dq_overwritten;
  else if (name == "dkv_own_only") g = G::dkv_own_only;
  else if (name == "dkv_kept_local") g = G::dkv_kept_local;
  if (!g) return std::nullopt;
  if (plan.cp_size < 2 || plan.comm == CommType::a2a) return std::nullopt;  // nothing is reduced across ranks
  if ((*g == G::dq_overwritten || *g == G::dkv_kept_local) && !ring) return std::nullopt;
  if (*g == G::dkv_kept_local && plan.comm != CommType::p2p) return std::nullopt;
  if (ring && plan.p2p_size < 2) return std::nullopt;
  m.family = MistakeFamily::reduction;
  m.hooks.gradients = *g;
  switch (*g) {
    case G::dq_overwritten:
      m.description = "each step's dQ partial is written over the rank's dQ rows instead of added (the backward ring's "
                      "last step, the rank's own K/V, is what remains)";
      break;
    case G::dkv_overwritten: break;
    case G::dkv_own_only:
      m.description = "dK/dV of each rank hold only the partials it computed on its own K/V: the other ranks' "
                      "contributions are never reduced into them";
      break;
    case G::dkv_kept_local:
      m.description = "every dK/dV partial a rank computes, whichever rank's K/V it read, is added to its own dK/dV at "
                      "the same local rows: the ring never carries dK/dV home";
      break;
    case G::summed: break;
  }
  for (const Tile& t : plan.backward.tiles)
    if (t.computed && (t.step > 0 || *g == G::dkv_own_only)) m.changed_tiles.push_back({PassKind::backward, t.rank, t.step});
  if (m.changed_tiles.empty()) return std::nullopt;
  return m;
}

}  // namespace

std::optional<Mistake> make_mistake(const Plan& plan, const std::string& name) { return make_plan_mistake(plan, name); }

std::optional<Mistake> make_mistake(const Plan& plan, const std::string& name, DType dtype) {
  if (auto m = make_plan_mistake(plan, name, true)) return m;
  return make_hook_mistake(plan, name, dtype);
}

CpRun<double> run_mistake(const Mistake& mistake, const CaseInputs& inputs, ExecutorOptions options) {
  if (!mistake.hooks.any()) {
    options.variation = &mistake.variation;
    return run_cp_oracle(mistake.plan, inputs, options);
  }
  return run_with_hooks(mistake, inputs, options);
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
  candidates.push_back("diagonal_unmasked");
  candidates.push_back("causal_local:lower");
  candidates.push_back("causal_local:upper");
  candidates.push_back("diagonal_keyless");
  for (const char* merge : {"running_o_not_rescaled", "step_o_not_rescaled", "double_rescale", "keyless_step_lse_0",
                            "keyless_step_lse_inf"})
    candidates.push_back(merge);
  return candidates;
}

std::vector<std::string> mistake_catalogue(const Plan& plan, DType dtype) {
  std::vector<std::string> candidates = mistake_catalogue(plan);
  (void)dtype;  // the names are the same for every dtype; make_mistake leaves out what changes nothing
  candidates.push_back("output_chunks_swapped");
  // One rank's output chunks swapped (a reorder on one rank's code path).
  if (plan.cp_size > 1)
    for (int r = 0; r < plan.cp_size; ++r) candidates.push_back("output_chunks_swapped:r" + std::to_string(r));
  for (const char* name : {"q_offsets_unpadded", "kv_offsets_unpadded", "merge_lse_in_dtype", "dq_overwritten",
                           "dkv_own_only", "dkv_kept_local"})
    candidates.push_back(name);
  return candidates;
}

std::vector<std::string> mistake_names(const Plan& plan) {
  std::vector<std::string> out;
  for (const std::string& name : mistake_catalogue(plan))
    if (make_mistake(plan, name)) out.push_back(name);
  return out;
}

std::vector<std::string> mistake_names(const Plan& plan, DType dtype) {
  std::vector<std::string> out;
  for (const std::string& name : mistake_catalogue(plan, dtype))
    if (make_mistake(plan, name, dtype)) out.push_back(name);
  return out;
}

}  // namespace cpgold::sim
