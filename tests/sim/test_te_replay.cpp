// The literal TransformerEngine replay (sim/te/te_replay.hpp) against arguments worked out by hand from TE 2.20's source:
// the layout where TE's p2p calls differ from cpgold's corrected plan (padded_q != padded_kv), docs/cp-layout.md's
// "Worked example" worked example, TE's normalisations (a padding mask with window (-1, 0) is full attention; a2a+p2p
// with a group of one falls back) and its refusals with their source lines.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "reference/input_error.hpp"
#include "sim/te/te_audit.hpp"
#include "tests/sim/te_findings.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::sim::testing;

namespace {
using V = std::vector<int32_t>;
using json = nlohmann::json;

struct Replayed {
  CaseSpec spec;
  TeReplay replay;
};
Replayed replay(const std::string& case_json, TeBackend backend, bool pad_between_seqs = true) {
  const json o = json::parse(case_json);
  const CaseSpec spec = parse_case(o);
  return {spec, replay_te(spec, te_user_arguments(o), backend, pad_between_seqs)};
}
const TeCall& call(const TeReplay& r, PassKind pass, int rank, int step) {
  for (const TeCall& c : r.calls(pass))
    if (c.rank == rank && c.step == step) return c;
  FAIL("no call of rank " << rank << " step " << step);
  return r.forward.front();
}

// --seqlens-q 5,0,13 --padded-q 8,0,24 --padded-kv 8,0,16 --cp-size 2 --comm p2p --mask causal
const char* kGeometry =
    R"({"seqlens_q": [5, 0, 13], "padded_q": [8, 0, 24], "padded_kv": [8, 0, 16], "cp_size": 2, "comm": "p2p", "mask": "causal"})";

}  // namespace

TEST_CASE("replay p2p causal with padded_q != padded_kv: TE's full-input diagonal, not cpgold's corrected step") {
  // By hand: C_q = 2, 0, 6 and C_kv = 2, 0, 4. Rank 0 holds chunks 0 and 3. get_cu_seqlens_on_cp_rank with
  // cuP // 2 = [0,4,4,16] (q) and [0,4,4,12] (kv): q counts 2 + 0, 0, 6 + 0; kv counts 2 + 0, 0, 4 + clamp(13-12) = 5.
  // max_seqlen: the padded maxima 24 and 16 both round to 64; / W = 32.
  const Replayed fused = replay(kGeometry, TeBackend::fused);
  REQUIRE_FALSE(fused.replay.refusal);
  const TeCall& d = call(fused.replay, PassKind::forward, 0, 0);
  CHECK(d.section == "diagonal");
  CHECK(d.q_tensor == TeTensor::rank_local);
  CHECK(d.kv_tensor == TeTensor::rank_local);
  CHECK(d.cu_seqlens_q == V{0, 2, 2, 8});
  CHECK(d.cu_seqlens_kv == V{0, 2, 2, 7});
  CHECK(d.cu_seqlens_q_padded == V{0, 4, 4, 16});
  CHECK(d.cu_seqlens_kv_padded == V{0, 4, 4, 12});
  CHECK(d.max_seqlen_q == 32);
  CHECK(d.max_seqlen_kv == 32);
  CHECK(d.attn_mask_type == "padding_causal");
  CHECK(d.window == Window{-1, -1});  // no window_size is passed: fused_attn_fwd's default
  CHECK_FALSE(d.bottom_right);
  // Rank 1 step 1 (lower-triangle, owner 0): K/V = read_half(chunk 0), counts of rank 0's first half: 2, 0, 4;
  // offsets [0,4,4,12] // 2; max_seqlen_kv 32 // 2.
  const TeCall& lower = call(fused.replay, PassKind::forward, 1, 1);
  CHECK(lower.section == "lower-triangle");
  CHECK(lower.kv_tensor == TeTensor::first_half);
  CHECK(lower.cu_seqlens_q == V{0, 3, 3, 10});
  CHECK(lower.cu_seqlens_kv == V{0, 2, 2, 6});
  CHECK(lower.cu_seqlens_kv_padded == V{0, 2, 2, 6});
  CHECK(lower.max_seqlen_kv == 16);
  CHECK(lower.attn_mask_type == "padding");
  // The backward replays forward step W-1-i: its step 1 on rank 0 is the diagonal.
  const TeCall& back = call(fused.replay, PassKind::backward, 0, 1);
  CHECK(back.section == "diagonal");
  CHECK(back.cu_seqlens_kv == V{0, 2, 2, 7});

  // FlashAttention-3 passes the padded offsets as cu_seqlens and the counts as seqused, causal with (-1, 0).
  const Replayed fa = replay(kGeometry, TeBackend::flash3);
  const TeCall& f = call(fa.replay, PassKind::forward, 0, 0);
  CHECK(f.cu_seqlens_q == V{0, 4, 4, 16});
  CHECK(f.cu_seqlens_kv == V{0, 4, 4, 12});
  CHECK(f.seqused_q == V{2, 0, 6});
  CHECK(f.seqused_k == V{2, 0, 5});
  CHECK(f.causal);
  CHECK(f.window == Window{-1, 0});
  CHECK(f.cu_seqlens_q_padded.empty());
}

