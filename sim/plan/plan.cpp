#include "sim/plan/plan.hpp"

#include <algorithm>
#include <limits>

#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"

namespace cpgold::sim {

constexpr std::pair<StepSection, std::string_view> kSectionNames[] = {
    {StepSection::diagonal, "diagonal"}, {StepSection::lower, "lower"}, {StepSection::upper, "upper"},
    {StepSection::all, "all"}};
constexpr std::pair<StepSpace, std::string_view> kSpaceNames[] = {
    {StepSpace::rank_local, "rank_local"}, {StepSpace::group_local, "group_local"},
    {StepSpace::sequence_order, "sequence_order"}};
constexpr std::pair<Payload, std::string_view> kPayloadNames[] = {
    {Payload::q, "q"},   {Payload::k, "k"},     {Payload::v, "v"},   {Payload::dout, "dout"},
    {Payload::o, "o"},   {Payload::lse, "lse"}, {Payload::kv, "kv"}, {Payload::dkv, "dkv"},
    {Payload::dq, "dq"}, {Payload::dk, "dk"},   {Payload::dv, "dv"}};

std::string_view section_name(StepSection section) { return name_in(kSectionNames, section); }

std::string_view pass_name(PassKind pass) { return pass == PassKind::forward ? "forward" : "backward"; }

std::string_view space_name(StepSpace space) { return name_in(kSpaceNames, space); }

std::string_view payload_name(Payload payload) { return name_in(kPayloadNames, payload); }

int32_t te_max_seqlen(const PackedSequences& global) {
  int32_t m = 0;
  for (int b = 0; b < global.batch(); ++b) m = std::max(m, global.padded_length(b));
  return (m + 63) / 64 * 64;
}

namespace {

int32_t max_count(const std::vector<int32_t>& cu) {
  int32_t m = 0;
  for (size_t b = 1; b < cu.size(); ++b) m = std::max(m, cu[b] - cu[b - 1]);
  return m;
}

// Position interval [begin, end) of the valid rows of chunk `chunk` of sequence b.
struct Span {
  int64_t begin = 0, end = 0;
  bool empty() const { return end <= begin; }
};
Span chunk_span(const SidePartition& side, int b, int chunk) {
  const int64_t start = static_cast<int64_t>(chunk) * side.chunk_size(b);
  return {start, start + side.valid_in_chunk(b, chunk)};
}

// Whether some query in q and some key in k are visible to each other (j - i within [delta - wl, delta + wr]).
bool any_visible(Window w, Span q, Span k, int64_t delta) {
  if (q.empty() || k.empty()) return false;
  const int64_t lo = k.begin - (q.end - 1), hi = (k.end - 1) - q.begin;  // range of j - i
  const int64_t wlo = w.left >= 0 ? delta - w.left : std::numeric_limits<int64_t>::min();
  const int64_t whi = w.right >= 0 ? delta + w.right : std::numeric_limits<int64_t>::max();
  return std::max(lo, wlo) <= std::min(hi, whi);
}

// Segments of sequence b in a rank-local tensor (or one of its read_half halves) of `rank`.
std::vector<RowSegment> local_segments(const SidePartition& side, int rank, HalfSelect half, int b) {
  const int W = side.cp_size();
  const int32_t c = side.chunk_size(b);
  const int first_chunk = rank, second_chunk = 2 * W - 1 - rank;
  std::vector<RowSegment> out;
  if (half == HalfSelect::full) {
    const int64_t start = side.global().cu_seqlens_padded[b] / W;
    const int32_t n0 = side.valid_in_chunk(b, first_chunk), n1 = side.valid_in_chunk(b, second_chunk);
    if (n0 > 0) out.push_back({start, n0, first_chunk * c});
    if (n1 > 0) out.push_back({start + c, n1, second_chunk * c});
  } else {
    const int64_t start = side.global().cu_seqlens_padded[b] / (2 * W);
    const int chunk = half == HalfSelect::first ? first_chunk : second_chunk;
    const int32_t n = side.valid_in_chunk(b, chunk);
    if (n > 0) out.push_back({start, n, chunk * c});
  }
  return out;
}

HalfSelect half_of(bool first, bool second) {
  return first && second ? HalfSelect::full : (first ? HalfSelect::first : HalfSelect::second);
}

// Common description of one p2p ring (also the ring of a2a+p2p over its group partition).
struct Ring {
  const SidePartition* q = nullptr;
  const SidePartition* kv = nullptr;
  int size = 1;          // P
  int a2a_size = 1;      // A: global rank = ring_rank * A + a2a_index
  StepSpace space = StepSpace::rank_local;
  int32_t te_max_q = 0, te_max_kv = 0;  // before the ring's division by P
};

// Tile of ring rank p (a2a index j) reading the KV of ring rank o at forward step `step`; the mask, the scale and
// the heads are the plan's.
Tile ring_tile(const Ring& ring, const Plan& plan, int p, int j, int o, int step) {
  const int P = ring.size;
  const SidePartition& qs = *ring.q;
  const SidePartition& ks = *ring.kv;
  Tile t;
  t.rank = p * ring.a2a_size + j;
  t.step = step;
  t.kv_owner = o * ring.a2a_size + j;
  t.q_space = t.kv_space = ring.space;
  const int hq = plan.heads_q / ring.a2a_size, hk = plan.heads_kv / ring.a2a_size;
  t.head_begin = j * hq;
  t.head_end = (j + 1) * hq;
  t.kv_head_begin = j * hk;
  t.kv_head_end = (j + 1) * hk;
  const bool windowed = has_window(plan.window);
  // TE's structural sections assume Q and KV share the chunk geometry (same padded lengths); otherwise, as for
  // windows, chunks are selected from the pairs they can see.
  bool same_geometry = true;
  for (int b = 0; b < qs.batch(); ++b) same_geometry = same_geometry && qs.chunk_size(b) == ks.chunk_size(b);
  const bool select_by_visibility = windowed || (plan.causal && !same_geometry);
  bool q_first = true, q_second = true, kv_first = true, kv_second = true;
  if (plan.causal && !select_by_visibility) {
    // TransformerEngine's sections (docs/cp-layout.md, "p2p (ring)").
    if (o == p) {
      t.section = StepSection::diagonal;
    } else if (o < p) {
      t.section = StepSection::lower;
      kv_second = false;
    } else {
      t.section = StepSection::upper;
      q_first = false;
    }
  } else {
    t.section = plan.causal ? (o == p ? StepSection::diagonal : (o < p ? StepSection::lower : StepSection::upper))
                            : StepSection::all;
    if (select_by_visibility) {
      // Beyond TE: keep only the chunks that see some visible pair in some sequence; skip the tile if none does.
      q_first = q_second = kv_first = kv_second = false;
      const int qc[2] = {p, 2 * P - 1 - p}, kc[2] = {o, 2 * P - 1 - o};
      for (int b = 0; b < qs.batch(); ++b) {
        const int64_t delta = static_cast<int64_t>(ks.global().length(b)) - qs.global().length(b);
        for (int a = 0; a < 2; ++a)
          for (int c = 0; c < 2; ++c)
            if (any_visible(plan.window, chunk_span(qs, b, qc[a]), chunk_span(ks, b, kc[c]), delta)) {
              (a == 0 ? q_first : q_second) = true;
              (c == 0 ? kv_first : kv_second) = true;
            }
      }
      if (!(q_first || q_second)) {
        t.computed = false;
        q_first = q_second = kv_first = kv_second = true;
      }
    }
  }
  t.q_half = half_of(q_first, q_second);
  t.kv_half = half_of(kv_first, kv_second);
  t.q_chunks[0] = q_first ? p : (q_second ? 2 * P - 1 - p : -1);
  t.q_chunks[1] = q_first && q_second ? 2 * P - 1 - p : -1;
  t.kv_chunks[0] = kv_first ? o : (kv_second ? 2 * P - 1 - o : -1);
  t.kv_chunks[1] = kv_first && kv_second ? 2 * P - 1 - o : -1;

  // What TransformerEngine passes (docs/cp-layout.md, "p2p (ring)" table).
  StepMetadata& te = t.te;
  te.cu_seqlens_q = qs.cu_seqlens_on_rank(p, q_first, q_second);
  te.cu_seqlens_kv = ks.cu_seqlens_on_rank(o, kv_first, kv_second);
  te.cu_seqlens_q_padded = t.q_half == HalfSelect::full ? qs.local_padded() : qs.half_padded();
  te.cu_seqlens_kv_padded = t.kv_half == HalfSelect::full ? ks.local_padded() : ks.half_padded();
  te.max_seqlen_q = ring.te_max_q / P / (t.q_half == HalfSelect::full ? 1 : 2);
  te.max_seqlen_kv = ring.te_max_kv / P / (t.kv_half == HalfSelect::full ? 1 : 2);
  te.max_seqlen_q_exact = max_count(te.cu_seqlens_q);
  te.max_seqlen_kv_exact = max_count(te.cu_seqlens_kv);
  te.mask = plan.causal && t.section == StepSection::diagonal ? "padding_causal" : "padding";
  te.window = (plan.causal && t.section == StepSection::diagonal) || windowed ? plan.window : Window{-1, -1};

  // The position-aware call.
  AttentionCall& call = t.call;
  call.window = plan.window;
  call.softmax_scale = plan.softmax_scale;
  call.q_rows = t.q_half == HalfSelect::full ? qs.local_rows() : qs.half_rows();
  call.kv_rows = t.kv_half == HalfSelect::full ? ks.local_rows() : ks.half_rows();
  for (int b = 0; b < qs.batch(); ++b) {
    SequenceTile seq;
    seq.length_q = qs.global().length(b);
    seq.length_kv = ks.global().length(b);
    seq.q = local_segments(qs, p, t.q_half, b);
    seq.kv = local_segments(ks, o, t.kv_half, b);
    call.sequences.push_back(std::move(seq));
  }
  return t;
}

void add_ring(const Ring& ring, Plan& plan) {
  const int P = ring.size, A = ring.a2a_size;
  const int W = P * A;
  plan.forward.steps = plan.backward.steps = P;
  plan.forward.tiles.assign(static_cast<size_t>(W * P), Tile{});
  plan.backward.tiles.assign(static_cast<size_t>(W * P), Tile{});
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < A; ++j) {
      const int g = p * A + j;
      for (int i = 0; i < P; ++i) {
        // Forward step i: KV of owner (p - i) mod P. Backward step i replays forward step P-1-i: owner (p+1+i) mod P.
        plan.forward.tiles[static_cast<size_t>(g * P + i)] = ring_tile(ring, plan, p, j, ((p - i) % P + P) % P, i);
        plan.backward.tiles[static_cast<size_t>(g * P + i)] = ring_tile(ring, plan, p, j, (p + 1 + i) % P, i);
      }
    }
  const int hk = plan.heads_kv / A;
  const int64_t kv_rows = ring.kv->local_rows();
  for (int i = 0; i + 1 < P; ++i)
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < A; ++j) {
        // Forward: after step i, send the KV held (owner p - i) to p + 1.
        const int owner_f = (((p - i) % P + P) % P) * A + j;
        plan.forward.messages.push_back({i, p * A + j, ((p + 1) % P) * A + j, Payload::kv, owner_f, j * hk, (j + 1) * hk, kv_rows});
        // Backward: after step i, send KV and the partial dKV of owner p + 1 + i to p - 1.
        const int owner_b = ((p + 1 + i) % P) * A + j;
        const int to = ((p - 1) % P + P) % P * A + j;
        plan.backward.messages.push_back({i, p * A + j, to, Payload::kv, owner_b, j * hk, (j + 1) * hk, kv_rows});
        plan.backward.messages.push_back({i, p * A + j, to, Payload::dkv, owner_b, j * hk, (j + 1) * hk, kv_rows});
      }
}

