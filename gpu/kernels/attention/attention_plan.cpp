// Host side of the GPU attention: capability table, plan building (tile lists) and upload.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "sim/case/gpu_table.hpp"
#include "gpu/kernels/attention/attention_plan_impl.hpp"

namespace cpgold::gpu {

std::string_view status_name(Status status) {
  switch (status) {
    case Status::ok: return "ok";
    case Status::unsupported: return "unsupported";
    case Status::invalid_argument: return "invalid_argument";
    case Status::cuda_error: return "cuda_error";
  }
  return "?";
}

Outcome check_capability(const AttentionShape& shape) {
  if (shape.dtype != DType::bf16 && shape.dtype != DType::fp16)
    return {Status::unsupported, "dtype " + std::string(dtype_name(shape.dtype)) +
                                     " is outside the GPU capability table (bf16, fp16)"};
  if (!sim::head_dims_in_gpu_table(shape.dim_qk, shape.dim_v))
    return {Status::unsupported, "head dims d_qk=" + std::to_string(shape.dim_qk) + ", d_v=" +
                                     std::to_string(shape.dim_v) + " are outside the GPU capability table (" +
                                     sim::kGpuHeadDimText + ")"};
  if (shape.heads_q <= 0 || shape.heads_kv <= 0 || shape.heads_q % shape.heads_kv != 0)
    return {Status::invalid_argument, "heads: h_q=" + std::to_string(shape.heads_q) + " is not a multiple of h_kv=" +
                                          std::to_string(shape.heads_kv)};
  return {};
}

namespace {

using Interval = std::pair<int64_t, int64_t>;  // [first, end)

void add_tiles(std::vector<RowTile>& tiles, int64_t first_row, int32_t count, int32_t position, int32_t sequence,
               int32_t segment, int tile_rows) {
  for (int32_t start = 0; start < count; start += tile_rows) {
    const int32_t rows = std::min<int32_t>(tile_rows, count - start);
    tiles.push_back({first_row + start, rows, position + start, sequence, segment});
  }
}

// Throws if covered intervals overlap.
void check_disjoint(std::vector<Interval> covered, const char* side) {
  std::sort(covered.begin(), covered.end());
  for (size_t i = 1; i < covered.size(); ++i)
    if (covered[i].first < covered[i - 1].second)
      throw std::invalid_argument(std::string("overlapping ") + side + " rows at row " +
                                  std::to_string(covered[i].first) +
                                  " (each row may belong to one segment of one sequence)");
}

// Pad tiles over [0, total) minus the covered intervals; throws if covered intervals overlap.
void add_pad_tiles(std::vector<RowTile>& tiles, std::vector<Interval> covered, int64_t total, int tile_rows,
                   const char* side) {
  std::sort(covered.begin(), covered.end());
  int64_t cursor = 0;
  auto pad = [&](int64_t from, int64_t to) {
    for (int64_t r = from; r < to; r += tile_rows)
      tiles.push_back({r, static_cast<int32_t>(std::min<int64_t>(tile_rows, to - r)), 0, -1, 0});
  };
  for (const Interval& iv : covered) {
    if (iv.first < cursor)
      throw std::invalid_argument(std::string("overlapping ") + side + " rows at row " + std::to_string(iv.first) +
                                  " (each row may belong to one segment of one sequence)");
    pad(cursor, iv.first);
    cursor = iv.second;
  }
  pad(cursor, total);
}

// The tiles of one side (Q or K/V) in two heights, and the rows its segments cover.
struct SideTiles {
  std::vector<RowTile>& small;
  int small_rows;
  std::vector<RowTile>& large;
  int large_rows;
  std::vector<Interval> cover;

  // Sequence b's segments (at most 2) into the descriptor's arrays, the covered rows and both tile lists.
  void add(const std::vector<RowSegment>& segments, size_t b, int64_t* first_row, int32_t* count, int32_t* position) {
    for (size_t s = 0; s < segments.size() && s < 2; ++s) {
      const RowSegment& seg = segments[s];
      first_row[s] = seg.first_row;
      count[s] = seg.count;
      position[s] = seg.position;
      if (seg.count > 0) cover.emplace_back(seg.first_row, seg.first_row + seg.count);
      const auto sequence = static_cast<int32_t>(b), segment = static_cast<int32_t>(s);
      add_tiles(small, seg.first_row, seg.count, seg.position, sequence, segment, small_rows);
      add_tiles(large, seg.first_row, seg.count, seg.position, sequence, segment, large_rows);
    }
  }

