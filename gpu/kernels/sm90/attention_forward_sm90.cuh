#pragma once
// Varlen attention forward (O, LSE) for Hopper (sm_90a) with warpgroup MMA, on AttentionParams
// (gpu/kernels/attention/kernel_params.hpp: THD rows, positions as segments, RowTile lists with pad tiles, windows, GQA).
//
// Version history (docs/hopper-kernels.md has the derivations and the measurements):
//   v1  FlashAttention-3 structure without intra-warpgroup overlap. CTA = one producer warpgroup + kConsumers
//       consumer warpgroups of 64 query rows each (Q tile kBlockM = 64 * kConsumers rows), K/V tiles of kBlockN
//       keys in a 2-stage shared-memory ring guarded by mbarriers (full: loaded; empty: consumed by every consumer).
//       S = Q K^T by wgmma m64n{kBlockN}k16 with Q and K in shared memory (SW128 tiles, K-major descriptors); online
//       softmax in float32 (exp2) on the accumulators; O += P V by wgmma m64n{D}k16 with P from registers (the
//       accumulators repacked as A fragments) and V in shared memory through an MN-major (transposed) descriptor.
//       Loads: Loader::cp_async (the 128 producer threads, 16-byte cp.async into the swizzled layout, zero-fill past a
//       segment, completion by cp.async.mbarrier.arrive) or Loader::tma (one producer thread, 3-D tensor maps
//       (column, head, row) with SWIZZLE_128B, completion by transaction count; rows past a segment hold whatever
//       the tensor has there: masked in S, and zeroed in the V tile by the consumers before P V, so that a NaN/Inf
//       pad can never meet a zero of P). With two consumer warpgroups the producer gives registers to the consumers
//       (setmaxnreg). Output: each warpgroup stages its O rows (dtype) in its own rows of the Q tile and writes them
//       with 16-byte stores; LSE per valid row (-inf and O = 0 for a row with no visible key); pad tiles write O = 0
//       and LSE = -inf.
//
//   v2  Head-dim pairs of the whole capability table: d_v may differ from d_qk (separate K and V tile widths; O is
//       staged in the Q tile, so d_v <= d_qk); head dims that are not a multiple of 64 (32, 96) load whole 64-column
//       blocks through the TMA, whose out-of-bounds columns arrive as zeros: the S product stops at d_qk, P V runs
//       over the rounded width (the extra O columns are 0 and never stored), so only wgmma N = 64 and 128 are used;
//       d_v = 256 is two P V products of N = 128 per K-step.
//
// Conventions: tid = thread index in its warpgroup, warp = tid / 32, lane = 4 g + c. A consumer thread holds rows
// 16 warp + g and 16 warp + g + 8 of its warpgroup's 64 rows; accumulator element 4 j + e is column 8 j + 2 c + e % 2
// of row g + 8 (e / 2).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "gpu/kernels/attention/kernel_params.hpp"
#include "gpu/kernels/attention/mask_ranges.cuh"
#include "gpu/kernels/attention/online_softmax.cuh"
#include "gpu/kernels/sm90/ptx_sm90.cuh"
#include "gpu/kernels/sm90/wgmma_ops.cuh"