TEST_CASE("audit p2p causal with padded_q != padded_kv: findings on both backends, worked out by hand") {
  const Replayed fused = replay(kGeometry, TeBackend::fused);
  const TeAudit a = audit_te(fused.spec, fused.replay);
  CHECK_FALSE(a.exact);
  // Rank 0 step 0, sequence 2: query rows 0..5 at positions 0..5, key rows 0..3 at positions 0..3 and row 4 at
  // position 12. Top-left causal gives queries 4 and 5 key rows 0..4: position 12 is not visible to them.
  check_finding(find_finding(a, fused.replay, PassKind::forward, 0, 0, 2),
                {.extra = 2, .missing = 0, .duplicate = 0, .query_row = 8, .query_position = 4,
                 .expected = TeKeySet{{2, 0, 3}}, .computed = TeKeySet{{2, 0, 3}, {2, 12, 12}}});
  // Rank 1 step 0: queries at positions 6..12, keys at 4..11; top-left causal gives query i keys 4..4+i, but the
  // truth within owner 1's keys is 4..min(p, 11): 2 missing for each of positions 6..11 and 1 for 12.
  check_finding(find_finding(a, fused.replay, PassKind::forward, 1, 0, 2),
                {.extra = 0, .missing = 13, .expected = TeKeySet{{2, 4, 6}}, .computed = TeKeySet{{2, 4, 4}}});
  // Rank 0 step 1 (upper): Q is chunk 3 only (all pad), so (4,4), (5,4), (5,5) of owner 1's keys are never computed.
  check_finding(find_finding(a, fused.replay, PassKind::forward, 0, 1, 2), {.missing = 3, .query_row = -1});
  // Rank 1 step 1 (lower): K/V chunk 0 only, so query position 12 misses key 12 (chunk 3 of owner 0).
  check_finding(find_finding(a, fused.replay, PassKind::forward, 1, 1, 2),
                {.missing = 1, .expected = TeKeySet{{2, 0, 3}, {2, 12, 12}}});
  // Sequence 0 has one chunk geometry on both sides: exact. Forward total 2 + 13 + 3 + 1.
  int64_t forward = 0;
  for (const TeFinding& f : a.findings) {
    CHECK(f.sequence == 2);
    if (f.pass == PassKind::forward) forward += f.wrong_pairs();
  }
  CHECK(forward == 19);

  // FlashAttention-3, rank 0 step 0: bottom-right with 6 queries and 5 keys shifts every query one key left:
  // queries 0..3 miss their own key (4 missing), query 5 gets position 12 (1 extra).
  const Replayed fa = replay(kGeometry, TeBackend::flash3);
  const TeAudit b = audit_te(fa.spec, fa.replay);
  check_finding(find_finding(b, fa.replay, PassKind::forward, 0, 0, 2),
                {.extra = 1, .missing = 4, .query_row = 4, .query_position = 0, .expected = TeKeySet{{2, 0, 0}},
                 .computed = TeKeySet{}});
}