  // The rows outside every segment: left alone (the covered rows must not overlap) or covered by pad tiles.
  void finish(bool leave_outside, int64_t total, const char* side) {
    if (leave_outside) {
      check_disjoint(cover, side);
      return;
    }
    add_pad_tiles(small, cover, total, small_rows, side);
    add_pad_tiles(large, cover, total, large_rows, side);
  }
};

}  // namespace

PlanTiles make_plan_tiles(const AttentionCall& call, OutsideRows outside) {
  PlanTiles plan;
  SideTiles q{plan.q_tiles_small, kSmallTileRows, plan.q_tiles_large, kLargeTileRows, {}};
  SideTiles kv{plan.kv_tiles, kKvTileRows, plan.kv_tiles_large, kLargeKvTileRows, {}};
  for (size_t b = 0; b < call.sequences.size(); ++b) {
    const SequenceTile& seq = call.sequences[b];
    SequenceDesc desc{};
    desc.length_q = seq.length_q;
    desc.length_kv = seq.length_kv;
    q.add(seq.q, b, desc.q_first_row, desc.q_count, desc.q_position);
    kv.add(seq.kv, b, desc.kv_first_row, desc.kv_count, desc.kv_position);
    plan.sequences.push_back(desc);
  }
  q.finish(outside.leave_q, call.q_rows, "q");
  kv.finish(outside.leave_kv, call.kv_rows, "kv");
  return plan;
}

namespace {

// Visible key index span [lo, hi] of one KV segment for query positions [qp_lo, qp_hi] (as the kernels derive it).
void visible_span(Window w, int64_t delta, int64_t qp_lo, int64_t qp_hi, int64_t kv_pos, int64_t kv_count,
                  int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = kv_count - 1;
  if (w.left >= 0) lo = std::max(lo, qp_lo + delta - w.left - kv_pos);
  if (w.right >= 0) hi = std::min(hi, qp_hi + delta + w.right - kv_pos);
}

// Visible key count over the tile's rows' union span, and key blocks of `key_tile` rows it visits.
void tile_keys(const std::vector<SequenceDesc>& seqs, const RowTile& t, Window w, int key_tile, int64_t& keys,
               int64_t& blocks) {
  keys = 0;
  blocks = 0;
  if (t.sequence < 0) return;
  const SequenceDesc& d = seqs[static_cast<size_t>(t.sequence)];
  const int64_t delta = static_cast<int64_t>(d.length_kv) - d.length_q;
  for (int s = 0; s < 2; ++s) {
    if (d.kv_count[s] <= 0) continue;
    int64_t lo, hi;
    visible_span(w, delta, t.position, static_cast<int64_t>(t.position) + t.rows - 1, d.kv_position[s], d.kv_count[s],
                 lo, hi);
    if (lo > hi) continue;
    keys += hi - lo + 1;
    blocks += hi / key_tile - lo / key_tile + 1;
  }
}

// The persistent grid's order: sequences heaviest first (the visible keys of their tiles summed), each sequence's
// tiles together and heaviest first within it, pad tiles last. Keeping a sequence's tiles together keeps its K and V
// in L2 while its tiles run; a global heaviest-first order spread the tiles of one causal sequence over the whole
// call, and on short sequences the forward then read K and V from DRAM again for most tiles (run B19: L2 hit rate
// 33% against 70%, DRAM at 87% of its bandwidth).
std::vector<int32_t> persistent_order(const std::vector<SequenceDesc>& seqs, const std::vector<RowTile>& tiles,
                                      Window w, int key_tile, int tile_rows, double& area) {
  std::vector<int64_t> cost(tiles.size());
  std::vector<int64_t> seq_cost(seqs.size(), 0);
  area = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    int64_t keys = 0, blocks = 0;
    tile_keys(seqs, tiles[i], w, key_tile, keys, blocks);
    cost[i] = tiles[i].sequence < 0 ? -1 : keys;
    if (tiles[i].sequence >= 0) seq_cost[static_cast<size_t>(tiles[i].sequence)] += keys;
    area += static_cast<double>(blocks) * tile_rows * key_tile;
  }
  auto seq_of = [&](int32_t t) { return tiles[static_cast<size_t>(t)].sequence; };
  std::vector<int32_t> order(tiles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const int32_t sa = seq_of(a), sb = seq_of(b);
    if ((sa < 0) != (sb < 0)) return sb < 0;  // pad tiles last
    if (sa < 0) return false;
    if (sa != sb) {
      const int64_t ca = seq_cost[static_cast<size_t>(sa)], cb = seq_cost[static_cast<size_t>(sb)];
      return ca != cb ? ca > cb : sa < sb;
    }
    return cost[a] > cost[b];
  });
  return order;
}

}  // namespace