namespace cpgold::gpu::sm90 {

inline constexpr float kLog2e = 1.4426950408889634f;

enum class Loader : int { cp_async = 0, tma = 1 };

template <class T_, int DQK_, int DV_, int CONSUMERS, int BLOCK_N, Loader LOADER, bool PINGPONG = false>
struct ForwardSm90Config {
  using T = T_;
  static constexpr int D = DQK_;   // head dim of Q and K
  static constexpr int DV = DV_;   // head dim of V and O
  // Widths of the shared tiles: whole 64-column (128-byte) SW128 blocks. A head dim that is not a multiple of 64
  // (32, 96) gets zero columns from the TMA's out-of-bounds fill: the S product stops at D (K-steps of 16), the
  // P V product runs over kVCols columns (the extra ones are P x 0 = 0 and never stored), so only the wgmma shapes
  // N = 64 and 128 are needed.
  static constexpr int kQKCols = (D + 63) / 64 * 64;
  static constexpr int kVCols = (DV + 63) / 64 * 64;
  // N of one P V wgmma: the whole width up to 128; a 256-wide O is two products of N = 128 per K-step.
  static constexpr int kPVN = kVCols > 128 ? 128 : kVCols;
  static constexpr int kConsumers = CONSUMERS;
  static constexpr int kBlockM = 64 * CONSUMERS;
  static constexpr int kBlockN = BLOCK_N;
  static constexpr Loader kLoader = LOADER;
  // Two consumer warpgroups take turns to issue their wgmma (named barriers 4 and 5): one's softmax runs while the
  // other's products occupy the tensor cores.
  static constexpr bool kPingPong = PINGPONG;
  static_assert(!PINGPONG || CONSUMERS == 2, "ping-pong scheduling needs two consumer warpgroups");
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (CONSUMERS + 1);
  static constexpr int kConsumerThreads = 128 * CONSUMERS;
  static constexpr int kQBytes = kBlockM * kQKCols * 2;
  static constexpr int kKBytes = kBlockN * kQKCols * 2;  // one K stage
  static constexpr int kVBytes = kBlockN * kVCols * 2;   // one V stage
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffBarriers = kOffV + kStages * kVBytes;
  static constexpr int kBarriers = 2 + 3 * kStages;  // q_full, q_empty, then the ring: full_k[S], full_v[S], empty[S]
  static constexpr int kSmemBytes = kOffBarriers + kBarriers * 8 + 1024;  // + slack to align the base to 1024
  // Residency: one CTA of 3 warpgroups per SM, or two CTAs of 2 warpgroups (one consumer each) so that two
  // consumer warpgroups share an SM either way. The launch cap R = 65536 / (threads * CTAs) registers per thread,
  // rounded down to 8, is redistributed by setmaxnreg: 128 * producer + 128 * CONSUMERS * consumer <= R * threads.
  static constexpr int kCtasPerSm = CONSUMERS == 1 ? 2 : 1;
  static constexpr int kLaunchRegs = (65536 / (kThreads * kCtasPerSm)) / 8 * 8;
  static constexpr bool kReallocate = true;
  static constexpr int kProducerRegs = LOADER == Loader::tma ? 24 : 40;
  static constexpr int kConsumerRegs =
      ((kLaunchRegs * (CONSUMERS + 1) - kProducerRegs) / CONSUMERS) / 8 * 8 > 240
          ? 240
          : ((kLaunchRegs * (CONSUMERS + 1) - kProducerRegs) / CONSUMERS) / 8 * 8;
  static_assert(128 * kProducerRegs + 128 * CONSUMERS * kConsumerRegs <= kLaunchRegs * kThreads, "register split");
  static_assert(kCtasPerSm * kSmemBytes <= 227 * 1024, "shared memory of the CTAs of one SM");
  static_assert(CONSUMERS == 1 || CONSUMERS == 2, "one or two consumer warpgroups");
  static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head dim of Q and K: K-steps of 16, at most 256");
  static_assert(DV % 8 == 0 && DV >= 8 && DV <= 256, "head dim of V: 16-byte output chunks, at most 256");
  static_assert(kPVN == 64 || kPVN == 128, "P V products of N = 64 or 128 (the wgmma wrappers)");
  static_assert(kVCols % kPVN == 0, "whole P V products");
  static_assert(kVCols <= kQKCols, "O is staged in the Q tile");
  static_assert(LOADER == Loader::tma || (D % 64 == 0 && DV % 64 == 0),
                "the cp.async loader reads whole 64-column blocks: head dims multiple of 64");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "key tile 64 or 128 (wgmma wrappers of N = 64, 128)");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
  static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0, "1024-aligned tiles");
};

// Tensor maps of the TMA loader (unused by the cp.async loader): Q [q_rows, heads_q, D] with a box of kBlockM rows,
// K [kv_rows, heads_kv, D] and V [kv_rows, heads_kv, DV] with boxes of kBlockN rows; 64 columns (128 bytes) per box,
// SWIZZLE_128B; columns past the head dim come as zeros.
struct ForwardTensorMaps {
  CUtensorMap q;
  CUtensorMap k;
  CUtensorMap v;
};

namespace detail {

// The key blocks a Q tile visits, segment 0 first: iteration i < count[0] is block first[0] + i of segment 0, the
// rest blocks of segment 1. Producer and consumers derive the same list.
template <int BLOCK_N>
struct KeyBlocks {
  int first[2];
  int count[2];
  int total;