TEST_CASE("replay: cp-semantics §2.4 worked example, p2p and all_gather") {
  const char* p2p = R"({"seqlens_q": [5, 8], "padded_q": [8, 8], "cp_size": 2, "comm": "p2p", "mask": "causal"})";
  const Replayed r = replay(p2p, TeBackend::fused);
  const TeCall& lower = call(r.replay, PassKind::forward, 1, 1);  // rank 1 step 1, o = 0
  CHECK(lower.cu_seqlens_q == V{0, 3, 7});
  CHECK(lower.cu_seqlens_q_padded == V{0, 4, 8});
  CHECK(lower.cu_seqlens_kv == V{0, 2, 4});
  CHECK(lower.cu_seqlens_kv_padded == V{0, 2, 4});
  const TeCall& upper = call(r.replay, PassKind::forward, 0, 1);  // rank 0 step 1, o = 1
  CHECK(upper.q_tensor == TeTensor::second_half);
  CHECK(upper.cu_seqlens_q == V{0, 0, 2});
  CHECK(upper.cu_seqlens_q_padded == V{0, 2, 4});
  CHECK(upper.cu_seqlens_kv == V{0, 3, 7});
  CHECK(upper.cu_seqlens_kv_padded == V{0, 4, 8});
  CHECK(upper.max_seqlen_q == 16);
  CHECK(upper.max_seqlen_kv == 32);
  CHECK(audit_te(r.spec, r.replay).exact);

  const char* ag = R"({"seqlens_q": [5, 8], "padded_q": [8, 8], "cp_size": 2, "comm": "all_gather", "mask": "causal"})";
  const Replayed g = replay(ag, TeBackend::fused);
  CHECK(g.replay.normalisations.size() == 1);  // padding_causal -> padding_causal_bottom_right
  const TeCall& s0 = call(g.replay, PassKind::forward, 1, 0);
  const TeCall& s1 = call(g.replay, PassKind::forward, 1, 1);
  CHECK(s0.cu_seqlens_q_padded == V{0, 4, 8});
  CHECK(s1.cu_seqlens_q_padded == V{2, 6, 8});
  CHECK(s0.cu_seqlens_q == V{0, 2, 4});
  CHECK(s1.cu_seqlens_q == V{0, 1, 3});
  CHECK(s0.cu_seqlens_kv == V{0, 4, 8});
  CHECK(s1.cu_seqlens_kv == V{0, 5, 11});
  CHECK(s0.cu_seqlens_kv_padded == V{0, 8, 16});
  CHECK(s0.attn_mask_type == "padding_causal_bottom_right");
  CHECK(s0.bottom_right);
  CHECK(s0.max_seqlen_q == 16);   // 64 / (2W)
  CHECK(s0.max_seqlen_kv == 32);  // (chunk 1 + 1) x 16
  CHECK(s1.max_seqlen_kv == 48);
  CHECK(s0.window == Window{-1, 0});
  CHECK(audit_te(g.spec, g.replay).exact);
}

TEST_CASE("replay: a padding mask with window (-1, 0) is full attention in TE, causal in cpgold") {
  // --seqlens-q 4 --window -1,0 --cp-size 2 --comm a2a: cpgold stores mask causal; TE's check_set_window_size turns
  // (-1, 0) under a padding mask into (-1, -1). Each rank computes all 16 pairs of its head group; the truth has 10.
  const char* c = R"({"seqlens_q": [4], "window": [-1, 0], "cp_size": 2, "comm": "a2a"})";
  for (TeBackend b : {TeBackend::fused, TeBackend::flash3}) {
    const Replayed r = replay(c, b);
    CHECK(r.spec.causal);
    REQUIRE(r.replay.normalisations.size() == 1);
    CHECK(r.replay.normalisations[0].source == "utils.py:2673-2677");
    CHECK(r.replay.window_size == Window{-1, -1});
    CHECK(r.replay.attn_mask_type == "padding");
    const TeAudit a = audit_te(r.spec, r.replay);
    REQUIRE(a.findings.size() == 4);  // 2 ranks x 2 passes
    for (const TeFinding& f : a.findings) {
      CHECK(f.extra_pairs == 6);
      CHECK(f.query_position == 0);
      CHECK(f.expected == TeKeySet{{0, 0, 0}});
      CHECK(f.computed == TeKeySet{{0, 0, 3}});
    }
  }
  // The same case written as mask causal: TE keeps it causal, and the replay is exact.
  const Replayed causal = replay(R"({"seqlens_q": [4], "mask": "causal", "cp_size": 2, "comm": "a2a"})", TeBackend::fused);
  CHECK(causal.replay.normalisations.empty());
  CHECK(audit_te(causal.spec, causal.replay).exact);
}

