// The visible-pairs audit (sim/te/te_audit.hpp) on small layouts whose findings were worked out by hand: all_gather's
// non-causal window under each backend's alignment, the pad_between_seqs=False shortcut (a pad query row, rows never
// computed), exact replays with zero-length, one-token and padded sequences on every comm type.
#include <doctest/doctest.h>

#include <string>

#include "sim/te/te_audit.hpp"
#include "tests/sim/te_findings.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::sim::testing;

namespace {
using json = nlohmann::json;

struct Audited {
  CaseSpec spec;
  TeReplay replay;
  TeAudit audit;
};
Audited audit(const std::string& case_json, TeBackend backend, bool pad_between_seqs = true) {
  const json o = json::parse(case_json);
  Audited a{parse_case(o), {}, {}};
  a.replay = replay_te(a.spec, te_user_arguments(o), backend, pad_between_seqs);
  a.audit = audit_te(a.spec, a.replay);
  return a;
}
const TeFinding* finding(const Audited& a, PassKind pass, int rank, int step) {
  return find_finding(a.audit, a.replay, pass, rank, step);
}
int64_t forward_wrong(const Audited& a) {
  int64_t n = 0;
  for (const TeFinding& f : a.audit.findings) n += f.pass == PassKind::forward ? f.wrong_pairs() : 0;
  return n;
}

// --seqlens-q 2 --padded-q 4 --window 0,3 --cp-size 2 --comm all_gather: chunks of one row; max_seqlen 64 / 4 = 16.
// Per step TE passes window (3, 0): get_kv_seq_info_after_all_gather with chunk end 16 (32) and wr 3 gives end
// 19 (35), right 0, left 0 + 3; the key counts are min(2, 1 (2) + 3) = 2. Query position 0 (rank 0, chunk 0) and
// position 1 (rank 1, chunk 1) each form a one-row sequence of the call against keys 0..1; the truth is keys 0..1 for
// position 0 and key 1 for position 1.
const char* kWindowedAllGather = R"({"seqlens_q": [2], "padded_q": [4], "window": [0, 3], "cp_size": 2, "comm": "all_gather"})";

}  // namespace

TEST_CASE("audit: all_gather non-causal window, cuDNN top-left alignment") {
  const Audited a = audit(kWindowedAllGather, TeBackend::fused);
  REQUIRE_FALSE(a.audit.refused);
  CHECK(a.replay.forward.at(0).window == Window{3, 0});
  CHECK_FALSE(a.replay.forward.at(0).bottom_right);  // mask padding: fused_attn.py's default is top-left
  // Top-left, query 0 of the call sees keys [0 - 3, 0] = key 0 only.
  check_finding(finding(a, PassKind::forward, 0, 0),
                {.extra = 0, .missing = 1, .expected = TeKeySet{{0, 0, 1}}, .computed = TeKeySet{{0, 0, 0}}});
  check_finding(finding(a, PassKind::forward, 1, 0),
                {.extra = 1, .missing = 1, .query_position = 1, .expected = TeKeySet{{0, 1, 1}},
                 .computed = TeKeySet{{0, 0, 0}}});
  CHECK(forward_wrong(a) == 3);
  CHECK(a.audit.wrong_pairs == 6);  // the backward replays the same calls
}

TEST_CASE("audit: all_gather non-causal window, FlashAttention-3 bottom-right alignment") {
  // Bottom-right with 1 query and 2 keys: the diagonal is key 1, the window (3, 0) gives keys 0..1 to both calls:
  // right for position 0, one extra key for position 1.
  const Audited a = audit(kWindowedAllGather, TeBackend::flash3);
  CHECK(finding(a, PassKind::forward, 0, 0) == nullptr);
  check_finding(finding(a, PassKind::forward, 1, 0),
                {.extra = 1, .missing = 0, .query_row = 0, .expected = TeKeySet{{0, 1, 1}},
                 .computed = TeKeySet{{0, 0, 1}}});
  CHECK(forward_wrong(a) == 1);
}

