// Per-step TransformerEngine metadata of the Plan against vectors written by hand from docs/cp-layout.md, for cases
// beyond the §2.4 worked example: p2p with W = 3 and W = 4 (causal and not, zero-length sequences, extra padding,
// tail rows), the backward ring (§3.4), all_gather (§5) and a2a+p2p (§6). Every expected value below was computed
// on paper from the spec's formulas (n_b(c) = clamp(L_b - c*C_b, 0, C_b), §2.3 counts, §3.2 table, §5 steps 3-5,
// §6 nesting); none is derived from the code under test.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "sim/plan/plan.hpp"
#include "tests/sim/row_segments.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::sim::testing;

namespace {
using V = std::vector<int32_t>;
}  // namespace

namespace doctest {
template <>
struct StringMaker<std::vector<int32_t>> {
  static String convert(const std::vector<int32_t>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
    return (out + "]").c_str();
  }
};
}  // namespace doctest

namespace {

struct Want {
  StepSection section;
  int owner;
  V cu_q, cu_kv, pad_q, pad_kv;
  int32_t max_q, max_kv;
  const char* mask;
  HalfSelect q_half, kv_half;
};

void check_tile(const Tile& t, const Want& w) {
  CAPTURE(t.rank);
  CAPTURE(t.step);
  CHECK(t.section == w.section);
  CHECK(t.kv_owner == w.owner);
  CHECK(t.te.cu_seqlens_q == w.cu_q);
  CHECK(t.te.cu_seqlens_kv == w.cu_kv);
  CHECK(t.te.cu_seqlens_q_padded == w.pad_q);
  CHECK(t.te.cu_seqlens_kv_padded == w.pad_kv);
  CHECK(t.te.max_seqlen_q == w.max_q);
  CHECK(t.te.max_seqlen_kv == w.max_kv);
  CHECK(t.te.mask == std::string(w.mask));
  CHECK(t.q_half == w.q_half);
  CHECK(t.kv_half == w.kv_half);
}

int32_t max_diff(const V& cu) {
  int32_t m = 0;
  for (size_t b = 1; b < cu.size(); ++b) m = std::max(m, cu[b] - cu[b - 1]);
  return m;
}

constexpr auto F = HalfSelect::full;
constexpr auto H0 = HalfSelect::first;
constexpr auto H1 = HalfSelect::second;
constexpr auto DI = StepSection::diagonal;
constexpr auto LO = StepSection::lower;
constexpr auto UP = StepSection::upper;
constexpr auto AL = StepSection::all;

CaseSpec base(std::vector<int32_t> lengths, std::vector<int32_t> padded, int W, CommType comm, bool causal) {
  CaseSpec s;
  s.seqlens_q = std::move(lengths);
  s.padded_q = padded;
  s.padded_kv = std::move(padded);
  s.cp_size = W;
  s.comm = comm;
  s.causal = causal;
  s.window = normalize_window(causal, {});
  s.heads_q = 4;
  return s;
}
}  // namespace