QTileWork q_tile_work(const PlanTiles& tiles, Window window, int key_tile_small, int key_tile_large) {
  QTileWork w;
  w.order_small = persistent_order(tiles.sequences, tiles.q_tiles_small, window, key_tile_small, kSmallTileRows,
                                 w.area_small);
  w.order_large = persistent_order(tiles.sequences, tiles.q_tiles_large, window, key_tile_large, kLargeTileRows,
                                 w.area_large);
  return w;
}

AttentionPlan::Impl::~Impl() {
  if (device_block != nullptr) cudaFree(device_block);
}

AttentionPlan::AttentionPlan() = default;
AttentionPlan::~AttentionPlan() = default;
AttentionPlan::AttentionPlan(AttentionPlan&&) noexcept = default;
AttentionPlan& AttentionPlan::operator=(AttentionPlan&&) noexcept = default;

Outcome AttentionPlan::build(const AttentionCall& call, const AttentionShape& shape, OutsideRows outside) {
  impl_.reset();
  if (Outcome cap = check_capability(shape); !cap.ok()) return cap;
  PlanTiles tiles;
  try {
    call.check();
    tiles = make_plan_tiles(call, outside);
  } catch (const std::exception& e) {
    return {Status::invalid_argument, e.what()};
  }
  if (tiles.q_tiles_small.size() > (1u << 30) || tiles.kv_tiles.size() > (1u << 30))
    return {Status::invalid_argument, "too many tiles"};

  auto impl = std::make_unique<Impl>();
  impl->shape = shape;
  impl->window = call.window;
  impl->softmax_scale = call.softmax_scale;
  impl->q_rows = call.q_rows;
  impl->kv_rows = call.kv_rows;
  impl->outside = outside;

  // Key tiles of the wgmma forward's configurations (gpu/kernels/sm90/attention_sm90_launch.cuh): 64 rows with 64-row Q
  // tiles; with 128-row Q tiles 128 rows, 64 for d_qk above 192.
  const QTileWork work = q_tile_work(tiles, call.window, 64, shape.dim_qk > 192 ? 64 : 128);
  impl->q_area_small = work.area_small;
  impl->q_area_large = work.area_large;

  // One device block: sequences, then the four tile lists, then the two Q tile orders (each 16-byte aligned).
  auto align16 = [](size_t n) { return (n + 15) / 16 * 16; };
  const size_t seq_bytes = align16(std::max<size_t>(1, tiles.sequences.size()) * sizeof(SequenceDesc));
  const size_t qs_bytes = align16(std::max<size_t>(1, tiles.q_tiles_small.size()) * sizeof(RowTile));
  const size_t ql_bytes = align16(std::max<size_t>(1, tiles.q_tiles_large.size()) * sizeof(RowTile));
  const size_t kv_bytes = align16(std::max<size_t>(1, tiles.kv_tiles.size()) * sizeof(RowTile));
  const size_t kvl_bytes = align16(std::max<size_t>(1, tiles.kv_tiles_large.size()) * sizeof(RowTile));
  const size_t os_bytes = align16(std::max<size_t>(1, work.order_small.size()) * sizeof(int32_t));
  const size_t ol_bytes = align16(std::max<size_t>(1, work.order_large.size()) * sizeof(int32_t));
  std::vector<char> host(seq_bytes + qs_bytes + ql_bytes + kv_bytes + kvl_bytes + os_bytes + ol_bytes, 0);
  char* h = host.data();
  std::memcpy(h, tiles.sequences.data(), tiles.sequences.size() * sizeof(SequenceDesc));
  std::memcpy(h + seq_bytes, tiles.q_tiles_small.data(), tiles.q_tiles_small.size() * sizeof(RowTile));
  std::memcpy(h + seq_bytes + qs_bytes, tiles.q_tiles_large.data(), tiles.q_tiles_large.size() * sizeof(RowTile));
  std::memcpy(h + seq_bytes + qs_bytes + ql_bytes, tiles.kv_tiles.data(), tiles.kv_tiles.size() * sizeof(RowTile));
  std::memcpy(h + seq_bytes + qs_bytes + ql_bytes + kv_bytes, tiles.kv_tiles_large.data(),
              tiles.kv_tiles_large.size() * sizeof(RowTile));
  const size_t orders_at = seq_bytes + qs_bytes + ql_bytes + kv_bytes + kvl_bytes;
  std::memcpy(h + orders_at, work.order_small.data(), work.order_small.size() * sizeof(int32_t));
  std::memcpy(h + orders_at + os_bytes, work.order_large.data(), work.order_large.size() * sizeof(int32_t));

  if (cudaError_t e = cudaMalloc(&impl->device_block, host.size()); e != cudaSuccess) {
    impl->device_block = nullptr;
    return {Status::cuda_error, std::string("cudaMalloc of the plan: ") + cudaGetErrorString(e)};
  }
  // From pageable memory a synchronous cudaMemcpy may return before the DMA has landed (CUDA's API synchronisation
  // rules), and a kernel launched next on a non-blocking stream (the CP ranks' streams) does not wait for it: it
  // could read the tile lists of a plan freed earlier at the same address. Copy on this thread's default stream
  // and wait for that stream, so that the plan is on the device when build() returns.
  if (cudaError_t e = cudaMemcpyAsync(impl->device_block, host.data(), host.size(), cudaMemcpyHostToDevice,
                                      cudaStreamPerThread);
      e != cudaSuccess)
    return {Status::cuda_error, std::string("cudaMemcpyAsync of the plan: ") + cudaGetErrorString(e)};
  if (cudaError_t e = cudaStreamSynchronize(cudaStreamPerThread); e != cudaSuccess)
    return {Status::cuda_error, std::string("cudaStreamSynchronize after the plan upload: ") + cudaGetErrorString(e)};
  char* d = static_cast<char*>(impl->device_block);
  impl->sequences = reinterpret_cast<const SequenceDesc*>(d);
  impl->q_tiles_small = reinterpret_cast<const RowTile*>(d + seq_bytes);
  impl->q_tiles_large = reinterpret_cast<const RowTile*>(d + seq_bytes + qs_bytes);
  impl->kv_tiles = reinterpret_cast<const RowTile*>(d + seq_bytes + qs_bytes + ql_bytes);
  impl->q_order_small = reinterpret_cast<const int32_t*>(d + orders_at);
  impl->q_order_large = reinterpret_cast<const int32_t*>(d + orders_at + os_bytes);
  impl->q_tile_small_count = static_cast<int32_t>(tiles.q_tiles_small.size());
  impl->q_tile_large_count = static_cast<int32_t>(tiles.q_tiles_large.size());
  impl->kv_tile_count = static_cast<int32_t>(tiles.kv_tiles.size());
  impl->kv_tiles_large = reinterpret_cast<const RowTile*>(d + seq_bytes + qs_bytes + ql_bytes + kv_bytes);
  impl->kv_tile_large_count = static_cast<int32_t>(tiles.kv_tiles_large.size());
  impl_ = std::move(impl);
  return {};
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

}  // namespace cpgold::gpu
