// The backends' mask rules (sim/te/te_kernel_mask.hpp) on single calls, against key sets worked out by hand from the
// documented semantics: cuDNN with top-left and bottom-right alignment, windows on either side, FlashAttention-3's
// normalisation of the window and of causal, empty and one-row sequences, rows past the counts.
#include <doctest/doctest.h>

#include <vector>

#include "sim/te/te_kernel_mask.hpp"

using namespace cpgold;
using namespace cpgold::sim;

namespace {

TeCall fused_call(const std::string& mask, Window w, bool bottom_right, int32_t max_q = 64, int32_t max_kv = 64) {
  TeCall c;
  c.attn_mask_type = mask;
  c.causal = mask.find("causal") != std::string::npos;
  c.window = w;
  c.bottom_right = bottom_right;
  c.max_seqlen_q = max_q;
  c.max_seqlen_kv = max_kv;
  return c;
}

TeCall flash3_call(bool causal, Window w, int32_t max_q = 64, int32_t max_kv = 64) {
  TeCall c;
  c.causal = causal;
  c.window = w;
  c.bottom_right = true;
  c.max_seqlen_q = max_q;
  c.max_seqlen_kv = max_kv;
  return c;
}

// [first, last] of every query of a sequence with q_count queries and kv_count keys; {1, 0} for none.
std::vector<std::pair<int64_t, int64_t>> rows(const TeCall& c, TeBackend backend, int64_t q_count, int64_t kv_count) {
  const TeKernelMask m = te_kernel_mask(c, backend);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < q_count; ++i) {
    const TeKeyRange k = te_visible_keys(m, i, q_count, kv_count);
    out.push_back(k.empty() ? std::pair<int64_t, int64_t>{1, 0} : std::pair<int64_t, int64_t>{k.first, k.last});
  }
  return out;
}

using R = std::vector<std::pair<int64_t, int64_t>>;
const std::pair<int64_t, int64_t> none{1, 0};

}  // namespace

TEST_CASE("cuDNN: top-left causal (padding_causal, bottom_right_diagonal False)") {
  // 3 queries, 5 keys: query i sees keys 0..i (the diagonal starts at the top-left corner).
  CHECK(rows(fused_call("padding_causal", {-1, -1}, false), TeBackend::fused, 3, 5) == R{{0, 0}, {0, 1}, {0, 2}});
  // More queries than keys: row 3 still sees 0..3, rows past the keys are clipped to the 2 keys.
  CHECK(rows(fused_call("padding_causal", {-1, -1}, false), TeBackend::fused, 4, 2) == R{{0, 0}, {0, 1}, {0, 1}, {0, 1}});
}

TEST_CASE("cuDNN: bottom-right causal (padding_causal_bottom_right)") {
  // 3 queries, 5 keys: the diagonal of query i is i + 5 - 3.
  CHECK(rows(fused_call("padding_causal_bottom_right", {-1, 0}, true), TeBackend::fused, 3, 5) == R{{0, 2}, {0, 3}, {0, 4}});
  // 4 queries, 2 keys: the first two queries see nothing.
  CHECK(rows(fused_call("padding_causal_bottom_right", {-1, 0}, true), TeBackend::fused, 4, 2) == R{none, none, {0, 0}, {0, 1}});
}

TEST_CASE("cuDNN: padding mask, windows on both sides, both alignments") {
  // Window (1, 2) top-left: keys i-1..i+2 within 0..5.
  CHECK(rows(fused_call("padding", {1, 2}, false), TeBackend::fused, 4, 6) == R{{0, 2}, {0, 3}, {1, 4}, {2, 5}});
  // Same window bottom-right (3 queries, 6 keys: diagonal i + 3): keys i+2..i+5 within 0..5.
  CHECK(rows(fused_call("padding", {1, 2}, true), TeBackend::fused, 3, 6) == R{{2, 5}, {3, 5}, {4, 5}});
  // Left side only: a causal mask with window (2, 0): keys i-2..i.
  CHECK(rows(fused_call("padding_causal", {2, 0}, false), TeBackend::fused, 4, 4) == R{{0, 0}, {0, 1}, {0, 2}, {1, 3}});
  // Right side only on a padding mask: (-1, 1) is not a causal mask: keys 0..i+1.
  CHECK(rows(fused_call("padding", {-1, 1}, false), TeBackend::fused, 3, 3) == R{{0, 1}, {0, 2}, {0, 2}});
  // No mask at all: every key.
  CHECK(rows(fused_call("padding", {-1, -1}, false), TeBackend::fused, 2, 3) == R{{0, 2}, {0, 2}});
  // A causal mask with an explicit right bound: the window's right side replaces the causal 0.
  CHECK(rows(fused_call("padding_causal", {-1, 1}, false), TeBackend::fused, 3, 4) == R{{0, 1}, {0, 2}, {0, 3}});
}