  __device__ __forceinline__ KeyBlocks(const AttentionParams& p, const SequenceDesc& seq, const RowTile& tile) {
    const int64_t delta = static_cast<int64_t>(seq.length_kv) - seq.length_q;
    const int64_t qp_lo = tile.position, qp_hi = static_cast<int64_t>(tile.position) + tile.rows - 1;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      first[s] = 0;
      count[s] = 0;
      if (seq.kv_count[s] <= 0) continue;
      int lo, hi;
      visible_key_range(p.window_left, p.window_right, delta, qp_lo, qp_hi, seq.kv_position[s], seq.kv_count[s], lo,
                        hi);
      if (lo > hi) continue;
      first[s] = lo / BLOCK_N;
      count[s] = hi / BLOCK_N - lo / BLOCK_N + 1;
    }
    total = count[0] + count[1];
  }
  __device__ __forceinline__ int segment(int it) const { return it < count[0] ? 0 : 1; }
  __device__ __forceinline__ int key0(int it) const {
    return (it < count[0] ? first[0] + it : first[1] + it - count[0]) * BLOCK_N;
  }
};

// Pad tile: O = 0 and LSE = -inf on its rows (THREADS threads, thread index tid).
template <class T, int DV, int THREADS>
__device__ __forceinline__ void write_pad_tile(const AttentionParams& p, const RowTile& tile, int head, int tid) {
  const int64_t o_stride = static_cast<int64_t>(p.heads_q) * DV;
  T* o = static_cast<T*>(p.o) + tile.first_row * o_stride + static_cast<int64_t>(head) * DV;
  constexpr int kChunks = DV / 8;
  for (int i = tid; i < tile.rows * kChunks; i += THREADS)
    *reinterpret_cast<uint4*>(o + (i / kChunks) * o_stride + (i % kChunks) * 8) = make_uint4(0, 0, 0, 0);
  for (int r = tid; r < tile.rows; r += THREADS)
    p.lse[static_cast<int64_t>(head) * p.q_rows + tile.first_row + r] = -INFINITY;
}

template <class Cfg>
struct Barriers {
  uint32_t q_full;              // Q tile loaded (one phase per work item with key blocks)
  uint32_t q_empty;             // Q tile (and the O staged in it) done with by every consumer thread
  Ring<Cfg::kStages> ring;      // K/V stages
};

// Where a CTA stands in its sequence of work items: ring iterations and Q loads so far (producer and consumers
// count alike, since both derive the same key blocks per item).
struct ItemCursor {
  int it0 = 0;      // ring iteration of the item's first key block
  int q_loads = 0;  // work items with key blocks before this one (phase of q_full / q_empty)
};

// The producer's loop over an item's key blocks: block i waits for its ring stage to be free, then
// load(i, it, stage, segment) issues its copies.
template <class Cfg, class Load>
__device__ __forceinline__ void for_each_key_block(const KeyBlocks<Cfg::kBlockN>& kb, const ItemCursor& cur,
                                                   Barriers<Cfg>& bars, const Watchdog& dog, Load&& load) {
#pragma unroll 1
  for (int i = 0; i < kb.total; ++i) {
    const int it = cur.it0 + i;
    const int stage = bars.ring.stage(it);
    bars.ring.producer_acquire(it, dog);
    load(i, it, stage, kb.segment(i));
  }
}