TEST_CASE("replay: TE's refusals with their source lines") {
  struct Refused {
    const char* json;
    TeBackend backend;
    const char* source;
  };
  const Refused cases[] = {
      // Non-causal one-sided windows: cpgold accepts them, check_set_window_size asserts.
      {R"({"seqlens_q": [6], "window": [3, -1], "cp_size": 2, "comm": "a2a"})", TeBackend::fused, "utils.py:2678-2681"},
      {R"({"seqlens_q": [6], "window": [-1, 3], "cp_size": 2, "comm": "a2a"})", TeBackend::flash3, "utils.py:2678-2681"},
      // Causal with (-1, 3): cpgold coerces it to causal, TE asserts.
      {R"({"seqlens_q": [6], "mask": "causal", "window": [-1, 3], "cp_size": 2, "comm": "all_gather"})", TeBackend::fused,
       "utils.py:2666-2669"},
      // Sliding windows on p2p: the fused backend is filtered out, FlashAttention-3 reaches the CP assert.
      {R"({"seqlens_q": [6], "mask": "causal", "window": [2, 0], "cp_size": 2, "comm": "p2p"})", TeBackend::fused,
       "utils.py:1261-1271"},
      {R"({"seqlens_q": [6], "mask": "causal", "window": [2, 0], "cp_size": 2, "comm": "p2p"})", TeBackend::flash3,
       "context_parallel.py:5054-5061"},
      {R"({"seqlens_q": [6], "window": [1, 1], "cp_size": 4, "comm": "a2a+p2p", "a2a_size": 2})", TeBackend::flash3,
       "context_parallel.py:5054-5061"},
      // Causal with other padded maxima (64 and 128 after rounding): cross-attention to TE.
      {R"({"seqlens_q": [6], "padded_q": [8], "padded_kv": [72], "mask": "causal", "cp_size": 2, "comm": "p2p"})",
       TeBackend::fused, "utils.py:1221-1226"},
      {R"({"seqlens_q": [6], "padded_q": [8], "padded_kv": [72], "mask": "causal", "cp_size": 2, "comm": "p2p"})",
       TeBackend::flash3, "utils.py:1195-1200"},
      {R"({"seqlens_q": [6], "dtype": "fp32", "cp_size": 2})", TeBackend::fused, "utils.py:628-645"},
      {R"({"seqlens_q": [6], "dtype": "fp32", "cp_size": 2})", TeBackend::flash3, "utils.py:614-627"},
      {R"({"seqlens_q": [6], "heads_q": 3, "cp_size": 2, "comm": "a2a+p2p", "a2a_size": 1})", TeBackend::fused,
       "utils.py:1272-1280"},
  };
  for (const Refused& c : cases) {
    const std::string json_text = c.json;
    CAPTURE(json_text);
    const Replayed r = replay(c.json, c.backend);
    REQUIRE(r.replay.refusal);
    CHECK(r.replay.refusal->source == c.source);
    CHECK(r.replay.forward.empty());
    CHECK(audit_te(r.spec, r.replay).refused);
  }
  CHECK_THROWS_AS(replay(R"({"seqlens_q": [6], "cp_size": 1})", TeBackend::fused), InputError);
}

TEST_CASE("replay: a2a+p2p with a group of one runs as p2p or a2a") {
  const Replayed as_a2a = replay(R"({"seqlens_q": [7, 3], "mask": "causal", "cp_size": 4, "comm": "a2a+p2p", "a2a_size": 4})",
                                 TeBackend::fused);
  CHECK(as_a2a.replay.comm == CommType::a2a);
  CHECK(as_a2a.replay.forward.size() == 4);
  CHECK(as_a2a.replay.normalisations.at(0).source == "context_parallel.py:5027-5032");
  const Replayed as_p2p = replay(R"({"seqlens_q": [7, 3], "mask": "causal", "cp_size": 2, "comm": "a2a+p2p", "a2a_size": 1})",
                                 TeBackend::flash3);
  CHECK(as_p2p.replay.comm == CommType::p2p);
  CHECK(as_p2p.replay.forward.size() == 4);
  const Replayed ring = replay(R"({"seqlens_q": [7, 3], "mask": "causal", "cp_size": 4, "comm": "a2a+p2p", "a2a_size": 2})",
                               TeBackend::fused);
  CHECK(ring.replay.comm == CommType::a2a_p2p);
  // Rank 3 = ring rank 1, a2a index 1: heads [2, 4); its step 1 reads the KV of ring rank 0, global rank 1.
  const TeCall& c = call(ring.replay, PassKind::forward, 3, 1);
  CHECK(c.kv_owner == 1);
  CHECK(c.head_begin == 2);
  CHECK(c.head_end == 4);
  CHECK(c.section == "lower-triangle");
  CHECK(audit_te(ring.spec, ring.replay).exact);
}