// W = 3, L = [7, 0, 13], PL = [12, 0, 18]: C = [2, 0, 3], cuP = [0, 12, 12, 30], cuPl = [0, 4, 4, 10],
// cuPh = [0, 2, 2, 5]. n_0(c) = 2,2,2,1,0,0; n_2(c) = 3,3,3,3,1,0.
// cnt(r, both / first / second):
//   r0 (chunks 0, 5): [0,2,2,5] / [0,2,2,5] / [0,0,0,0]
//   r1 (chunks 1, 4): [0,2,2,6] / [0,2,2,5] / [0,0,0,1]
//   r2 (chunks 2, 3): [0,3,3,9] / [0,2,2,5] / [0,1,1,4]
// DPA max_seqlen: max PL 18 -> 64; /W = 21, /(2W) = 10.
TEST_CASE("p2p W=3 causal: sections, owners, counts, offsets, max_seqlen per step (§3.2)") {
  const Plan plan = make_plan(base({7, 0, 13}, {12, 0, 18}, 3, CommType::p2p, true));
  REQUIRE(plan.forward.steps == 3);
  const V cuPl{0, 4, 4, 10}, cuPh{0, 2, 2, 5};
  const V both[3] = {{0, 2, 2, 5}, {0, 2, 2, 6}, {0, 3, 3, 9}};
  const V first[3] = {{0, 2, 2, 5}, {0, 2, 2, 5}, {0, 2, 2, 5}};
  const V second[3] = {{0, 0, 0, 0}, {0, 0, 0, 1}, {0, 1, 1, 4}};
  // Forward owner o = (r - i) mod 3.
  const Want fwd[3][3] = {
      {{DI, 0, both[0], both[0], cuPl, cuPl, 21, 21, "padding_causal", F, F},
       {UP, 2, second[0], both[2], cuPh, cuPl, 10, 21, "padding", H1, F},
       {UP, 1, second[0], both[1], cuPh, cuPl, 10, 21, "padding", H1, F}},
      {{DI, 1, both[1], both[1], cuPl, cuPl, 21, 21, "padding_causal", F, F},
       {LO, 0, both[1], first[0], cuPl, cuPh, 21, 10, "padding", F, H0},
       {UP, 2, second[1], both[2], cuPh, cuPl, 10, 21, "padding", H1, F}},
      {{DI, 2, both[2], both[2], cuPl, cuPl, 21, 21, "padding_causal", F, F},
       {LO, 1, both[2], first[1], cuPl, cuPh, 21, 10, "padding", F, H0},
       {LO, 0, both[2], first[0], cuPl, cuPh, 21, 10, "padding", F, H0}},
  };
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 3; ++i) {
      check_tile(plan.forward.tile(r, i), fwd[r][i]);
      CHECK(plan.forward.tile(r, i).te.max_seqlen_q_exact == max_diff(fwd[r][i].cu_q));
      CHECK(plan.forward.tile(r, i).te.max_seqlen_kv_exact == max_diff(fwd[r][i].cu_kv));
      // FA path: diagonal causal (-1, 0), other sections (-1, -1) (§3.4 FA path).
      const Window want_w = i == 0 ? Window{-1, 0} : Window{-1, -1};
      CHECK(plan.forward.tile(r, i).te.window == want_w);
    }
  // Backward step i replays forward step W-1-i: owner (r+1+i) mod 3; diagonal at i = 2, lower for W-r-1 <= i < 2.
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 3; ++i) {
      const Tile& b = plan.backward.tile(r, i);
      CHECK(b.kv_owner == (r + 1 + i) % 3);
      check_tile(b, fwd[r][2 - i]);
    }
  // Explicit backward sections of rank 0 (upper, upper, diagonal), rank 1 (upper, lower, diagonal),
  // rank 2 (lower, lower, diagonal).
  const StepSection bsec[3][3] = {{UP, UP, DI}, {UP, LO, DI}, {LO, LO, DI}};
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 3; ++i) CHECK(plan.backward.tile(r, i).section == bsec[r][i]);
}

TEST_CASE("p2p W=3 non-causal: every step is 'all' with full tensors (§3.2)") {
  const Plan plan = make_plan(base({7, 0, 13}, {12, 0, 18}, 3, CommType::p2p, false));
  const V cuPl{0, 4, 4, 10};
  const V both[3] = {{0, 2, 2, 5}, {0, 2, 2, 6}, {0, 3, 3, 9}};
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 3; ++i) {
      const int o = ((r - i) % 3 + 3) % 3;
      check_tile(plan.forward.tile(r, i), {AL, o, both[r], both[o], cuPl, cuPl, 21, 21, "padding", F, F});
      CHECK(plan.forward.tile(r, i).te.window == Window{-1, -1});
      check_tile(plan.backward.tile(r, i), {AL, (r + 1 + i) % 3, both[r], both[(r + 1 + i) % 3], cuPl, cuPl, 21, 21,
                                            "padding", F, F});
    }
}