// Producer warpgroup, one work item with key blocks: the first K/V blocks into the ring (their stages are freed by
// the previous item's last releases, so they load while the consumers finish that item), then Q once the previous
// item's consumers are done with the Q tile (q_empty), then the remaining K/V blocks.
template <class Cfg>
__device__ __forceinline__ void produce(const AttentionParams& p, const ForwardTensorMaps& maps, const Watchdog& dog,
                                        const RowTile& tile, const SequenceDesc& seq,
                                        const KeyBlocks<Cfg::kBlockN>& kb, uint32_t smem, Barriers<Cfg> bars,
                                        int head, ItemCursor cur) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  const int tid = threadIdx.x;  // the producer is warpgroup 0
  const int kv_head = head / p.group;
  const int q_after = min(kb.total, Cfg::kStages) - 1;  // Q is issued after this block
  if constexpr (Cfg::kLoader == Loader::cp_async) {
    const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
    const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;
    const int64_t v_stride = static_cast<int64_t>(p.heads_kv) * Cfg::DV;
    const T* q = static_cast<const T*>(p.q);
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    for_each_key_block(kb, cur, bars, dog, [&](int i, int it, int stage, int s) {
      const int key0 = kb.key0(i);
      const int valid = min(Cfg::kBlockN, seq.kv_count[s] - key0);
      const int64_t row0 = seq.kv_first_row[s] + key0;
      load_tile_sw128_cp_async<Cfg::kBlockN, D, 128>(smem + Cfg::kOffK + stage * Cfg::kKBytes,
                                                     k + row0 * kv_stride + kv_head * D, kv_stride, valid, k, tid);
      mbar_arrive_on_cp_async(bars.ring.full_k(it));
      load_tile_sw128_cp_async<Cfg::kBlockN, Cfg::DV, 128>(smem + Cfg::kOffV + stage * Cfg::kVBytes,
                                                           v + row0 * v_stride + kv_head * Cfg::DV, v_stride, valid,
                                                           v, tid);
      mbar_arrive_on_cp_async(bars.ring.full_v(it));
      if (i == q_after) {
        if (cur.q_loads > 0) mbar_wait(bars.q_empty, static_cast<uint32_t>(cur.q_loads - 1) & 1u, dog, kWaitQ, -1);
        load_tile_sw128_cp_async<Cfg::kBlockM, D, 128>(smem + Cfg::kOffQ, q + tile.first_row * q_stride + head * D,
                                                       q_stride, tile.rows, q, tid);
        mbar_arrive_on_cp_async(bars.q_full);
      }
    });
  } else {
    if (cur.q_loads == 0) {  // first item with key blocks (so the K and V maps are encoded)
      tma_prefetch_descriptor(&maps.q);
      tma_prefetch_descriptor(&maps.k);
      tma_prefetch_descriptor(&maps.v);
    }
    for_each_key_block(kb, cur, bars, dog, [&](int i, int it, int stage, int s) {
      const int row0 = static_cast<int>(seq.kv_first_row[s] + kb.key0(i));
      mbar_arrive_expect_tx(bars.ring.full_k(it), Cfg::kKBytes);
#pragma unroll
      for (int b = 0; b < Cfg::kQKCols / 64; ++b)
        tma_load_3d(smem + Cfg::kOffK + stage * Cfg::kKBytes + b * Cfg::kBlockN * 128, &maps.k, 64 * b, kv_head,
                    row0, bars.ring.full_k(it));
      mbar_arrive_expect_tx(bars.ring.full_v(it), Cfg::kVBytes);
#pragma unroll
      for (int b = 0; b < Cfg::kVCols / 64; ++b)
        tma_load_3d(smem + Cfg::kOffV + stage * Cfg::kVBytes + b * Cfg::kBlockN * 128, &maps.v, 64 * b, kv_head,
                    row0, bars.ring.full_v(it));
      if (i == q_after) {
        if (cur.q_loads > 0) mbar_wait(bars.q_empty, static_cast<uint32_t>(cur.q_loads - 1) & 1u, dog, kWaitQ, -1);
        mbar_arrive_expect_tx(bars.q_full, Cfg::kQBytes);
#pragma unroll
        for (int b = 0; b < Cfg::kQKCols / 64; ++b)
          tma_load_3d(smem + Cfg::kOffQ + b * Cfg::kBlockM * 128, &maps.q, 64 * b, head,
                      static_cast<int>(tile.first_row), bars.q_full);
      }
    });
  }
}

// Sets masked scores of this thread's two rows (positions qp0 and qp0 + 8) to -inf. Column x of the tile is key
// index key0 + x of a segment at position kv_pos with kv_count rows; a row sees the key indices in
// [qp + delta - wl - kv_pos, qp + delta + wr - kv_pos] (a -1 side unbounded) below kv_count. Both bounds are taken
// relative to key0 and clamped into int32 once per row, so each score costs two 32-bit compares.
template <int N>
__device__ __forceinline__ void apply_mask(float (&s)[N / 2], int wl, int wr, int64_t delta, int64_t qp0, int key0,
                                           int kv_pos, int kv_count, int c) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t base = qp0 + 8 * half + delta - kv_pos - key0;  // diagonal column of this row
    int64_t lo = wl >= 0 ? base - wl : -1;
    int64_t hi = static_cast<int64_t>(kv_count) - 1 - key0;
    if (wr >= 0 && base + wr < hi) hi = base + wr;
    // Clamped to [-1, N]: outside that range every column compares the same way.
    const int lo32 = static_cast<int>(lo < -1 ? int64_t{-1} : (lo > N ? int64_t{N} : lo));
    const int hi32 = static_cast<int>(hi < -1 ? int64_t{-1} : (hi > N ? int64_t{N} : hi));
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int x = 8 * j + 2 * c + e;
        if (x < lo32 || x > hi32) s[4 * j + 2 * half + e] = -INFINITY;
      }
    }
  }
}

