// Host-only checks of the GPU layer: capability table and tile lists (no device needed).
#include <doctest/doctest.h>

#include <vector>

#include "gpu/kernels/attention/attention.hpp"
#include "gpu/kernels/attention/attention_plan_impl.hpp"
#include "reference/attention_call.hpp"
#include "reference/thd_layout.hpp"

using namespace cpgold;
using namespace cpgold::gpu;

TEST_CASE("capability table: supported shapes pass, others are unsupported with the reason") {
  struct Row {
    AttentionShape shape;
    Status status;
    const char* reason;  // a part of the message, or nullptr
  };
  const Row rows[] = {
      {{DType::bf16, 4, 2, 64, 64}, Status::ok, nullptr},
      {{DType::fp16, 4, 1, 128, 128}, Status::ok, nullptr},
      {{DType::bf16, 8, 8, 192, 128}, Status::ok, nullptr},
      {{DType::fp32, 4, 4, 128, 128}, Status::unsupported, "fp32"},
      {{DType::bf16, 4, 4, 32, 32}, Status::ok, nullptr},
      {{DType::fp16, 4, 4, 96, 96}, Status::ok, nullptr},
      {{DType::bf16, 4, 2, 256, 256}, Status::ok, nullptr},
      {{DType::bf16, 4, 4, 80, 80}, Status::unsupported, "d_qk=80"},
      {{DType::bf16, 4, 4, 256, 128}, Status::unsupported, nullptr},
      {{DType::bf16, 4, 4, 16, 16}, Status::unsupported, nullptr},
      {{DType::bf16, 4, 4, 128, 64}, Status::ok, nullptr},  // TransformerEngine's fused CP MLA configuration
      {{DType::bf16, 4, 4, 64, 128}, Status::unsupported, nullptr},
      {{DType::bf16, 6, 4, 128, 128}, Status::invalid_argument, nullptr},
  };
  for (const Row& row : rows) {
    INFO(dtype_name(row.shape.dtype) << ", heads " << row.shape.heads_q << "/" << row.shape.heads_kv << ", d_qk "
         << row.shape.dim_qk << ", d_v " << row.shape.dim_v);
    const Outcome outcome = check_capability(row.shape);
    CHECK(outcome.status == row.status);
    if (row.reason) CHECK(outcome.message.find(row.reason) != std::string::npos);
  }
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

namespace {
AttentionCall one_sequence_call(int32_t len_q, int32_t len_kv, int32_t q_position, Window window) {
  AttentionCall call;
  call.window = window;
  call.softmax_scale = 0.1;
  call.q_rows = len_q + 3;  // three pad rows after the segment
  call.kv_rows = len_kv;
  SequenceTile s;
  s.length_q = q_position + len_q;
  s.length_kv = len_kv;
  s.q = {{0, len_q, q_position}};
  s.kv = {{0, len_kv, 0}};
  call.sequences = {s};
  return call;
}
}  // namespace

// docs/gpu-kernels.md, "Forward schedules": tile orders (heaviest first within a sequence, pad tiles last) and the
// score areas behind the padding-waste rule, worked out by hand.
TEST_CASE("Q tile work: heaviest-first orders and score areas of both tile heights") {
  // Causal, 256 rows at positions 0..255 (delta 0). 128-row tiles with key tiles of 128: tile 0 sees keys 0..127
  // (1 block), tile 1 keys 0..255 (2 blocks); area (1 + 2) x 128 x 128. 64-row tiles with key tiles of 64: 1 + 2 +
  // 3 + 4 blocks of 64 x 64.
  const PlanTiles tiles = make_plan_tiles(one_sequence_call(256, 256, 0, {-1, 0}));
  REQUIRE(tiles.q_tiles_large.size() == 3);  // two work tiles, one pad tile
  REQUIRE(tiles.q_tiles_small.size() == 5);
  const QTileWork w = q_tile_work(tiles, {-1, 0}, 64, 128);
  CHECK(w.order_large == std::vector<int32_t>{1, 0, 2});
  CHECK(w.order_small == std::vector<int32_t>{3, 2, 1, 0, 4});
  CHECK(w.area_large == 3.0 * 128 * 128);
  CHECK(w.area_small == 10.0 * 64 * 64);
  // A 32-row chunk on the diagonal at position 1000 of a 1032-key sequence: 128-row tiles compute one 128 x 128
  // block per KV block the chunk sees, 64-row tiles one 64 x 64 block: keys 0..1031 are 9 blocks of 128 (0..1151)
  // and 17 of 64; the waste rule picks the 64-row tiles.
  const PlanTiles chunk = make_plan_tiles(one_sequence_call(32, 1032, 1000, {-1, 0}));
  const QTileWork c = q_tile_work(chunk, {-1, 0}, 64, 128);
  CHECK(c.area_large == 9.0 * 128 * 128);
  CHECK(c.area_small == 17.0 * 64 * 64);
  CHECK(c.area_large > kSmallTileAreaFactor * c.area_small);
  // A window (left 100) on the same chunk: keys 900..1031, blocks 7..8 of 128 and 14..16 of 64.
  const QTileWork win = q_tile_work(chunk, {100, 0}, 64, 128);
  CHECK(win.area_large == 2.0 * 128 * 128);
  CHECK(win.area_small == 3.0 * 64 * 64);
  // A whole sequence of 4096 rows, no mask: the same area at both heights (no padding waste), so 128-row tiles.
  const QTileWork full = q_tile_work(make_plan_tiles(one_sequence_call(4096, 4096, 0, {-1, -1})), {-1, -1}, 64, 128);
  CHECK(full.area_large == full.area_small);
  CHECK_FALSE(full.area_large > kSmallTileAreaFactor * full.area_small);
}

// The persistent order keeps each sequence's tiles together (its K and V stay in L2 while they run), sequences
// heaviest first. Causal, sequence A of 256 rows (64-row tiles 0..3: 64, 128, 192, 256 visible keys), then sequence B
// of 128 rows (tiles 4, 5: 64 and 128 keys), then a pad tile. A global heaviest-first order would put B's tile 5
// (128 keys) before A's tile 0 (64 keys): {3, 2, 1, 5, 0, 4, 6}.
TEST_CASE("Q tile work: the persistent order keeps a sequence's tiles together, sequences heaviest first") {
  // A sequence of `len` rows at rows first.. of both Q and KV.
  auto sequence_at = [](int32_t first, int32_t len) {
    SequenceTile t;
    t.length_q = t.length_kv = len;
    t.q = {{first, len, 0}};
    t.kv = {{first, len, 0}};
    return t;
  };
  AttentionCall call;
  call.window = {-1, 0};
  call.softmax_scale = 0.1;
  call.q_rows = 256 + 128 + 3;
  call.kv_rows = 256 + 128;
  call.sequences = {sequence_at(0, 256), sequence_at(256, 128)};
  const PlanTiles tiles = make_plan_tiles(call);
  REQUIRE(tiles.q_tiles_small.size() == 7);
  const QTileWork w = q_tile_work(tiles, call.window, 64, 128);
  CHECK(w.order_small == std::vector<int32_t>{3, 2, 1, 0, 5, 4, 6});
  // B first when it is the heavier: the same two sequences the other way round in the rows.
  call.sequences = {sequence_at(0, 128), sequence_at(128, 256)};
  const QTileWork r = q_tile_work(make_plan_tiles(call), call.window, 64, 128);
  CHECK(r.order_small == std::vector<int32_t>{5, 4, 3, 2, 1, 0, 6});
}

TEST_CASE("forward schedules: names parse back, unknown names are refused") {
  for (ForwardSchedule s : {ForwardSchedule::automatic, ForwardSchedule::tile128, ForwardSchedule::tile64,
                            ForwardSchedule::persistent, ForwardSchedule::persistent128, ForwardSchedule::persistent64}) {
    CHECK(parse_forward_schedule(forward_schedule_name(s)) == s);
  }
  CHECK(parse_forward_schedule("automatic") == ForwardSchedule::automatic);
  CHECK_FALSE(parse_forward_schedule("tile96").has_value());
  CHECK_FALSE(parse_forward_schedule("").has_value());
  CHECK(wgmma_short_schedules_serve({DType::bf16, 2, 2, 192, 128}));
  CHECK_FALSE(wgmma_short_schedules_serve({DType::bf16, 2, 2, 256, 256}));
  // An unbuilt plan has no schedule.
  ForwardScheduleChoice choice;
  CHECK(forward_schedule_for(AttentionPlan{}, ForwardSchedule::tile64, choice).status == Status::invalid_argument);
}
