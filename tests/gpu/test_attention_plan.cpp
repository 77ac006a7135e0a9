// Host-only checks of the GPU layer: capability table and tile lists (no device needed).
#include <doctest/doctest.h>

#include <vector>

#include "gpu/kernels/attention.hpp"
#include "gpu/kernels/attention_plan_impl.hpp"
#include "reference/attention_call.hpp"
#include "reference/thd_layout.hpp"

using namespace cpgold;
using namespace cpgold::gpu;

TEST_CASE("capability table: supported shapes pass, others are unsupported with the reason") {
  CHECK(check_capability({DType::bf16, 4, 2, 64, 64}).ok());
  CHECK(check_capability({DType::fp16, 4, 1, 128, 128}).ok());
  CHECK(check_capability({DType::bf16, 8, 8, 192, 128}).ok());
  const Outcome fp32 = check_capability({DType::fp32, 4, 4, 128, 128});
  CHECK(fp32.status == Status::unsupported);
  CHECK(fp32.message.find("fp32") != std::string::npos);
  CHECK(check_capability({DType::bf16, 4, 4, 32, 32}).ok());
  CHECK(check_capability({DType::fp16, 4, 4, 96, 96}).ok());
  CHECK(check_capability({DType::bf16, 4, 2, 256, 256}).ok());
  const Outcome d80 = check_capability({DType::bf16, 4, 4, 80, 80});
  CHECK(d80.status == Status::unsupported);
  CHECK(d80.message.find("d_qk=80") != std::string::npos);
  CHECK(check_capability({DType::bf16, 4, 4, 256, 128}).status == Status::unsupported);
  CHECK(check_capability({DType::bf16, 4, 4, 16, 16}).status == Status::unsupported);
  CHECK(check_capability({DType::bf16, 4, 4, 128, 64}).ok());  // TransformerEngine's fused CP MLA configuration
  CHECK(check_capability({DType::bf16, 4, 4, 64, 128}).status == Status::unsupported);
  CHECK(check_capability({DType::bf16, 6, 4, 128, 128}).status == Status::invalid_argument);
  // An unsupported shape never builds a plan (no silent fallback).
  AttentionPlan plan;
  ThdLayout layout{make_packed_sequences({5}, {}, -1, "q"), make_packed_sequences({5}, {}, -1, "kv")};
  CHECK(plan.build(non_cp_call(layout, {}, 0.1), {DType::fp32, 1, 1, 128, 128}).status == Status::unsupported);
  CHECK(plan.impl() == nullptr);
}

namespace {
// Every row of [0, total) is covered by exactly one tile; work tiles stay inside their segment.
void check_cover(const std::vector<RowTile>& tiles, int64_t total, int tile_rows, const AttentionCall& call,
                 bool q_side) {
  std::vector<int> hits(static_cast<size_t>(total), 0);
  for (const RowTile& t : tiles) {
    CHECK(t.rows > 0);
    CHECK(t.rows <= tile_rows);
    for (int64_t r = t.first_row; r < t.first_row + t.rows; ++r) ++hits[static_cast<size_t>(r)];
    if (t.sequence >= 0) {
      const SequenceTile& seq = call.sequences[static_cast<size_t>(t.sequence)];
      const RowSegment& s = q_side ? seq.q[static_cast<size_t>(t.segment)] : seq.kv[static_cast<size_t>(t.segment)];
      CHECK(t.first_row >= s.first_row);
      CHECK(t.first_row + t.rows <= s.first_row + s.count);
      CHECK(t.position == s.position + (t.first_row - s.first_row));
    }
  }
  for (int64_t r = 0; r < total; ++r) CHECK(hits[static_cast<size_t>(r)] == 1);
}
}  // namespace

TEST_CASE("tile lists cover every row once: work tiles in segments, pad tiles elsewhere") {
  ThdLayout layout{make_packed_sequences({0, 1, 64, 65, 130}, {3, 8, 64, 70, 140}, 300, "q"),
                   make_packed_sequences({7, 0, 64, 200, 1}, {7, 2, 70, 200, 9}, 299, "kv")};
  const AttentionCall call = non_cp_call(layout, {-1, 0}, 0.125);
  const PlanTiles tiles = make_plan_tiles(call);
  CHECK(tiles.sequences.size() == 5);
  check_cover(tiles.q_tiles_small, call.q_rows, kSmallTileRows, call, true);
  check_cover(tiles.q_tiles_large, call.q_rows, kLargeTileRows, call, true);
  check_cover(tiles.kv_tiles, call.kv_rows, kKvTileRows, call, false);

  // A CP-style call: two Q segments at positions 0 and 225 of a 300-token sequence.
  AttentionCall cp;
  cp.window = {-1, 0};
  cp.softmax_scale = 0.1;
  cp.q_rows = 160;
  cp.kv_rows = 310;
  SequenceTile seq;
  seq.length_q = seq.length_kv = 300;
  seq.q = {{0, 75, 0}, {80, 75, 225}};
  seq.kv = {{0, 150, 0}, {152, 150, 150}};
  cp.sequences.push_back(seq);
  const PlanTiles cp_tiles = make_plan_tiles(cp);
  check_cover(cp_tiles.q_tiles_small, cp.q_rows, kSmallTileRows, cp, true);
  check_cover(cp_tiles.kv_tiles, cp.kv_rows, kKvTileRows, cp, false);

  // leave_kv: the same work tiles on both sides, the same Q pad tiles, no KV pad tile.
  const PlanTiles left = make_plan_tiles(cp, {.leave_q = false, .leave_kv = true});
  CHECK(left.q_tiles_small.size() == cp_tiles.q_tiles_small.size());
  size_t work = 0;
  for (const RowTile& t : cp_tiles.kv_tiles) work += t.sequence >= 0;
  CHECK(work < cp_tiles.kv_tiles.size());  // the call has KV pad rows, so `write` made pad tiles
  REQUIRE(left.kv_tiles.size() == work);
  for (const RowTile& t : left.kv_tiles) CHECK(t.sequence >= 0);
  // leave_q: no Q pad tile in either list, the K/V side as with `write`.
  const PlanTiles left_q = make_plan_tiles(cp, {.leave_q = true, .leave_kv = false});
  for (const auto* list : {&left_q.q_tiles_small, &left_q.q_tiles_large}) {
    CHECK(!list->empty());
    for (const RowTile& t : *list) CHECK(t.sequence >= 0);
  }
  size_t q_work = 0;
  for (const RowTile& t : cp_tiles.q_tiles_small) q_work += t.sequence >= 0;
  CHECK(left_q.q_tiles_small.size() == q_work);
  CHECK(q_work < cp_tiles.q_tiles_small.size());
  CHECK(left_q.kv_tiles.size() == cp_tiles.kv_tiles.size());
}

TEST_CASE("overlapping KV rows of two sequences are rejected") {
  AttentionCall call;
  call.softmax_scale = 0.1;
  call.q_rows = 20;
  call.kv_rows = 20;
  SequenceTile a, b;
  a.length_q = a.length_kv = 10;
  a.q = {{0, 10, 0}};
  a.kv = {{0, 10, 0}};
  b.length_q = b.length_kv = 10;
  b.q = {{10, 10, 0}};
  b.kv = {{5, 10, 0}};
  call.sequences = {a, b};
  CHECK_THROWS_AS(make_plan_tiles(call), std::invalid_argument);
  // Checked without pad tiles too.
  CHECK_THROWS_AS(make_plan_tiles(call, {.leave_q = true, .leave_kv = true}), std::invalid_argument);
}