// Consumer warpgroup `cw` (0 .. kConsumers - 1): rows 64 cw .. 64 cw + 63 of the Q tile.
template <class Cfg>
__device__ __forceinline__ void consume(const AttentionParams& p, const Watchdog& dog, const RowTile& tile,
                                        const SequenceDesc& seq, const KeyBlocks<Cfg::kBlockN>& kb, uint32_t smem,
                                        uint8_t* smem_ptr, Barriers<Cfg> bars, int head, int cw, ItemCursor cur) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  constexpr int BN = Cfg::kBlockN;
  const int tid = threadIdx.x - 128 * (cw + 1);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int64_t delta = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const int64_t qp_lo = tile.position, qp_hi = static_cast<int64_t>(tile.position) + tile.rows - 1;
  const int64_t qp0 = static_cast<int64_t>(tile.position) + 64 * cw + 16 * warp + g;
  const float sl2 = p.scale_log2;

  constexpr int VC = Cfg::kVCols;  // O accumulator columns (DV rounded up to 64; the extra ones stay 0)
  constexpr int DV = Cfg::DV;
  float o[VC / 2];
#pragma unroll
  for (int i = 0; i < VC / 2; ++i) o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  const uint32_t q_tile = smem + Cfg::kOffQ;
  // Only items with key blocks reach here (the kernel writes the others as pad rows).
  mbar_wait(bars.q_full, static_cast<uint32_t>(cur.q_loads) & 1u, dog, kWaitQ, -1);
  if constexpr (Cfg::kLoader == Loader::cp_async) fence_proxy_async();
  // Ping-pong: warpgroup w waits on barrier 4 + w for the other's signal. Order of wgmma issue: S_0 of warpgroup 0,
  // S_0 of 1, P V_0 + S_1 of 0, P V_0 + S_1 of 1, ... Every sync (128 threads) meets one arrive (128 threads) of the
  // other warpgroup: warpgroup 0 syncs before each P V (N) against 1's arrives after each S (N); warpgroup 1 syncs
  // at the start and before each P V (N + 1) against 0's arrives after each S and once at the end (N + 1).
  constexpr int kSchedBarrier = 4;
  if constexpr (Cfg::kPingPong) {
    if (cw == 1) named_barrier_sync(kSchedBarrier + 1, 256);
  }