// a2a exchanges of a group of A consecutive ranks starting at `first`: each rank sends head group j of its rows to
// member j (before attention, payloads `in`) and gets its rows of every head group back (after, payloads `out`).
void add_a2a_messages(PassPlan& pass, int first, int A, int after_step, const std::vector<Payload>& payloads,
                      const std::vector<int>& heads_of, const std::vector<int64_t>& rows_of, bool to_group) {
  for (size_t k = 0; k < payloads.size(); ++k) {
    const int h = heads_of[k] / A;
    for (int a = 0; a < A; ++a)
      for (int j = 0; j < A; ++j) {
        // to_group: rank first+a sends its shard's head group j to first+j; otherwise first+j returns a's rows.
        const int from = to_group ? first + a : first + j, to = to_group ? first + j : first + a;
        pass.messages.push_back({after_step, from, to, payloads[k], first + a, j * h, (j + 1) * h, rows_of[k]});
      }
  }
}

StepMetadata global_te(const ThdLayout& l, bool causal, Window w) {
  StepMetadata te;
  te.cu_seqlens_q = l.q.cu_seqlens;
  te.cu_seqlens_kv = l.kv.cu_seqlens;
  te.cu_seqlens_q_padded = l.q.cu_seqlens_padded;
  te.cu_seqlens_kv_padded = l.kv.cu_seqlens_padded;
  te.max_seqlen_q = te_max_seqlen(l.q);
  te.max_seqlen_kv = te_max_seqlen(l.kv);
  te.max_seqlen_q_exact = max_count(l.q.cu_seqlens);
  te.max_seqlen_kv_exact = max_count(l.kv.cu_seqlens);
  te.mask = causal ? "padding_causal" : "padding";
  te.window = w;
  return te;
}