// W = 4, L = [9, 3, 16], PL = [16, 16, 16] (sequence 1 padded well beyond the 2W rule), 8 tail rows:
// C = 2 for all, cuP = [0, 16, 32, 48], cuPl = [0, 4, 8, 12], cuPh = [0, 2, 4, 6].
// n_0(c) = 2,2,2,2,1,0,0,0; n_1(c) = 2,1,0,...; n_2(c) = 2 for all c.
//   r0 (0, 7): both [0,2,4,8]  first [0,2,4,6]  second [0,0,0,2]
//   r1 (1, 6): both [0,2,3,7]  first [0,2,3,5]  second [0,0,0,2]
//   r2 (2, 5): both [0,2,2,6]  first [0,2,2,4]  second [0,0,0,2]
//   r3 (3, 4): both [0,3,3,7]  first [0,2,2,4]  second [0,1,1,3]
// DPA max_seqlen 64 -> 16 (/W) and 8 (/(2W)).
TEST_CASE("p2p W=4 causal with tail rows: per-step metadata and the backward replay (§3.2, §3.4)") {
  CaseSpec s = base({9, 3, 16}, {16, 16, 16}, 4, CommType::p2p, true);
  s.total_tokens_q = 56;
  s.total_tokens_kv = 56;
  const Plan plan = make_plan(s);
  REQUIRE(plan.forward.steps == 4);
  const V cuPl{0, 4, 8, 12}, cuPh{0, 2, 4, 6};
  const V both[4] = {{0, 2, 4, 8}, {0, 2, 3, 7}, {0, 2, 2, 6}, {0, 3, 3, 7}};
  const V first[4] = {{0, 2, 4, 6}, {0, 2, 3, 5}, {0, 2, 2, 4}, {0, 2, 2, 4}};
  const V second[4] = {{0, 0, 0, 2}, {0, 0, 0, 2}, {0, 0, 0, 2}, {0, 1, 1, 3}};
  auto want = [&](int r, int o) -> Want {
    if (o == r) return {DI, o, both[r], both[r], cuPl, cuPl, 16, 16, "padding_causal", F, F};
    if (o < r) return {LO, o, both[r], first[o], cuPl, cuPh, 16, 8, "padding", F, H0};
    return {UP, o, second[r], both[o], cuPh, cuPl, 8, 16, "padding", H1, F};
  };
  // Owners by hand: forward (r - i) mod 4.
  const int fo[4][4] = {{0, 3, 2, 1}, {1, 0, 3, 2}, {2, 1, 0, 3}, {3, 2, 1, 0}};
  const int bo[4][4] = {{1, 2, 3, 0}, {2, 3, 0, 1}, {3, 0, 1, 2}, {0, 1, 2, 3}};
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 4; ++i) {
      check_tile(plan.forward.tile(r, i), want(r, fo[r][i]));
      check_tile(plan.backward.tile(r, i), want(r, bo[r][i]));
      CHECK(plan.backward.tile(r, i).te.max_seqlen_kv_exact == max_diff(want(r, bo[r][i]).cu_kv));
    }
  // Rows: local tensors carry 2 tail rows (8 / W); read_half tensors have cuP[B] / (2W) = 6 rows.
  CHECK(plan.forward.tile(1, 1).call.q_rows == 14);
  CHECK(plan.forward.tile(1, 1).call.kv_rows == 6);
  CHECK(plan.forward.tile(0, 1).call.q_rows == 6);
  // Upper tile rank 3 <- owner... (rank 0 step 1 reads owner 3): Q = chunk 7 of rank 0, sequence 2 only (2 rows at
  // half row 4, positions 14, 15); KV of rank 3 = chunks 3 and 4.
  const Tile& up = plan.forward.tile(0, 1);
  REQUIRE(up.call.sequences.size() == 3);
  check_segments(up.call.sequences[0].q, {});
  check_segments(up.call.sequences[2].q, {{4, 2, 14}});
  check_segments(up.call.sequences[0].kv, {{0, 2, 6}, {2, 1, 8}});
  check_segments(up.call.sequences[1].kv, {});
}