#pragma unroll 1
  for (int i = 0; i < kb.total; ++i) {
    const int it = cur.it0 + i;  // ring iteration
    const int stage = bars.ring.stage(it);
    const int s_idx = kb.segment(i);
    const int key0 = kb.key0(i);
    const int kv_count = seq.kv_count[s_idx];
    const int kv_pos = seq.kv_position[s_idx];
    const int valid = min(BN, kv_count - key0);
    const uint32_t k_tile = smem + Cfg::kOffK + stage * Cfg::kKBytes;
    const uint32_t v_tile = smem + Cfg::kOffV + stage * Cfg::kVBytes;

    // S = Q K^T (64 x BN per warpgroup).
    bars.ring.wait_k(it, dog);
    if constexpr (Cfg::kLoader == Loader::cp_async) fence_proxy_async();
    float s[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
    fence_registers(s);  // register writes stay before wgmma.fence
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t a = desc_k_major(q_tile, Cfg::kBlockM, 64 * cw, 16 * kk);  // this warpgroup's 64 rows
      const uint64_t b = desc_k_major(k_tile, BN, 0, 16 * kk);
      Wgmma<BN, T, 0>::ss(s, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    if constexpr (Cfg::kPingPong) named_barrier_arrive(kSchedBarrier + 1 - cw, 256);
    wgmma_wait<0>();
    fence_registers(s);

    const bool full = valid == BN && tile_fully_visible(p.window_left, p.window_right, delta, qp_lo, qp_hi,
                                                        kv_pos + key0, kv_pos + key0 + BN - 1);
    if (!full) apply_mask<BN>(s, p.window_left, p.window_right, delta, qp0, key0, kv_pos, kv_count, c);

    // Online softmax over rows g (half 0) and g + 8 (half 1), exp2 domain.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) m = fmaxf(m, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
      const SoftmaxStep step = online_softmax_step(row_max[half], m, sl2);
      const float alpha = step.alpha, bias = step.bias;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        s[4 * j + 2 * half] = exp2f(fmaf(s[4 * j + 2 * half], sl2, bias));
        s[4 * j + 2 * half + 1] = exp2f(fmaf(s[4 * j + 2 * half + 1], sl2, bias));
        sum += s[4 * j + 2 * half] + s[4 * j + 2 * half + 1];
      }
      row_sum[half] = row_sum[half] * alpha + sum;
#pragma unroll
      for (int j = 0; j < VC / 8; ++j) {
        o[4 * j + 2 * half] *= alpha;
        o[4 * j + 2 * half + 1] *= alpha;
      }
    }
    uint32_t pa[BN / 16][4];
    accumulators_to_a<T, BN / 16>(pa, s);

    // O += P V.
    bars.ring.wait_v(it, dog);
    if constexpr (Cfg::kLoader == Loader::cp_async) {
      fence_proxy_async();
    } else if (valid < BN) {
      // Rows past the segment came from the tensor as they are (pads may hold NaN/Inf): zero them, since P is 0
      // there and 0 x NaN would not be. Every consumer warpgroup reads the whole V tile, so all of them zero a share
      // and meet at a named barrier before any reads it.
      uint8_t* v_ptr = smem_ptr + Cfg::kOffV + stage * Cfg::kVBytes;
      const int ctid = threadIdx.x - 128;
      const int chunks = (BN - valid) * 8;  // 16-byte chunks per column block
      for (int i = ctid; i < chunks * (VC / 64); i += Cfg::kConsumerThreads) {
        const int b = i / chunks, r = valid + (i % chunks) / 8, q = i % 8;
        *reinterpret_cast<uint4*>(v_ptr + b * BN * 128 + r * 128 + q * 16) = make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async();
      named_barrier_sync(1, Cfg::kConsumerThreads);
    }
    if constexpr (Cfg::kPingPong) named_barrier_sync(kSchedBarrier + cw, 256);
    fence_registers(o);  // the rescaled accumulators and P stay before wgmma.fence
    fence_registers(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      // Columns 128 h .. of O (a 256-wide O: two products of N = 128; the V tile's column blocks are BN * 128
      // bytes apart, so the second half starts 2 blocks in, 1024-aligned).
#pragma unroll
      for (int h = 0; h < VC / Cfg::kPVN; ++h)
        Wgmma<Cfg::kPVN, T, 1>::rs(*reinterpret_cast<float(*)[Cfg::kPVN / 2]>(o + h * (Cfg::kPVN / 2)), pa[kk],
                                   desc_mn_major(v_tile + h * (Cfg::kPVN / 64) * BN * 128, BN, 16 * kk), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(pa);
    bars.ring.release(it);
  }
  if constexpr (Cfg::kPingPong) {
    if (cw == 0) named_barrier_arrive(kSchedBarrier + 1, 256);
  }

  // Finalize: O = acc / sum (0 for a row with no visible key), LSE = max * scale + ln(sum) (or -inf).
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 64 * cw + 16 * warp + g + 8 * half;
    inv[half] = finish_row(p, row_sum[half], row_max[half], head, tile.first_row, r, c == 0 && r < tile.rows);
  }
  // Stage this warpgroup's O rows (dtype) in its own rows of the Q tile (SW128 layout: the 4-byte stores of a warp
  // fall in 32 distinct banks), then 16-byte coalesced stores of the valid rows.
  fence_proxy_async();  // the wgmma reads of these Q rows are complete (wait above); order the generic writes after
  uint8_t* q_ptr = smem_ptr + Cfg::kOffQ;
#pragma unroll
  for (int j = 0; j < DV / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 64 * cw + 16 * warp + g + 8 * half;
      const uint32_t off = sw128_offset(Cfg::kBlockM, r, 8 * j + 2 * c);
      *reinterpret_cast<uint32_t*>(q_ptr + off) =
          pack2<T>(o[4 * j + 2 * half] * inv[half], o[4 * j + 2 * half + 1] * inv[half]);
    }
  }
  named_barrier_sync(2 + cw, 128);
  const int64_t o_stride = static_cast<int64_t>(p.heads_q) * DV;
  T* o_rows = static_cast<T*>(p.o) + (tile.first_row + 64 * cw) * o_stride + static_cast<int64_t>(head) * DV;
  const int rows = min(64, tile.rows - 64 * cw);
  constexpr int kChunks = DV / 8;
#pragma unroll 4
  for (int i = tid; i < 64 * kChunks; i += 128) {
    const int r = i / kChunks, ch = i % kChunks;
    if (r < rows)
      *reinterpret_cast<uint4*>(o_rows + r * o_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(q_ptr + sw128_offset(Cfg::kBlockM, 64 * cw + r, ch * 8));
  }
  // The Q tile is free for the next item's Q (generic reads above before the async proxy's writes).
  fence_proxy_async();
  mbar_arrive(bars.q_empty);
}

// The work items of this CTA (see attention_forward_sm90_kernel), in order: pad tiles and tiles without a visible
// key are written as O = 0, LSE = -inf by the consumer threads (PADS; the values they would compute); the others
// go to `work` with the cursor of the item, which both roles advance alike.
template <class Cfg, bool PERSISTENT, bool PADS, class Work>
__device__ __forceinline__ void for_each_item(const AttentionParams& p, const int32_t* __restrict__ order, int items,
                                              Work&& work) {
  auto item = [&](int w, ItemCursor& cur) {
    int tile_index, head;
    if (order == nullptr) {
      tile_index = w % p.q_tile_count;
      head = w / p.q_tile_count;
    } else {
      tile_index = order[w / p.heads_q];
      head = w % p.heads_q;
    }
    const RowTile tile = p.q_tiles[tile_index];
    if (tile.sequence < 0) {
      if constexpr (PADS)
        write_pad_tile<typename Cfg::T, Cfg::DV, Cfg::kConsumerThreads>(p, tile, head, threadIdx.x - 128);
      return;
    }
    const SequenceDesc& seq = p.sequences[tile.sequence];
    const KeyBlocks<Cfg::kBlockN> kb(p, seq, tile);
    if (kb.total == 0) {
      if constexpr (PADS)
        write_pad_tile<typename Cfg::T, Cfg::DV, Cfg::kConsumerThreads>(p, tile, head, threadIdx.x - 128);
      return;
    }
    work(tile, seq, kb, head, cur);
    cur.it0 += kb.total;
    ++cur.q_loads;
  };
  ItemCursor cur;
  if constexpr (!PERSISTENT) {
    item(blockIdx.x, cur);  // one item per CTA: the cursor stays at its start (constants for the compiler)
  } else {
#pragma unroll 1
    for (int w = blockIdx.x; w < items; w += gridDim.x) item(w, cur);
  }
}

}  // namespace detail