void make_a2a(const CaseSpec& spec, const ThdLayout& l, Plan& plan) {
  const int W = plan.cp_size;
  const int hq = plan.heads_q / W, hk = plan.heads_kv / W;
  ThdLayout seq = l;  // sequence order: no tail rows
  seq.q.total_rows = l.q.cu_seqlens_padded.back();
  seq.kv.total_rows = l.kv.cu_seqlens_padded.back();
  for (PassPlan* pass : {&plan.forward, &plan.backward}) {
    pass->steps = 1;
    for (int r = 0; r < W; ++r) {
      Tile t;
      t.rank = r;
      t.step = 0;
      t.section = plan.causal ? StepSection::diagonal : StepSection::all;
      t.q_space = t.kv_space = StepSpace::sequence_order;
      t.head_begin = r * hq;
      t.head_end = (r + 1) * hq;
      t.kv_head_begin = r * hk;
      t.kv_head_end = (r + 1) * hk;
      t.te = global_te(l, plan.causal, plan.window);
      t.call = non_cp_call(seq, plan.window, plan.softmax_scale);
      pass->tiles.push_back(std::move(t));
    }
  }
  const int64_t rq = plan.partition.q.local_sequence_rows(), rk = plan.partition.kv.local_sequence_rows();
  add_a2a_messages(plan.forward, 0, W, -1, {Payload::q, Payload::k, Payload::v}, {plan.heads_q, plan.heads_kv, plan.heads_kv},
                   {rq, rk, rk}, true);
  add_a2a_messages(plan.forward, 0, W, 0, {Payload::o, Payload::lse}, {plan.heads_q, plan.heads_q}, {rq, rq}, false);
  add_a2a_messages(plan.backward, 0, W, -1, {Payload::dout}, {plan.heads_q}, {rq}, true);
  add_a2a_messages(plan.backward, 0, W, 0, {Payload::dq, Payload::dk, Payload::dv},
                   {plan.heads_q, plan.heads_kv, plan.heads_kv}, {rq, rk, rk}, false);
  (void)spec;
}