// all_gather W = 3 on the W=3 layout: msq = msk = 64 / 6 = 10, full = 60.
// Rank r: step 0 chunk r, step 1 chunk 5-r. cuPr = [0,4,4,10]; step-1 offsets cuPr[b] + C_b = [2,4,7] then cuPr[B] = 10.
// Causal KV counts min(L_b, C_b*(c+1)): c0 [0,2,2,5], c1 [0,4,4,10], c2 [0,6,6,15], c3 [0,7,7,19], c4 [0,7,7,20],
// c5 [0,7,7,20]. Window (-1,0) stays (-1,0); max_seqlen_kv = se = (c+1)*10.
TEST_CASE("all_gather W=3 causal and windows: offsets, visible counts, per-step window (§5)") {
  const V pad0{0, 4, 4, 10}, pad1{2, 4, 7, 10}, cuPkv{0, 12, 12, 30};
  const V first[3] = {{0, 2, 2, 5}, {0, 2, 2, 5}, {0, 2, 2, 5}};
  const V second[3] = {{0, 0, 0, 0}, {0, 0, 0, 1}, {0, 1, 1, 4}};
  const V kv_causal[6] = {{0, 2, 2, 5}, {0, 4, 4, 10}, {0, 6, 6, 15}, {0, 7, 7, 19}, {0, 7, 7, 20}, {0, 7, 7, 20}};
  {
    const Plan plan = make_plan(base({7, 0, 13}, {12, 0, 18}, 3, CommType::all_gather, true));
    REQUIRE(plan.forward.steps == 2);
    for (int r = 0; r < 3; ++r)
      for (int s = 0; s < 2; ++s) {
        CAPTURE(r);
        CAPTURE(s);
        const int c = s == 0 ? r : 5 - r;
        for (const PassPlan* pass : {&plan.forward, &plan.backward}) {
          const Tile& t = pass->tile(r, s);
          CHECK(t.te.cu_seqlens_q == (s == 0 ? first[r] : second[r]));
          CHECK(t.te.cu_seqlens_q_padded == (s == 0 ? pad0 : pad1));
          CHECK(t.te.cu_seqlens_kv == kv_causal[c]);
          CHECK(t.te.cu_seqlens_kv_padded == cuPkv);
          CHECK(t.te.max_seqlen_q == 10);
          CHECK(t.te.max_seqlen_kv == (c + 1) * 10);
          CHECK(t.te.window == Window{-1, 0});
          CHECK(t.te.mask == std::string("padding_causal_bottom_right"));
        }
      }
  }
  {
    // Causal SWA (3, 0): counts as causal (wr = 0), window stays (3, 0): wl' = 3 + se - end_c = 3.
    CaseSpec sw = base({7, 0, 13}, {12, 0, 18}, 3, CommType::all_gather, true);
    sw.window = normalize_window(true, {3, 0});
    const Plan plan = make_plan(sw);
    for (int r = 0; r < 3; ++r)
      for (int s = 0; s < 2; ++s) {
        const int c = s == 0 ? r : 5 - r;
        const Tile& t = plan.forward.tile(r, s);
        CHECK(t.te.cu_seqlens_kv == kv_causal[c]);
        CHECK(t.te.window == Window{3, 0});
        CHECK(t.te.max_seqlen_kv == (c + 1) * 10);
      }
  }
  {
    // Non-causal window (3, 2): counts min(L, C*(c+1) + 2): c0 [0,4,4,5+... ] by hand:
    //   c0: min(7,4)=4, 0, min(13,5)=5 -> [0,4,4,9];  c5: 7, 0, 13 -> [0,7,7,20]
    //   c1: 6, 0, 8 -> [0,6,6,14];                    c4: 7, 0, 13 -> [0,7,7,20]
    //   c2: 7, 0, 11 -> [0,7,7,18];                   c3: 7, 0, 13 (min(13,14)) -> [0,7,7,20]
    // se = min(60, 10(c+1) + 2): c < 5: se = 10(c+1)+2, wr' = 0, wl' = 3 + 2 = 5; c = 5: se = 60, wr' = 2, wl' = 3.
    CaseSpec sw = base({7, 0, 13}, {12, 0, 18}, 3, CommType::all_gather, false);
    sw.window = normalize_window(false, {3, 2});
    const Plan plan = make_plan(sw);
    const V kv_w[6] = {{0, 4, 4, 9}, {0, 6, 6, 14}, {0, 7, 7, 18}, {0, 7, 7, 20}, {0, 7, 7, 20}, {0, 7, 7, 20}};
    for (int r = 0; r < 3; ++r)
      for (int s = 0; s < 2; ++s) {
        CAPTURE(r);
        CAPTURE(s);
        const int c = s == 0 ? r : 5 - r;
        const Tile& t = plan.forward.tile(r, s);
        CHECK(t.te.cu_seqlens_kv == kv_w[c]);
        CHECK(t.te.mask == std::string("padding"));
        CHECK(t.te.window == (c < 5 ? Window{5, 0} : Window{3, 2}));
        CHECK(t.te.max_seqlen_kv == (c < 5 ? 10 * (c + 1) + 2 : 60));
      }
  }
  {
    // Non-causal, no window: the global counts, window (-1, -1), se = full = 60.
    const Plan plan = make_plan(base({7, 0, 13}, {12, 0, 18}, 3, CommType::all_gather, false));
    for (int r = 0; r < 3; ++r)
      for (int s = 0; s < 2; ++s) {
        const Tile& t = plan.forward.tile(r, s);
        CHECK(t.te.cu_seqlens_kv == V{0, 7, 7, 20});
        CHECK(t.te.window == Window{-1, -1});
        CHECK(t.te.max_seqlen_kv == 60);
        CHECK(t.te.mask == std::string("padding"));
      }
  }
}