// Work items are (Q tile of p.q_tiles with kBlockM rows, query head) pairs, items = q_tile_count * heads_q of them.
// PERSISTENT == false: one CTA per item, CTA b runs item b. PERSISTENT: CTA b runs items b, b + gridDim.x,
// b + 2 gridDim.x, ... (a grid of as many CTAs as the SMs hold). Item w is tile w % q_tile_count of head w / q_tile_count (order == nullptr:
// the tile list's order, heads outer), or tile order[w / heads_q] of head w % heads_q (a tile order from the plan,
// heads inner). Each item is computed the same way whatever the grid (same key blocks, same reduction order), so
// both schedules give the same bits. The ring of K/V stages and the Q tile's barriers carry over from one item to
// the next: the producer loads the next item's first key blocks while the consumers finish the previous one.
template <class Cfg, bool PERSISTENT = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kCtasPerSm)
    attention_forward_sm90_kernel(const AttentionParams p, const __grid_constant__ ForwardTensorMaps maps,
                                  const Watchdog dog, const int32_t* __restrict__ order, int items) {
  using T = typename Cfg::T;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  uint8_t* smem_ptr = smem_raw + (smem - raw);

  const detail::Barriers<Cfg> bars{smem + Cfg::kOffBarriers, smem + Cfg::kOffBarriers + 8,
                                   {smem + Cfg::kOffBarriers + 16}};
  if (threadIdx.x == 0) {
    // Full barriers: one arrival with a transaction count (TMA), or one per producer thread (cp.async .noinc).
    const uint32_t full_arrivals = Cfg::kLoader == Loader::tma ? 1 : 128;
    mbar_init(bars.q_full, full_arrivals);
    mbar_init(bars.q_empty, Cfg::kConsumerThreads);
    bars.ring.init(full_arrivals, Cfg::kConsumerThreads);
    fence_mbarrier_init();
  }
  __syncthreads();

  // The item loop is written out once per role: the code after each setmaxnreg is that role's alone.
  if (threadIdx.x < 128) {
    if constexpr (Cfg::kReallocate) setmaxnreg_dec<Cfg::kProducerRegs>();
    if constexpr (Cfg::kLoader == Loader::tma) {
      if (threadIdx.x != 0) return;  // one thread issues the TMA loads
    }
    detail::for_each_item<Cfg, PERSISTENT, false>(p, order, items, [&](const RowTile& tile, const SequenceDesc& seq,
                                                   const detail::KeyBlocks<Cfg::kBlockN>& kb, int head,
                                                   detail::ItemCursor cur) {
      detail::produce<Cfg>(p, maps, dog, tile, seq, kb, smem, bars, head, cur);
    });
    if constexpr (Cfg::kLoader == Loader::cp_async) cp_async_wait_all();
  } else {
    if constexpr (Cfg::kReallocate) setmaxnreg_inc<Cfg::kConsumerRegs>();
    detail::for_each_item<Cfg, PERSISTENT, true>(p, order, items, [&](const RowTile& tile, const SequenceDesc& seq,
                                                   const detail::KeyBlocks<Cfg::kBlockN>& kb, int head,
                                                   detail::ItemCursor cur) {
      detail::consume<Cfg>(p, dog, tile, seq, kb, smem, smem_ptr, bars, head, threadIdx.x / 128 - 1, cur);
    });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.

// Encodes a 3-D tensor map over a THD tensor [rows, heads, d] (rows contiguous, row stride heads * d) of `type`
// (elements of elem_bytes), dims (column, head, row), box (box_cols columns, 1 head, box_rows rows), SWIZZLE_128B
// (box_cols * elem_bytes = 128), zero fill out of bounds, through the driver's cuTensorMapEncodeTiled reached by the
// runtime (no link against libcuda). Returns "" or what failed.
inline std::string encode_thd_map(CUtensorMap& map, CUtensorMapDataType type, int elem_bytes, const void* base,
                                  int64_t rows, int heads, int d, int box_cols, int box_rows) {
  using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static EncodeFn encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || fn == nullptr || q != cudaDriverEntryPointSuccess)
      return std::string("cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled): ") + cudaGetErrorString(e) +
             ", query result " + std::to_string(static_cast<int>(q));
    encode = reinterpret_cast<EncodeFn>(fn);
  }
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows > 0 ? rows : 1)};  // an empty tensor is never read
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(d) * elem_bytes,
                                 static_cast<cuuint64_t>(heads) * d * elem_bytes};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, type, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? std::string()
                           : "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(r)) +
                                 " (rows " + std::to_string(rows) + ", heads " + std::to_string(heads) + ", d " +
                                 std::to_string(d) + ", box " + std::to_string(box_cols) + " x " +
                                 std::to_string(box_rows) + ")";
}