// TE's per-step window after the all-gather (get_kv_seq_info_after_all_gather, docs/cp-layout.md, "all_gather").
Window all_gather_te_window(int c, int W, int32_t msq, int32_t msk, Window w, bool causal, int32_t* se_out) {
  if (w.left < 0 && w.right < 0 && causal) w = {-1, 0};
  const int64_t end_c = static_cast<int64_t>(c + 1) * msk, full = static_cast<int64_t>(2 * W) * msk;
  Window out;
  int64_t se;
  if (w.right == -1) {
    se = full;
    out.right = -1;
  } else {
    se = std::min(full, end_c + w.right);
    out.right = static_cast<int32_t>(end_c + w.right - se);
  }
  out.left = w.left == -1 ? -1 : static_cast<int32_t>(w.left + se - end_c);
  (void)msq;
  *se_out = static_cast<int32_t>(se);
  return out;
}

void make_all_gather(const ThdLayout& l, Plan& plan) {
  const int W = plan.cp_size;
  const SidePartition& qs = plan.partition.q;
  const SidePartition& ks = plan.partition.kv;
  const bool bounded_right = plan.window.right >= 0;  // causal or a window with a right side
  const bool te_limits_kv = plan.causal || has_window(plan.window);
  const int32_t msq = te_max_seqlen(l.q) / (2 * W), msk = te_max_seqlen(l.kv) / (2 * W);
  for (PassPlan* pass : {&plan.forward, &plan.backward}) {
    pass->steps = 2;
    for (int r = 0; r < W; ++r)
      for (int s = 0; s < 2; ++s) {
        const int c = s == 0 ? r : 2 * W - 1 - r;
        Tile t;
        t.rank = r;
        t.step = s;
        t.section = plan.causal ? StepSection::diagonal : StepSection::all;
        t.q_space = StepSpace::rank_local;
        t.kv_space = StepSpace::sequence_order;
        t.q_chunks[0] = c;
        t.head_begin = 0;
        t.head_end = plan.heads_q;
        t.kv_head_begin = 0;
        t.kv_head_end = plan.heads_kv;
        StepMetadata& te = t.te;
        te.cu_seqlens_q = qs.cu_seqlens_on_rank(r, s == 0, s == 1);
        te.cu_seqlens_q_padded = qs.local_padded();
        if (s == 1)
          for (int b = 0; b < qs.batch(); ++b) te.cu_seqlens_q_padded[b] += qs.chunk_size(b);
        te.cu_seqlens_kv = {0};
        for (int b = 0; b < ks.batch(); ++b) {
          int64_t n = ks.global().length(b);
          if (te_limits_kv) {
            const int64_t vis = static_cast<int64_t>(ks.chunk_size(b)) * (c + 1) + std::max(plan.window.right, 0);
            n = std::min<int64_t>(n, vis);
          }
          te.cu_seqlens_kv.push_back(te.cu_seqlens_kv.back() + static_cast<int32_t>(n));
        }
        te.cu_seqlens_kv_padded = ks.global().cu_seqlens_padded;
        te.max_seqlen_q = msq;
        te.window = all_gather_te_window(c, W, msq, msk, plan.window, plan.causal, &te.max_seqlen_kv);
        te.max_seqlen_q_exact = max_count(te.cu_seqlens_q);
        te.max_seqlen_kv_exact = max_count(te.cu_seqlens_kv);
        te.mask = plan.causal ? "padding_causal_bottom_right" : "padding";

        AttentionCall& call = t.call;
        call.window = plan.window;
        call.softmax_scale = plan.softmax_scale;
        call.q_rows = qs.local_rows();
        call.kv_rows = ks.global().cu_seqlens_padded.back();
        for (int b = 0; b < qs.batch(); ++b) {
          SequenceTile seq;
          seq.length_q = qs.global().length(b);
          seq.length_kv = ks.global().length(b);
          const int32_t nq = qs.valid_in_chunk(b, c);
          const int32_t cq = qs.chunk_size(b);
          if (nq > 0) seq.q.push_back({qs.global().cu_seqlens_padded[b] / W + (s == 1 ? cq : 0), nq, c * cq});
          // Every key a query of chunk c can see: up to its last position plus delta = L_kv - L_q (bottom-right
          // alignment; 0 under CP, where a right-bounded mask needs L_q == L_kv, but not for W = 1) plus the right
          // side of the window.
          int64_t nk = seq.length_kv;
          if (bounded_right)
            nk = std::clamp<int64_t>(static_cast<int64_t>(c + 1) * cq + seq.delta() + plan.window.right, 0, nk);
          if (nq > 0 && nk > 0) seq.kv.push_back({ks.global().cu_seqlens_padded[b], static_cast<int32_t>(nk), 0});
          call.sequences.push_back(std::move(seq));
        }
        pass->tiles.push_back(std::move(t));
      }
  }
  const int64_t rk = ks.local_sequence_rows();
  for (PassPlan* pass : {&plan.forward, &plan.backward})
    for (Payload pl : {Payload::k, Payload::v})
      for (int from = 0; from < W; ++from)
        for (int to = 0; to < W; ++to)
          if (from != to) pass->messages.push_back({-1, from, to, pl, from, 0, plan.heads_kv, rk});
  for (Payload pl : {Payload::dk, Payload::dv})
    for (int from = 0; from < W; ++from)
      for (int to = 0; to < W; ++to)
        if (from != to) plan.backward.messages.push_back({1, from, to, pl, to, 0, plan.heads_kv, rk});
}

}  // namespace