// a2a+p2p, W_tot = 4, A = 2, P = 2, L = [9, 3, 16], PL = [16, 16, 16].
// P-level: C^P = 4, cuP/P = [0,8,16,24], cuP/(2P) = [0,4,8,12]; n^P_0 = 4,4,1,0; n^P_1 = 3,0,0,0; n^P_2 = 4,4,4,4.
//   p0 (P-chunks 0, 3): both [0,4,7,15]  first [0,4,7,11]  second [0,0,0,4]
//   p1 (P-chunks 1, 2): both [0,5,5,13]  first [0,4,4,8]   second [0,1,1,5]
// max_seqlen 64 / P = 32, half 16. Global rank g = p*A + j; the KV owner has the same a2a index j.
// Nesting (§6): rank g = p*A + j holds global W-way chunks g and 7-g = sub-chunks j and 2A-1-j of its P-level sequence.
TEST_CASE("a2a+p2p W=4 (2x2) causal: ring over the P-way layout, owners with the same a2a index (§6)") {
  CaseSpec s = base({9, 3, 16}, {16, 16, 16}, 4, CommType::a2a_p2p, true);
  s.a2a_size = 2;
  const Plan plan = make_plan(s);
  REQUIRE(plan.p2p_size == 2);
  REQUIRE(plan.forward.steps == 2);
  const V pl{0, 8, 16, 24}, ph{0, 4, 8, 12};
  const V both[2] = {{0, 4, 7, 15}, {0, 5, 5, 13}};
  const V first[2] = {{0, 4, 7, 11}, {0, 4, 4, 8}};
  const V second[2] = {{0, 0, 0, 4}, {0, 1, 1, 5}};
  for (int p = 0; p < 2; ++p)
    for (int j = 0; j < 2; ++j) {
      const int g = p * 2 + j;
      // Forward step 0: diagonal; step 1: p0 upper with owner p1, p1 lower with owner p0.
      check_tile(plan.forward.tile(g, 0), {DI, g, both[p], both[p], pl, pl, 32, 32, "padding_causal", F, F});
      if (p == 0)
        check_tile(plan.forward.tile(g, 1), {UP, 2 + j, second[0], both[1], ph, pl, 16, 32, "padding", H1, F});
      else
        check_tile(plan.forward.tile(g, 1), {LO, j, both[1], first[0], pl, ph, 32, 16, "padding", F, H0});
      // Backward replays in reverse: step 0 = forward step 1, step 1 = diagonal.
      if (p == 0)
        check_tile(plan.backward.tile(g, 0), {UP, 2 + j, second[0], both[1], ph, pl, 16, 32, "padding", H1, F});
      else
        check_tile(plan.backward.tile(g, 0), {LO, j, both[1], first[0], pl, ph, 32, 16, "padding", F, H0});
      check_tile(plan.backward.tile(g, 1), {DI, g, both[p], both[p], pl, pl, 32, 32, "padding_causal", F, F});
      CHECK(plan.forward.tile(g, 0).head_begin == 2 * j);
      CHECK(plan.forward.tile(g, 0).head_end == 2 * j + 2);
    }
  // The W-way partition: global rank g holds chunks g and 7 - g (C = 2). Check the chunk nesting: p2p rank p,
  // a2a index j holds global chunks p*A + j and 2*W_tot-1-p*A-j.
  for (int p = 0; p < 2; ++p)
    for (int j = 0; j < 2; ++j) {
      const int g = p * 2 + j;
      const std::vector<int64_t> idx = plan.partition.q.gather_indices(g);
      // Sequence 2 starts at global row 32 and local row 8; its local rows 8, 9 are chunk g, 10, 11 chunk 7-g.
      CHECK(idx[8] == 32 + 2 * (p * 2 + j));
      CHECK(idx[10] == 32 + 2 * (7 - p * 2 - j));
    }
  // P-level Q segments of rank p = 1 (P-chunks 1, 2: positions 4..7 and 8..11) for sequence 0 (L = 9): 4 + 1 rows.
  const SequenceTile& q0 = plan.forward.tile(2, 0).call.sequences[0];
  REQUIRE(q0.q.size() == 2);
  CHECK(q0.q[0] == RowSegment{0, 4, 4});
  CHECK(q0.q[1] == RowSegment{4, 1, 8});
}