// The tiles of the forward's TMA loader: 16-bit elements, boxes of 64 columns (128 bytes) and box_rows rows.
inline std::string encode_thd_tile_map(CUtensorMap& map, bool fp16, const void* base, int64_t rows, int heads, int d,
                                       int box_rows) {
  return encode_thd_map(map, fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows,
                        heads, d, 64, box_rows);
}

// The three maps of the TMA loader for p. Returns "" or what failed.
template <class Cfg>
std::string encode_forward_maps(const AttentionParams& p, ForwardTensorMaps& maps) {
  constexpr bool fp16 = std::is_same_v<typename Cfg::T, __half>;
  std::string err = encode_thd_tile_map(maps.q, fp16, p.q, p.q_rows, p.heads_q, Cfg::D, Cfg::kBlockM);
  // Without KV rows no tile has a key block, so the K and V maps are never read (and the pointers may be null).
  if (err.empty() && p.kv_rows > 0)
    err = encode_thd_tile_map(maps.k, fp16, p.k, p.kv_rows, p.heads_kv, Cfg::D, Cfg::kBlockN);
  if (err.empty() && p.kv_rows > 0)
    err = encode_thd_tile_map(maps.v, fp16, p.v, p.kv_rows, p.heads_kv, Cfg::DV, Cfg::kBlockN);
  return err.empty() ? err : "tensor maps: " + err;
}

// Launches the kernel on p (p.q_tiles: tiles of Cfg::kBlockM rows) over the work items in `order` (device array of
// q_tile_count tile indices; nullptr: the list's order, heads outer): one CTA per item, or (PERSISTENT) min(ctas,
// items) CTAs looping over them. Returns "" or the failed call.
template <class Cfg, bool PERSISTENT = false>
std::string launch_forward_sm90(const AttentionParams& p, const ForwardTensorMaps& maps, Watchdog dog,
                                cudaStream_t stream, const int32_t* order = nullptr, int ctas = 0) {
  if (p.q_tile_count == 0 || p.heads_q == 0) return {};
  const int64_t items = static_cast<int64_t>(p.q_tile_count) * p.heads_q;
  if (items > (int64_t{1} << 31) - 1) return "attention_forward_sm90_kernel: too many work items";
  if (PERSISTENT && ctas <= 0) return "attention_forward_sm90_kernel: a persistent grid needs a CTA count";
  const int grid = PERSISTENT && ctas < items ? ctas : static_cast<int>(items);
  auto kernel = attention_forward_sm90_kernel<Cfg, PERSISTENT>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      e != cudaSuccess)
    return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps, dog, order, static_cast<int>(items));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return std::string("attention_forward_sm90_kernel launch: ") + cudaGetErrorString(e);
  return {};
}

}  // namespace cpgold::gpu::sm90
