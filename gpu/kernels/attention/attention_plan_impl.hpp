#pragma once
// Inside of AttentionPlan, shared by the plan builder and the launchers.
#include <cstdint>
#include <vector>

#include "gpu/kernels/attention/attention.hpp"
#include "gpu/kernels/attention/kernel_params.hpp"

namespace cpgold::gpu {

// Tile heights the kernels are built for. Q tiles come in two heights (forward launches may use either); KV tiles
// in two (the mma.sync backward uses the 64-row list, the sm_90a wgmma backward the 128-row one).
inline constexpr int kSmallTileRows = 64;
inline constexpr int kLargeTileRows = 128;
inline constexpr int kKvTileRows = 64;
inline constexpr int kLargeKvTileRows = 128;

// Host half of the plan: what build() computes before uploading (also what host-only tests inspect).
struct PlanTiles {
  std::vector<SequenceDesc> sequences;
  std::vector<RowTile> q_tiles_small, q_tiles_large, kv_tiles, kv_tiles_large;
};

// Work of the Q tile lists for the wgmma forward's schedules (gpu/kernels/attention/forward_kernel.cpp): per list, the tile
// order of the persistent grid (sequences heaviest first by the visible keys of their tiles, ties in sequence order;
// each sequence's tiles together, heaviest first within it, ties in list order; pad tiles last), and the
// score area each tile height computes: sum over work tiles of (key blocks the tile visits) x tile rows x key tile
// rows, with the key tile of that height's configuration (key_tile_large for 128-row tiles, key_tile_small for
// 64-row tiles). Rows past a segment's end and masked parts of key blocks are computed all the same, so the ratio of
// the two areas is the padding waste that the choice of tile height decides.
struct QTileWork {
  std::vector<int32_t> order_small, order_large;
  double area_small = 0, area_large = 0;
};
QTileWork q_tile_work(const PlanTiles& tiles, Window window, int key_tile_small, int key_tile_large);

// Splits the call into sequence descriptors and tile lists (work tiles per segment, pad tiles over the rest).
// Throws std::invalid_argument when KV rows of two sequences overlap.
// With outside.leave_q (leave_kv), no pad tiles on the Q (K/V) side.
PlanTiles make_plan_tiles(const AttentionCall& call, OutsideRows outside = {});

struct AttentionPlan::Impl {
  AttentionShape shape;
  Window window;
  double softmax_scale = 0;
  int64_t q_rows = 0, kv_rows = 0;
  OutsideRows outside;
  // Device arrays (one allocation, owned).
  void* device_block = nullptr;
  const SequenceDesc* sequences = nullptr;
  const RowTile* q_tiles_small = nullptr;
  const RowTile* q_tiles_large = nullptr;
  const RowTile* kv_tiles = nullptr;
  const RowTile* kv_tiles_large = nullptr;
  int32_t q_tile_small_count = 0, q_tile_large_count = 0, kv_tile_count = 0, kv_tile_large_count = 0;
  // Tile orders (sequences heaviest first, each sequence's tiles together) of the two Q lists, and the areas of QTileWork, for the wgmma forward's schedules.
  const int32_t* q_order_small = nullptr;
  const int32_t* q_order_large = nullptr;
  double q_area_small = 0, q_area_large = 0;
  ~Impl();
};

}  // namespace cpgold::gpu