TEST_CASE("audit: the pad_between_seqs=False shortcut on p2p, a pad query row and rows never computed") {
  // --seqlens-q 5 --cp-size 2 --comm p2p --mask causal: C = 2; rank 0 holds positions 0,1 (and pad 6,7), rank 1
  // positions 2,3 and 4 (pad 5). The shortcut counts are cu // 2 = 2 and cu // 4 = 1 everywhere.
  const Audited a = audit(R"({"seqlens_q": [5], "cp_size": 2, "comm": "p2p", "mask": "causal"})", TeBackend::fused, false);
  CHECK(finding(a, PassKind::forward, 0, 0) == nullptr);  // 2 queries, 2 keys: the exact counts
  // Rank 0 step 1 (upper, owner 1): one query row of read_half(q, 1), position 6, a pad row, against keys 2, 3.
  check_finding(finding(a, PassKind::forward, 0, 1),
                {.extra = 2, .query_row = 0, .query_position = 6, .expected = TeKeySet{},
                 .computed = TeKeySet{{0, 2, 3}}});
  // Rank 1 step 0 (diagonal): 2 query rows (positions 2, 3): position 4 is never computed against keys 2..4.
  check_finding(finding(a, PassKind::forward, 1, 0),
                {.missing = 3, .query_row = -1, .query_position = 4, .expected = TeKeySet{{0, 2, 4}}});
  // Rank 1 step 1 (lower, owner 0): one key row (position 0) instead of two: positions 2, 3 miss key 1, position 4
  // misses keys 0 and 1.
  check_finding(finding(a, PassKind::forward, 1, 1),
                {.missing = 4, .query_position = 2, .expected = TeKeySet{{0, 0, 1}}, .computed = TeKeySet{{0, 0, 0}}});
  CHECK(forward_wrong(a) == 9);
  // FlashAttention with the shortcut reads cu_seqlens as the padded offsets: this layout has padding, so every row is
  // misread; the audit says so instead of mapping rows.
  const Audited f = audit(R"({"seqlens_q": [5], "cp_size": 2, "comm": "p2p", "mask": "causal"})", TeBackend::flash3, false);
  CHECK(f.audit.misread);
  CHECK_FALSE(f.audit.exact);
  // Without any padding the shortcut is exact on both backends.
  for (TeBackend b : {TeBackend::fused, TeBackend::flash3})
    CHECK(audit(R"({"seqlens_q": [8, 4], "cp_size": 2, "comm": "p2p", "mask": "causal"})", b, false).audit.exact);
}

TEST_CASE("audit: exact replays with zero-length, one-token and padded sequences") {
  const char* cases[] = {
      R"({"seqlens_q": [0, 1, 5, 2], "padded_q": [0, 4, 12, 4], "padded_kv": [0, 4, 12, 4], "cp_size": 2, "comm": "p2p", "mask": "causal"})",
      R"({"seqlens_q": [0, 1, 7, 3], "padded_q": [0, 6, 12, 6], "cp_size": 3, "comm": "p2p", "mask": "causal"})",
      R"({"seqlens_q": [1, 0, 9], "seqlens_kv": [4, 2, 1], "cp_size": 4, "comm": "p2p"})",
      R"({"seqlens_q": [0, 1, 5, 2], "padded_q": [0, 4, 12, 4], "cp_size": 2, "comm": "a2a", "mask": "causal", "window": [2, 0]})",
      R"({"seqlens_q": [0, 1, 5, 2], "padded_q": [0, 4, 12, 4], "cp_size": 2, "comm": "a2a", "window": [1, 2]})",
      R"({"seqlens_q": [0, 1, 9, 2], "cp_size": 4, "comm": "all_gather", "mask": "causal", "window": [3, 0]})",
      R"({"seqlens_q": [0, 1, 9, 2], "cp_size": 4, "comm": "a2a+p2p", "a2a_size": 2, "mask": "causal"})",
  };
  for (const std::string c : cases)
    for (TeBackend b : {TeBackend::fused, TeBackend::flash3}) {
      CAPTURE(c);
      CAPTURE(te_backend_name(b));
      const Audited a = audit(c, b);
      REQUIRE_FALSE(a.audit.refused);
      CHECK(a.audit.exact);
      CHECK(a.audit.wrong_pairs == 0);
    }
}

TEST_CASE("audit: key set text marks pad rows and other sequences") {
  const Audited a = audit(R"({"seqlens_q": [2, 3], "padded_q": [4, 4], "cp_size": 2})", TeBackend::fused);
  CHECK(te_key_set_text({{0, 0, 3}}, a.replay.global, 0) == "0..1, 2..3 (pad)");
  CHECK(te_key_set_text({{1, 2, 2}}, a.replay.global, 0) == "s1:2");
  CHECK(te_key_set_text({{-1, 5, 6}}, a.replay.global, 0) == "rows 5..6 (no token)");
  CHECK(te_key_set_text({}, a.replay.global, 0) == "{}");
}