TEST_CASE("cuDNN and FlashAttention-3: empty and one-row sequences, rows past the counts") {
  for (TeBackend b : {TeBackend::fused, TeBackend::flash3}) {
    const TeCall c = b == TeBackend::fused ? fused_call("padding_causal", {-1, -1}, false) : flash3_call(true, {-1, 0});
    CHECK(rows(c, b, 0, 5).empty());
    CHECK(rows(c, b, 3, 0) == R{none, none, none});
    CHECK(rows(c, b, 1, 1) == R{{0, 0}});
    // A query index at or past q_count is not a computed row (padding).
    CHECK(te_visible_keys(te_kernel_mask(c, b), 3, 3, 5).empty());
  }
  // One key, three queries: top-left gives every query key 0; bottom-right only the last one.
  CHECK(rows(fused_call("padding_causal", {-1, -1}, false), TeBackend::fused, 3, 1) == R{{0, 0}, {0, 0}, {0, 0}});
  CHECK(rows(flash3_call(true, {-1, 0}), TeBackend::flash3, 3, 1) == R{none, none, {0, 0}});
}

TEST_CASE("FlashAttention-3: bottom-right causal and local windows with the used lengths") {
  CHECK(rows(flash3_call(true, {-1, 0}), TeBackend::flash3, 3, 5) == R{{0, 2}, {0, 3}, {0, 4}});
  CHECK(rows(flash3_call(true, {-1, 0}), TeBackend::flash3, 5, 2) == R{none, none, none, {0, 0}, {0, 1}});
  // Local (2, 1), 3 queries and 5 keys: diagonal i + 2, keys i..i+3 within 0..4.
  CHECK(rows(flash3_call(false, {2, 1}), TeBackend::flash3, 3, 5) == R{{0, 3}, {1, 4}, {2, 4}});
  // causal=True with a left window: local (1, 0).
  CHECK(rows(flash3_call(true, {1, -1}), TeBackend::flash3, 3, 3) == R{{0, 0}, {0, 1}, {1, 2}});
}

TEST_CASE("FlashAttention-3: window normalisation against max_seqlen") {
  // A left side >= max_seqlen_k - 1 becomes -1: with max_seqlen_kv 4 the window (3, 0) is plain causal.
  CHECK(te_kernel_mask(flash3_call(false, {3, 0}, 8, 4), TeBackend::flash3).left == -1);
  CHECK(rows(flash3_call(false, {3, 0}, 8, 4), TeBackend::flash3, 4, 4) == R{{0, 0}, {0, 1}, {0, 2}, {0, 3}});
  // Below the bound it stays: (2, 0) with max_seqlen_kv 4.
  CHECK(rows(flash3_call(false, {2, 0}, 8, 4), TeBackend::flash3, 4, 4) == R{{0, 0}, {0, 1}, {0, 2}, {1, 3}});
  // A local window's -1 side becomes max_seqlen - 1: (1, -1) with max_seqlen_q 2 has right side 1.
  CHECK(te_kernel_mask(flash3_call(false, {1, -1}, 2, 8), TeBackend::flash3).right == 1);
  CHECK(rows(flash3_call(false, {1, -1}, 2, 8), TeBackend::flash3, 2, 4) == R{{1, 3}, {2, 3}});
  // max_seqlen_q == 1 without a window switches causal off: with two used rows (a broken contract) row 0 then sees
  // every key instead of keys 0..1.
  CHECK(rows(flash3_call(true, {-1, -1}, 1, 8), TeBackend::flash3, 2, 3) == R{{0, 2}, {0, 2}});
  CHECK(rows(flash3_call(true, {-1, -1}, 2, 8), TeBackend::flash3, 2, 3) == R{{0, 1}, {0, 2}});
}