Plan make_plan(const CaseSpec& spec) {
  validate_case(spec);
  const ThdLayout l = layout(spec);
  Plan plan;
  plan.comm = spec.comm;
  plan.cp_size = spec.cp_size;
  plan.causal = spec.causal;
  plan.window = mask_window(spec);
  plan.softmax_scale = softmax_scale(spec);
  plan.heads_q = spec.heads_q;
  plan.heads_kv = heads_kv(spec);
  plan.partition = make_partition(l, spec.cp_size, spec.causal || is_causal(plan.window) || has_window(plan.window));
  plan.group_partition = plan.partition;
  const int W = spec.cp_size;
  Ring ring;
  ring.te_max_q = te_max_seqlen(l.q);
  ring.te_max_kv = te_max_seqlen(l.kv);
  switch (spec.comm) {
    case CommType::p2p: {
      plan.p2p_size = W;
      ring.q = &plan.partition.q;
      ring.kv = &plan.partition.kv;
      ring.size = W;
      add_ring(ring, plan);
      break;
    }
    case CommType::a2a:
      plan.a2a_size = W;
      make_a2a(spec, l, plan);
      break;
    case CommType::all_gather:
      make_all_gather(l, plan);
      break;
    case CommType::a2a_p2p: {
      const int A = W == 1 ? 1 : a2a_size(spec);
      plan.a2a_size = A;
      plan.p2p_size = W / A;
      plan.group_partition = make_partition(l, plan.p2p_size, false);
      ring.q = &plan.group_partition.q;
      ring.kv = &plan.group_partition.kv;
      ring.size = plan.p2p_size;
      ring.a2a_size = A;
      ring.space = StepSpace::group_local;
      add_ring(ring, plan);
      // a2a inside each group before the ring (q, k, v; dout in backward) and after it (o, lse; dq, dk, dv).
      const int64_t rq = plan.partition.q.local_sequence_rows(), rk = plan.partition.kv.local_sequence_rows();
      const int P = plan.p2p_size;
      PassPlan fwd_pre, fwd_post, bwd_pre, bwd_post;
      for (int p = 0; p < P; ++p) {
        add_a2a_messages(fwd_pre, p * A, A, -1, {Payload::q, Payload::k, Payload::v},
                         {plan.heads_q, plan.heads_kv, plan.heads_kv}, {rq, rk, rk}, true);
        add_a2a_messages(fwd_post, p * A, A, P - 1, {Payload::o, Payload::lse}, {plan.heads_q, plan.heads_q}, {rq, rq},
                         false);
        add_a2a_messages(bwd_pre, p * A, A, -1, {Payload::dout}, {plan.heads_q}, {rq}, true);
        add_a2a_messages(bwd_post, p * A, A, P - 1, {Payload::dq, Payload::dk, Payload::dv},
                         {plan.heads_q, plan.heads_kv, plan.heads_kv}, {rq, rk, rk}, false);
      }
      auto splice = [](PassPlan& pass, PassPlan& pre, PassPlan& post) {
        std::vector<Message> all = std::move(pre.messages);
        all.insert(all.end(), pass.messages.begin(), pass.messages.end());
        all.insert(all.end(), post.messages.begin(), post.messages.end());
        pass.messages = std::move(all);
      };
      splice(plan.forward, fwd_pre, fwd_post);
      splice(plan.backward, bwd_pre, bwd_post);
      break;
    }
  }
  for (const PassPlan* pass : {&plan.forward, &plan.backward})
    for (const Tile& t : pass->tiles) t.call.check();
  return plan;
}

}  // namespace cpgold::sim
