#pragma once
// Varlen attention backward (dQ, dK, dV) for Hopper (sm_90a) with warpgroup MMA, on AttentionParams
// (gpu/kernels/attention/kernel_params.hpp): the contract of the mma.sync backward of gpu/kernels/mma_sync/attention_kernels.cuh (rows outside every
// segment get dK = dV = 0, or +0 in the summing form; a row with LSE -inf has P = 0; NaN/Inf in pad rows never reach
// arithmetic; GQA; windows; two Q and two KV segments per sequence; atomic or deterministic dQ; the summing form).
//
// Version history (docs/hopper-kernels.md, "Backward", has the derivations):
//   v1  FlashAttention-3's split. dK/dV pass: one CTA per (key tile of 128 rows, kv head): a producer warpgroup
//       (cp.async, zero-fill past a segment) and two consumer warpgroups of 64 keys each. The CTA loads its K and V
//       tile once and loops over the query heads of the group and the 64-row Q blocks the mask lets through (Q, dO,
//       LSE, delta of a block in a 2-stage mbarrier ring). Per block, each consumer computes the transposed products
//       S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries, wgmma SS, all operands K-major), so that P^T and
//       dS^T sit in registers with the keys as rows: they are the A operands (register fragments) of
//       dV += P^T dO and dK += dS^T Q (wgmma RS, dO and Q through MN-major descriptors, as the forward's V). dK/dV
//       accumulate in registers (bitwise reproducible). Atomic mode: dS^T (dtype) is staged in shared memory as
//       [keys][queries] and consumer w computes dQ columns 64 w .. 64 w + 63 of the block, dQ = dS K by wgmma SS
//       with A = dS through the descriptor transpose bit (MN-major A) and K MN-major, then float2 atomics into the
//       float32 workspace. Deterministic mode: a Q-stationary pass (one CTA per (128-row Q tile, head), K/V of 64
//       keys in a 2-stage ring): S = Q K^T, dP = dO V^T (SS), dS in registers as the A of dQ += dS K (RS, K
//       MN-major), the key blocks in a fixed order.
//   v2  (runs B1-B3, docs/hopper-kernels.md "Backward v2") atomic mode: dQ blocks staged in shared memory and added
//       by TMA reduce-add instead of float2 atomics (TMA_DQ; d 128 +17-20%); d 64 splits dQ by keys (each warpgroup
//       its own 64 keys, no barrier between the warpgroups; +9-10%); d 128 overlaps the softmax and dV's product with
//       dP's (OVERLAP, +0.5-1.5%). attention_backward runs these; the defaults of the templates stay v1 (the A side).
//   v2.1 (runs B6-B12) the summing adds issue the loads of several pieces before their stores (add_rows_to_sum) and
//       the dQ finish runs enough blocks per tile for a CP step's few short tiles; d_qk and d_v separate (DV_), d 32
//       and 96 in zero-filled 64- and 128-column tiles: head dims 32/32, 96/96, 128/64 besides 64/64 and 128/128.
//   v2.2 (run B15) the wide configuration for 192/128 and 256/256 (BackwardWideSm90Config: 64 keys per CTA shared by
//       both warpgroups, which split the dK/dV/dQ columns; P^T and dS^T through shared memory): 256/256 atomic
//       2.2-2.4x the mma.sync backward, 192/128 1.25-1.28x. The same configuration at 128/128 lost 18-40% (run B16).
//       The delta, summing add and dQ finish live in gpu/kernels/attention/backward_rows.cuh, shared with the mma.sync backward.
//
// Conventions as in attention_forward_sm90.cuh: tid = thread index in its warpgroup, warp = tid / 32, lane = 4 g + c;
// accumulator element 4 j + e of a 64 x N product is row 16 warp + g + 8 (e / 2), column 8 j + 2 c + e % 2.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "gpu/kernels/attention/backward_rows.cuh"
#include "gpu/kernels/attention/kernel_params.hpp"
#include "gpu/kernels/attention/mask_ranges.cuh"
#include "gpu/kernels/sm90/attention_forward_sm90.cuh"
#include "gpu/kernels/sm90/ptx_sm90.cuh"
#include "gpu/kernels/sm90/wgmma_ops.cuh"

namespace cpgold::gpu::sm90 {

// Watchdog codes of the backward's waits (after the forward's WaitCode values).
enum BackwardWaitCode : int { kWaitKV = 6, kWaitQStage = 7, kWaitDoStage = 8, kWaitQdO = 9, kWaitKStage = 10,
                              kWaitVStage = 11, kWaitEmptyStage = 12 };

// How the two consumer warpgroups of the dK/dV pass share the atomic mode's dQ = dS K of a Q block:
//   columns          warpgroup w computes columns 64 w .. over all 128 keys (d = 64: both compute the same 64 columns
//                    and warpgroup 1's copy is discarded); one barrier across both warpgroups per block (dS of all
//                    keys must be staged);
//   first_warpgroup  d = 64: warpgroup 0 alone computes the 64 columns over all keys (one barrier across both);
//   keys             warpgroup w computes all d columns over its own 64 keys and adds them (twice the atomics of
//                    columns; only a barrier inside the warpgroup, so the two drift apart freely).
enum class DqSplit : int { columns = 0, first_warpgroup = 1, keys = 2 };

// dK/dV pass: kBlockN = 128 keys (two consumer warpgroups of 64 keys), Q blocks of kBlockM = 64 rows. OVERLAP: the
// softmax of S^T and dV's product are issued while dP^T is still being computed (wgmma_wait<1>); the same float32
// operations either way, so dK and dV are bit-identical between the two.
// TMA_DQ (atomic mode): the dQ block of a warpgroup is staged in shared memory (float32, two boxes of 64 rows x 32
// columns with the 128-byte swizzle) and added to the float32 workspace by TMA reduce-add (cp.reduce.async.bulk
// .tensor), issued by one thread, instead of float2 atomics from every thread.
// DV_: d_v (D_ is d_qk). The shared tiles and the products run on whole 64-column blocks: d 32 and 96 are carried as
// 64 and 128 columns whose extra columns the loads zero-fill, so the products' extra columns are 0 and never stored.
template <class T_, int D_, bool ATOMIC_DQ, DqSplit DQ_SPLIT = DqSplit::columns, bool OVERLAP = false,
          bool TMA_DQ = false, int DV_ = D_>
struct BackwardSm90Config {
  using T = T_;
  static constexpr int D = D_;
  static constexpr int DV = DV_;
  static constexpr int kQKCols = (D + 63) / 64 * 64;
  static constexpr int kVCols = (DV + 63) / 64 * 64;
  static constexpr bool kAtomicDq = ATOMIC_DQ;
  static constexpr DqSplit kDqSplit = DQ_SPLIT;
  static constexpr bool kOverlap = OVERLAP;
  static constexpr bool kTmaDq = ATOMIC_DQ && TMA_DQ;
  static constexpr bool kHeadSplit = false;  // each consumer owns 64 keys (BackwardWideSm90Config: both share them)
  static constexpr int kDqCols = DQ_SPLIT == DqSplit::keys ? kQKCols : 64;  // dQ columns per warpgroup's product
  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = 64 * kConsumers;
  static constexpr int kBlockM = 64;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kKBytes = kBlockN * kQKCols * 2;  // the K tile
  static constexpr int kVBytes = kBlockN * kVCols * 2;   // the V tile
  static constexpr int kQBytes = kBlockM * kQKCols * 2;  // one Q stage
  static constexpr int kDoBytes = kBlockM * kVCols * 2;  // one dO stage
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffQ = kOffV + kVBytes;
  static constexpr int kOffDo = kOffQ + kStages * kQBytes;
  static constexpr int kOffDs = kOffDo + kStages * kDoBytes;  // 2 buffers (atomic mode only)
  static constexpr int kOffLse = kOffDs + (ATOMIC_DQ ? 2 * kDsBytes : 0);
  static constexpr int kOffDelta = kOffLse + kStages * kBlockM * 4;
  static constexpr int kDqStageBytes = 64 * 64 * 4;  // one warpgroup's 64 x 64 float32 dQ block (two 8 KB boxes)
  static constexpr int kOffDqStage = (kOffDelta + kStages * kBlockM * 4 + 1023) / 1024 * 1024;
  static constexpr int kOffBarriers = kOffDqStage + (kTmaDq ? kConsumers * kDqStageBytes : 0);
  static constexpr int kBarriers = 1 + 3 * kStages;  // kv_full, then the ring: full_k (Q, LSE), full_v (dO, delta), empty
  static constexpr int kSmemBytes = kOffBarriers + kBarriers * 8 + 1024;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;  // 168
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kLaunchRegs * kThreads, "register split");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
  static_assert((kQKCols == 64 || kQKCols == 128) && (kVCols == 64 || kVCols == 128) && D % 16 == 0 &&
                    DV % 16 == 0 && DV <= D,
                "head dims: d_qk and d_v multiples of 16 up to 128, d_v <= d_qk");
  static_assert(DQ_SPLIT != DqSplit::first_warpgroup || kQKCols == 64, "first_warpgroup: d_qk <= 64 only");
  static_assert(!TMA_DQ || kDqCols == 64, "TMA dQ: one 64-column block per warpgroup");
  static_assert(kQBytes % 1024 == 0 && kDoBytes % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0 &&
                    kDsBytes % 1024 == 0,
                "1024-aligned tiles");
};

// dK/dV pass of the wide head dims (192/128, 256/256), whose dK and dV accumulators for 64 keys do not fit one
// consumer thread (d_qk + d_v >= 320 floats besides S^T and dP^T). kBlockN = 64 keys, shared by both consumer
// warpgroups, which split the head-dim columns instead of the keys. Per Q block of 64 rows, warpgroup w computes S^T
// and dP^T for queries 32 w .. 32 w + 31 (N = 32, the same float32 operations per element as BackwardSm90Config),
// writes its columns of P^T and dS^T (dtype) into shared [keys][queries] tiles and, after a barrier across both,
// computes its 64-column blocks of dV, dK (and dQ, atomic mode) over all 64 queries with those tiles as the A
// operands (wgmma SS). Column blocks: d_qk blocks [0, kKBlocks0) and d_v blocks [0, kVBlocks0) to warpgroup 0, the
// rest to warpgroup 1, so that both issue the same products per block (dK and dQ count twice: 256/256 gives each
// warpgroup 2 d_qk and 2 d_v blocks; 192/128 gives warpgroup 0 two d_qk blocks, warpgroup 1 one d_qk and two d_v
// blocks). The tiles of P^T and dS^T are double-buffered where shared memory allows (one barrier per block), else
// single (a second barrier before they are overwritten). Atomic mode: dQ by TMA reduce-add of 64 x 32 float32 boxes
// staged kDqRoundBoxes at a time per warpgroup (all at once at 192/128; one at a time at 256/256, where the two Q/dO
// stages, K and V take 193 KB).
template <class T_, int D_, int DV_, bool ATOMIC_DQ>
struct BackwardWideSm90Config {
  using T = T_;
  static constexpr int D = D_;
  static constexpr int DV = DV_;
  static constexpr int kQKCols = D;
  static constexpr int kVCols = DV;
  static constexpr bool kAtomicDq = ATOMIC_DQ;
  static constexpr bool kTmaDq = ATOMIC_DQ;
  static constexpr bool kHeadSplit = true;
  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = 64;
  static constexpr int kBlockM = 64;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kConsumerThreads = 128 * kConsumers;
  // Column blocks of 64 per warpgroup.
  static constexpr int kKBlocksAll = D / 64;
  static constexpr int kVBlocksAll = DV / 64;
  static constexpr int kKBlocks0 = (kKBlocksAll + 1) / 2;
  static constexpr int kVBlocks0 = (2 * kKBlocksAll + kVBlocksAll) / 2 - 2 * kKBlocks0;
  static constexpr int k_blocks(int cw) { return cw == 0 ? kKBlocks0 : kKBlocksAll - kKBlocks0; }
  static constexpr int k_first(int cw) { return cw == 0 ? 0 : kKBlocks0; }
  static constexpr int v_blocks(int cw) { return cw == 0 ? kVBlocks0 : kVBlocksAll - kVBlocks0; }
  static constexpr int v_first(int cw) { return cw == 0 ? 0 : kVBlocks0; }
  static constexpr int kKBytes = kBlockN * D * 2;
  static constexpr int kVBytes = kBlockN * DV * 2;
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kDoBytes = kBlockM * DV * 2;
  static constexpr int kPBytes = kBlockN * kBlockM * 2;  // one [keys][queries] tile of P^T or dS^T
  static constexpr int kBoxBytes = 64 * 32 * 4;          // one TMA reduce box of dQ
  static constexpr int kMaxBoxes = 2 * (kKBlocks0 > kKBlocksAll - kKBlocks0 ? kKBlocks0 : kKBlocksAll - kKBlocks0);
  static constexpr int kBaseBytes = kKBytes + kVBytes + kStages * (kQBytes + kDoBytes) + 2 * kStages * kBlockM * 4;
  static constexpr int kSpare = 227 * 1024 - 1024 - 64 - kBaseBytes;  // after the alignment slack and the barriers
  static constexpr int kPBuffers =
      kSpare >= 2 * 2 * kPBytes + (kTmaDq ? kConsumers * kMaxBoxes * kBoxBytes : 0) ? 2 : 1;
  static constexpr int kDqRoundBoxes =
      !kTmaDq ? 0
              : ((kSpare - kPBuffers * 2 * kPBytes) / (kConsumers * kBoxBytes) < kMaxBoxes
                     ? (kSpare - kPBuffers * 2 * kPBytes) / (kConsumers * kBoxBytes)
                     : kMaxBoxes);
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffQ = kOffV + kVBytes;
  static constexpr int kOffDo = kOffQ + kStages * kQBytes;
  static constexpr int kOffP = kOffDo + kStages * kDoBytes;
  static constexpr int kOffDs = kOffP + kPBuffers * kPBytes;
  static constexpr int kOffLse = kOffDs + kPBuffers * kPBytes;
  static constexpr int kOffDelta = kOffLse + kStages * kBlockM * 4;
  static constexpr int kOffDqStage = (kOffDelta + kStages * kBlockM * 4 + 1023) / 1024 * 1024;
  static constexpr int kOffBarriers = kOffDqStage + kConsumers * kDqRoundBoxes * kBoxBytes;
  static constexpr int kBarriers = 1 + 3 * kStages;
  static constexpr int kSmemBytes = kOffBarriers + kBarriers * 8 + 1024;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kLaunchRegs * kThreads, "register split");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
  static_assert(D % 64 == 0 && DV % 64 == 0 && DV <= D && D <= 256, "wide head dims: multiples of 64 up to 256");
  static_assert(2 * k_blocks(0) + v_blocks(0) == 2 * k_blocks(1) + v_blocks(1) && kVBlocks0 >= 0 &&
                    kVBlocks0 <= kVBlocksAll,
                "balanced column blocks");
  static_assert(k_blocks(0) <= 2 && k_blocks(1) >= 1 && k_blocks(1) <= 2 && v_blocks(0) <= 2 && v_blocks(1) <= 2,
                "at most 128 columns per product");
  static_assert(!kTmaDq || kDqRoundBoxes >= 1, "room for one dQ box per warpgroup");
};

// Deterministic dQ pass: Q tiles of kBlockM = 128 rows (two consumer warpgroups), K/V blocks of 64 keys (32 where two
// stages of 64 would not fit beside the Q and dO tiles: 256/256).
template <class T_, int D_, int DV_ = D_>
struct BackwardDqSm90Config {
  using T = T_;
  static constexpr int D = D_;
  static constexpr int DV = DV_;
  static constexpr int kQKCols = (D + 63) / 64 * 64;  // as BackwardSm90Config
  static constexpr int kVCols = (DV + 63) / 64 * 64;
  static constexpr int kConsumers = 2;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = 512 * (kQKCols + kVCols) + 2048 <= 227 * 1024 ? 64 : 32;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kQBytes = kBlockM * kQKCols * 2;
  static constexpr int kDoBytes = kBlockM * kVCols * 2;
  static constexpr int kKBytes = kBlockN * kQKCols * 2;
  static constexpr int kVBytes = kBlockN * kVCols * 2;
  static constexpr int kOffQ = 0;
  static constexpr int kOffDo = kOffQ + kQBytes;
  static constexpr int kOffK = kOffDo + kDoBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffBarriers = kOffV + kStages * kVBytes;
  static constexpr int kBarriers = 1 + 3 * kStages;  // q_full (Q and dO), then the ring
  static constexpr int kSmemBytes = kOffBarriers + kBarriers * 8 + 1024;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kLaunchRegs * kThreads, "register split");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

namespace detail {

// The Q blocks a key tile visits: for each query head of the group (in order), segment 0's blocks then segment 1's.
// Producer and consumers derive the same list.
template <int BLOCK_M>
struct QueryBlocks {
  int first[2];
  int count[2];
  int per_head;
  int total;
  __device__ __forceinline__ QueryBlocks(const AttentionParams& p, const SequenceDesc& seq, const RowTile& tile) {
    const int64_t delta = static_cast<int64_t>(seq.length_kv) - seq.length_q;
    const int64_t kp_lo = tile.position, kp_hi = static_cast<int64_t>(tile.position) + tile.rows - 1;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      first[s] = 0;
      count[s] = 0;
      if (seq.q_count[s] <= 0) continue;
      int lo, hi;
      visible_query_range(p.window_left, p.window_right, delta, kp_lo, kp_hi, seq.q_position[s], seq.q_count[s], lo,
                          hi);
      if (lo > hi) continue;
      first[s] = lo / BLOCK_M;
      count[s] = hi / BLOCK_M - lo / BLOCK_M + 1;
    }
    per_head = count[0] + count[1];
    total = per_head * p.group;
  }
  __device__ __forceinline__ int head_offset(int it) const { return it / per_head; }
  __device__ __forceinline__ int segment(int it) const { return it % per_head < count[0] ? 0 : 1; }
  __device__ __forceinline__ int row0(int it) const {
    const int r = it % per_head;
    return (r < count[0] ? first[0] + r : first[1] + r - count[0]) * BLOCK_M;
  }
};

// Masks a transposed score tile (rows: this thread's two keys, key indices kidx0 and kidx0 + 8 of a segment at
// kv_pos with kv_count rows; columns: query indices qrow0 + x of a segment at q_pos with q_count rows). Visible:
// key valid, query valid, kp >= qp + delta - wl, kp <= qp + delta + wr (a -1 side unbounded).
template <int N>
__device__ __forceinline__ void apply_mask_transposed(float (&s)[N / 2], int wl, int wr, int64_t delta, int kidx0,
                                                      int kv_pos, int kv_count, int qrow0, int q_pos, int q_count,
                                                      int c) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int kidx = kidx0 + 8 * half;
    const int64_t kp = static_cast<int64_t>(kv_pos) + kidx;
    const int64_t qbase = static_cast<int64_t>(q_pos) + qrow0;  // position of column 0
    int64_t lo = wr >= 0 ? kp - delta - wr - qbase : -1;
    int64_t hi = static_cast<int64_t>(q_count) - 1 - qrow0;
    if (wl >= 0 && kp - delta + wl - qbase < hi) hi = kp - delta + wl - qbase;
    if (kidx >= kv_count) hi = -1;
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

// LSE of a row in the exp2 domain; -inf (no visible key) becomes +inf so that P = exp2(s - inf) = 0, never NaN.
__device__ __forceinline__ float lse_to_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// P^T = exp2(S^T scale log2e - LSE log2e) in place, for the NQ query columns of a 64-key transposed product
// (element 4 j + e: query column 8 j + 2 c + e % 2; lse_s: those columns' LSE).
template <int NQ>
__device__ __forceinline__ void probabilities_t(float (&st)[NQ / 2], const float* lse_s, float sl2, int c) {
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * c);
    const float l0 = lse_to_log2(l.x), l1 = lse_to_log2(l.y);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i0 = 4 * j + 2 * half;
      st[i0] = exp2f(fmaf(st[i0], sl2, -l0));
      st[i0 + 1] = exp2f(fmaf(st[i0 + 1], sl2, -l1));
    }
  }
}

// dS^T = P^T (dP^T - delta) in place of dP^T, same layout (delta_s: the query columns' delta).
template <int NQ>
__device__ __forceinline__ void score_grads_t(float (&dpt)[NQ / 2], const float (&pt)[NQ / 2], const float* delta_s,
                                              int c) {
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * c);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i0 = 4 * j + 2 * half;
      dpt[i0] = pt[i0] * (dpt[i0] - dl.x);
      dpt[i0 + 1] = pt[i0 + 1] * (dpt[i0 + 1] - dl.y);
    }
  }
}

// Rows outside every segment: zeros, or +0 in the summing form (assign: the sum becomes 0).
template <class T, int D, int THREADS>
__device__ __forceinline__ void store_zero_rows(int64_t first_row, int rows, T* out, int64_t stride, int64_t col0,
                                                float* sum, const int64_t* map, bool assign, T* result, int tid) {
  if (sum == nullptr) {
    constexpr int kChunks = D / 8;
    for (int i = tid; i < rows * kChunks; i += THREADS)
      *reinterpret_cast<uint4*>(out + (first_row + i / kChunks) * stride + col0 + (i % kChunks) * 8) =
          make_uint4(0, 0, 0, 0);
    return;
  }
  add_rows_to_sum<T, kSumBatch>(rows, D / 4, map + first_row, stride, col0, sum, assign, result,
                                [](int, int) { return make_uint2(0, 0); }, tid, THREADS);
}

// Stages a warpgroup's 64 x D float accumulators (times `scale`, as dtype) in rows row0 .. row0 + 63 and columns
// col0 .. col0 + D - 1 of an SW128 tile of ROWS rows.
template <class T, int ROWS, int D>
__device__ __forceinline__ void stage_accumulators(uint8_t* tile, int row0, const float (&acc)[D / 2], float scale,
                                                   int warp, int g, int c, int col0 = 0) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + 16 * warp + g + 8 * half;
      *reinterpret_cast<uint32_t*>(tile + sw128_offset(ROWS, r, col0 + 8 * j + 2 * c)) =
          pack2<T>(acc[4 * j + 2 * half] * scale, acc[4 * j + 2 * half + 1] * scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// dK/dV pass.

template <class Cfg>
__device__ __forceinline__ void bwd_produce(const AttentionParams& p, const Watchdog& dog, const RowTile& kv_tile,
                                            const SequenceDesc& seq, const QueryBlocks<Cfg::kBlockM>& qb,
                                            uint32_t smem, uint32_t kv_full, Ring<Cfg::kStages> ring, int kv_head) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  constexpr int BM = Cfg::kBlockM;
  const int tid = threadIdx.x;
  if (qb.total == 0) return;
  constexpr int DV = Cfg::DV;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D, do_stride = static_cast<int64_t>(p.heads_q) * DV;
  const int64_t k_stride = static_cast<int64_t>(p.heads_kv) * D, v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  load_tile_sw128_cp_async<Cfg::kBlockN, Cfg::kQKCols, 128, T, D>(
      smem + Cfg::kOffK, k + kv_tile.first_row * k_stride + static_cast<int64_t>(kv_head) * D, k_stride, kv_tile.rows,
      k, tid);
  load_tile_sw128_cp_async<Cfg::kBlockN, Cfg::kVCols, 128, T, DV>(
      smem + Cfg::kOffV, v + kv_tile.first_row * v_stride + static_cast<int64_t>(kv_head) * DV, v_stride, kv_tile.rows,
      v, tid);
  mbar_arrive_on_cp_async(kv_full);
#pragma unroll 1
  for (int it = 0; it < qb.total; ++it) {
    const int stage = ring.stage(it);
    ring.producer_acquire(it, dog);
    const int head = kv_head * p.group + qb.head_offset(it);
    const int s = qb.segment(it);
    const int row0 = qb.row0(it);
    const int valid = min(BM, seq.q_count[s] - row0);
    const int64_t first_row = seq.q_first_row[s] + row0;
    const int64_t q_off = first_row * q_stride + static_cast<int64_t>(head) * D;
    load_tile_sw128_cp_async<BM, Cfg::kQKCols, 128, T, D>(smem + Cfg::kOffQ + stage * Cfg::kQBytes, q + q_off, q_stride,
                                                          valid, q, tid);
    const int64_t lse_index = static_cast<int64_t>(head) * p.q_rows + first_row;
    if (tid < BM) {
      const bool ok = tid < valid;
      cp_async_4(smem + Cfg::kOffLse + (stage * BM + tid) * 4, ok ? p.lse + lse_index + tid : p.lse, ok);
    }
    mbar_arrive_on_cp_async(ring.full_k(it));
    load_tile_sw128_cp_async<BM, Cfg::kVCols, 128, T, DV>(smem + Cfg::kOffDo + stage * Cfg::kDoBytes,
                                                          dout + first_row * do_stride + static_cast<int64_t>(head) * DV,
                                                          do_stride, valid, dout, tid);
    if (tid < BM) {
      const bool ok = tid < valid;
      cp_async_4(smem + Cfg::kOffDelta + (stage * BM + tid) * 4, ok ? p.delta + lse_index + tid : p.delta, ok);
    }
    mbar_arrive_on_cp_async(ring.full_v(it));
  }
  cp_async_wait_all();
}

template <class Cfg>
__device__ __forceinline__ void bwd_consume(const AttentionParams& p, const Watchdog& dog, const RowTile& kv_tile,
                                            const SequenceDesc& seq, const QueryBlocks<Cfg::kBlockM>& qb,
                                            uint32_t smem, uint8_t* smem_ptr, uint32_t kv_full,
                                            Ring<Cfg::kStages> ring, int kv_head, int cw, const CUtensorMap* dq_map) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  constexpr int BM = Cfg::kBlockM;
  constexpr int BN = Cfg::kBlockN;
  const int tid = threadIdx.x - 128 * (cw + 1);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int64_t delta_pos = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const int kv_pos = seq.kv_position[kv_tile.segment];
  const int kv_count = seq.kv_count[kv_tile.segment];
  const int key0 = kv_tile.position - kv_pos;  // the tile's first key index in its segment
  const int64_t kp_lo = kv_tile.position, kp_hi = static_cast<int64_t>(kv_tile.position) + kv_tile.rows - 1;
  const bool keys_full = kv_tile.rows == BN;
  const float sl2 = p.scale_log2;
  const uint32_t k_tile = smem + Cfg::kOffK, v_tile = smem + Cfg::kOffV;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;

  constexpr int QKC = Cfg::kQKCols, VC = Cfg::kVCols;
  float dk[QKC / 2], dv[VC / 2];
#pragma unroll
  for (int i = 0; i < QKC / 2; ++i) dk[i] = 0.f;
#pragma unroll
  for (int i = 0; i < VC / 2; ++i) dv[i] = 0.f;

  if (qb.total > 0) {
    mbar_wait(kv_full, 0, dog, kWaitKV, -1);
    fence_proxy_async();
  }
#pragma unroll 1
  for (int it = 0; it < qb.total; ++it) {
    const int stage = ring.stage(it);
    const int head = kv_head * p.group + qb.head_offset(it);
    const int s_idx = qb.segment(it);
    const int row0 = qb.row0(it);
    const int q_count = seq.q_count[s_idx];
    const int q_pos = seq.q_position[s_idx];
    const int valid = min(BM, q_count - row0);
    const uint32_t q_tile = smem + Cfg::kOffQ + stage * Cfg::kQBytes;
    const uint32_t do_tile = smem + Cfg::kOffDo + stage * Cfg::kDoBytes;
    const float* lse_s = reinterpret_cast<const float*>(smem_ptr + Cfg::kOffLse) + stage * BM;
    const float* delta_s = reinterpret_cast<const float*>(smem_ptr + Cfg::kOffDelta) + stage * BM;

    // S^T = K Q^T and dP^T = V dO^T: 64 keys (this warpgroup's rows of the K/V tile) x 64 queries.
    float st[BM / 2], dpt[BM / 2];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) st[i] = dpt[i] = 0.f;
    mbar_wait(ring.full_k(it), ring.parity(it), dog, kWaitQStage, it);
    fence_proxy_async();
    fence_registers(st);
    fence_registers(dpt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      Wgmma<BM, T, 0>::ss(st, desc_k_major(k_tile, BN, 64 * cw, 16 * kk), desc_k_major(q_tile, BM, 0, 16 * kk),
                          kk > 0 ? 1 : 0);
    wgmma_commit();
    mbar_wait(ring.full_v(it), ring.parity(it), dog, kWaitDoStage, it);
    fence_proxy_async();
#pragma unroll
    for (int kk = 0; kk < Cfg::DV / 16; ++kk)
      Wgmma<BM, T, 0>::ss(dpt, desc_k_major(v_tile, BN, 64 * cw, 16 * kk), desc_k_major(do_tile, BM, 0, 16 * kk),
                          kk > 0 ? 1 : 0);
    wgmma_commit();
    // Overlapped: only S^T is waited for here; P^T and dV's product are issued while dP^T is still computed.
    if constexpr (Cfg::kOverlap)
      wgmma_wait<1>();
    else
      wgmma_wait<0>();
    fence_registers(st);
    if constexpr (!Cfg::kOverlap) fence_registers(dpt);

    const int64_t qp_lo = static_cast<int64_t>(q_pos) + row0, qp_hi = qp_lo + valid - 1;
    const bool full = keys_full && valid == BM &&
                      tile_fully_visible(p.window_left, p.window_right, delta_pos, qp_lo, qp_hi, kp_lo, kp_hi);
    if (!full)
      apply_mask_transposed<BM>(st, p.window_left, p.window_right, delta_pos, key0 + 64 * cw + 16 * warp + g, kv_pos,
                                kv_count, row0, q_pos, q_count, c);
    // P^T (the same float32 operations in both schedules).
    probabilities_t<BM>(st, lse_s, sl2, c);
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];
    accumulators_to_a<T, BM / 16>(pa, st);
    // dV += P^T dO (RS; dO MN-major: K = queries, N = d).
    fence_registers(dv);
    fence_registers(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) Wgmma<VC, T, 1>::rs(dv, pa[kk], desc_mn_major(do_tile, BM, 16 * kk), 1);
    wgmma_commit();
    if constexpr (Cfg::kOverlap) {
      wgmma_wait<1>();  // dP^T complete; dV's product may still run
      fence_registers(dpt);
    }
    score_grads_t<BM>(dpt, st, delta_s, c);
    accumulators_to_a<T, BM / 16>(dsa, dpt);
    // dK += dS^T Q (RS; Q MN-major).
    fence_registers(dk);
    fence_registers(dsa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) Wgmma<QKC, T, 1>::rs(dk, dsa[kk], desc_mn_major(q_tile, BM, 16 * kk), 1);
    wgmma_commit();

    if constexpr (Cfg::kAtomicDq) {
      // dS^T (dtype) into buffer it % 2 as [keys][queries]: the A fragment registers are (key g.., query 16k + 2c..).
      // Columns split: buffer it % 2 was last read by the dQ products of iteration it - 2, which every consumer
      // finished before it arrived at the barrier of iteration it - 1. Keys split: each warpgroup reads only the
      // rows it wrote, and its own dQ products of iteration it - 2 are complete.
      uint8_t* ds_ptr = smem_ptr + Cfg::kOffDs + (it % 2) * Cfg::kDsBytes;
      const int kr = 64 * cw + 16 * warp + g;
#pragma unroll
      for (int k = 0; k < BM / 16; ++k) {
        *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr, 16 * k + 2 * c)) = dsa[k][0];
        *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr + 8, 16 * k + 2 * c)) = dsa[k][1];
        *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr, 16 * k + 8 + 2 * c)) = dsa[k][2];
        *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr + 8, 16 * k + 8 + 2 * c)) = dsa[k][3];
      }
      fence_proxy_async();
      if constexpr (Cfg::kDqSplit == DqSplit::keys)
        named_barrier_sync(2 + cw, 128);
      else
        named_barrier_sync(1, Cfg::kConsumerThreads);
      const uint32_t ds_tile = smem + Cfg::kOffDs + (it % 2) * Cfg::kDsBytes;
      // Columns split: dQ[:, 64 cw ..] (64 queries x 64 columns) = dS K[:, 64 cw ..] over all BN keys (d = 64: one
      // warpgroup, or both computing the same columns with warpgroup 1's discarded). Keys split: dQ (64 queries x D)
      // = dS[:, keys of cw] K[keys of cw, :]. A = dS through the transpose bit (the [keys][queries] tile is MN-major
      // for A = dS [queries][keys]); B = K, MN-major (K = keys).
      const bool does_dq = Cfg::kDqSplit != DqSplit::first_warpgroup || cw == 0;
      float dq[Cfg::kDqCols / 2];
#pragma unroll
      for (int i = 0; i < Cfg::kDqCols / 2; ++i) dq[i] = 0.f;
      if (does_dq) {
        fence_registers(dq);
        wgmma_fence();
        if constexpr (Cfg::kDqSplit == DqSplit::keys) {
#pragma unroll
          for (int kk = 0; kk < 64 / 16; ++kk)
            WgmmaTA<QKC, T, 1>::ss(dq, desc_mn_major_a(ds_tile, BN, 64 * cw + 16 * kk),
                                 desc_mn_major(k_tile, BN, 64 * cw + 16 * kk), kk > 0 ? 1 : 0);
        } else {
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk)
            WgmmaTA<64, T, 1>::ss(dq, desc_mn_major_a(ds_tile, BN, 16 * kk),
                                  desc_mn_major(k_tile + (QKC == 128 ? cw * BN * 128 : 0), BN, 16 * kk),
                                  kk > 0 ? 1 : 0);
        }
        wgmma_commit();
      }
      wgmma_wait<0>();
      fence_registers(dq);
      fence_registers(dk);
      fence_registers(dv);
      fence_registers(pa);
      fence_registers(dsa);
      ring.release(it);
      // Columns split at d = 64: warpgroup 1's copy of the same 64 columns adds nothing.
      const bool adds = Cfg::kDqSplit == DqSplit::keys || QKC == 128 || cw == 0;
      if constexpr (Cfg::kTmaDq) {
        // Stage the 64 x 64 block (rows past the segment hold exact zeros: their dS columns are 0, so adding them to
        // the rows that follow changes nothing; rows past the tensor are skipped by the TMA), then one thread adds
        // it to the workspace by two TMA reduce-adds. The staging is reused once the previous reduce has read it.
        if (adds) {
          const uint32_t stage_box = smem + Cfg::kOffDqStage + cw * Cfg::kDqStageBytes;
          if (tid == 0) bulk_wait_group_read<0>();
          named_barrier_sync(2 + cw, 128);
          // Element (r, col) of the block: box col / 32 (64 rows x 128 bytes each), row r, 16-byte chunk
          // (col % 32) / 4 XOR r % 8 (r % 8 = g for this thread's rows). The thread's part of the address is
          // recomputed here (opaque_u32) rather than hoisted out of the block loop into 16 live registers.
          const uint32_t row_addr = stage_box + static_cast<uint32_t>(16 * warp + g) * 128u;
          const uint32_t gx = opaque_u32(static_cast<uint32_t>(g));
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const uint32_t chunk = ((2u * (j % 4) + static_cast<uint32_t>(c / 2)) ^ gx) * 16u;
            const uint32_t addr = row_addr + (j / 4) * 64u * 128u + chunk + static_cast<uint32_t>(c % 2) * 8u;
#pragma unroll
            for (int half = 0; half < 2; ++half)
              st_shared_f2(addr + half * 8u * 128u, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
          }
          fence_proxy_async();
          named_barrier_sync(2 + cw, 128);
          if (tid == 0) {
            const int first_row = static_cast<int>(seq.q_first_row[s_idx] + row0);
            const int col0 = QKC == 64 || Cfg::kDqSplit == DqSplit::keys ? 0 : 64 * cw;
            tma_reduce_add_3d(dq_map, stage_box, col0, head, first_row);
            tma_reduce_add_3d(dq_map, stage_box + 64 * 128, col0 + 32, head, first_row);
            bulk_commit_group();
          }
        }
      } else if (adds) {
        const int64_t first_row = seq.q_first_row[s_idx] + row0;
        const int col0 = Cfg::kDqSplit == DqSplit::keys || QKC == 64 ? 0 : 64 * cw;
        float* dq_rows = p.dq_accum + first_row * q_stride + static_cast<int64_t>(head) * D + col0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + g + 8 * half;
          if (r < valid) {
#pragma unroll
            for (int j = 0; j < Cfg::kDqCols / 8; ++j)
              if (col0 + 8 * j < D)  // padded columns (d_qk 32, 96) are not the row's
                atomicAdd(reinterpret_cast<float2*>(dq_rows + r * q_stride + 8 * j + 2 * c),
                          make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]));
          }
        }
      }
    } else {
      wgmma_wait<0>();
      fence_registers(dk);
      fence_registers(dv);
      fence_registers(pa);
      fence_registers(dsa);
      ring.release(it);
    }
  }

  if constexpr (Cfg::kTmaDq) {
    if (tid == 0) bulk_wait_group<0>();  // the staging stays valid until the last reduce has read it
  }

  // Epilogue: dK = scale dS^T Q, dV = P^T dO staged as dtype in this warpgroup's rows of the K and V tiles (every
  // wgmma read of K and V is complete once both warpgroups pass the barrier: the other's dQ products read all of K),
  // then written (or added, summing form) for the tile's valid rows.
  named_barrier_sync(1, Cfg::kConsumerThreads);
  uint8_t* k_ptr = smem_ptr + Cfg::kOffK;
  uint8_t* v_ptr = smem_ptr + Cfg::kOffV;
  stage_accumulators<T, BN, QKC>(k_ptr, 64 * cw, dk, p.softmax_scale, warp, g, c);
  stage_accumulators<T, BN, VC>(v_ptr, 64 * cw, dv, 1.f, warp, g, c);
  named_barrier_sync(2 + cw, 128);
  const int rows = max(0, min(64, kv_tile.rows - 64 * cw));
  constexpr int DV = Cfg::DV;
  const int64_t k_stride = static_cast<int64_t>(p.heads_kv) * D, v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const bool summing = p.dk_sum != nullptr;
  const int64_t first = kv_tile.first_row + 64 * cw;
  // Staging rows 64 cw ..: offset the tile by 64 cw rows (column blocks are BN rows apart, so read through the
  // BN-row formula with the row shifted).
  const uint8_t* k_rows = k_ptr;
  const uint8_t* v_rows = v_ptr;
  if (!summing) {
    T* dk_out = static_cast<T*>(p.dk) + first * k_stride + static_cast<int64_t>(kv_head) * D;
    T* dv_out = static_cast<T*>(p.dv) + first * v_stride + static_cast<int64_t>(kv_head) * DV;
    if constexpr (D == DV) {
      constexpr int kChunks = D / 8;
      for (int i = tid; i < rows * kChunks; i += 128) {
        const int r = i / kChunks, ch = i % kChunks;
        const int64_t off = r * k_stride + ch * 8;
        *reinterpret_cast<uint4*>(dk_out + off) =
            *reinterpret_cast<const uint4*>(k_rows + sw128_offset(BN, 64 * cw + r, ch * 8));
        *reinterpret_cast<uint4*>(dv_out + off) =
            *reinterpret_cast<const uint4*>(v_rows + sw128_offset(BN, 64 * cw + r, ch * 8));
      }
    } else {
      for (int i = tid; i < rows * (D / 8); i += 128) {
        const int r = i / (D / 8), ch = i % (D / 8);
        *reinterpret_cast<uint4*>(dk_out + r * k_stride + ch * 8) =
            *reinterpret_cast<const uint4*>(k_rows + sw128_offset(BN, 64 * cw + r, ch * 8));
      }
      for (int i = tid; i < rows * (DV / 8); i += 128) {
        const int r = i / (DV / 8), ch = i % (DV / 8);
        *reinterpret_cast<uint4*>(dv_out + r * v_stride + ch * 8) =
            *reinterpret_cast<const uint4*>(v_rows + sw128_offset(BN, 64 * cw + r, ch * 8));
      }
    }
  } else {
    const int64_t* map = p.kv_sum_rows + first;
    add_rows_to_sum<T, kSumBatch>(
        rows, D / 4, map, k_stride, static_cast<int64_t>(kv_head) * D, p.dk_sum, p.dk_sum_assign != 0,
        static_cast<T*>(p.dk_result),
        [&](int r, int col) { return *reinterpret_cast<const uint2*>(k_rows + sw128_offset(BN, 64 * cw + r, col)); },
        tid, 128);
    add_rows_to_sum<T, kSumBatch>(
        rows, DV / 4, map, v_stride, static_cast<int64_t>(kv_head) * DV, p.dv_sum, p.dv_sum_assign != 0,
        static_cast<T*>(p.dv_result),
        [&](int r, int col) { return *reinterpret_cast<const uint2*>(v_rows + sw128_offset(BN, 64 * cw + r, col)); },
        tid, 128);
  }
}

// Consumer warpgroup CW of BackwardWideSm90Config's dK/dV pass (see there): all 64 keys of the tile, its column
// blocks of dK, dV (and dQ).
template <class Cfg, int CW>
__device__ __forceinline__ void wide_consume(const AttentionParams& p, const Watchdog& dog, const RowTile& kv_tile,
                                             const SequenceDesc& seq, const QueryBlocks<Cfg::kBlockM>& qb,
                                             uint32_t smem, uint8_t* smem_ptr, uint32_t kv_full,
                                             Ring<Cfg::kStages> ring, int kv_head, const CUtensorMap* dq_map) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D, DV = Cfg::DV;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  constexpr int QC = BM / 2;  // query columns of this warpgroup's S^T and dP^T
  constexpr int NK = 64 * Cfg::k_blocks(CW), K0 = 64 * Cfg::k_first(CW);  // its d_qk columns (dK, dQ)
  constexpr int NV = 64 * Cfg::v_blocks(CW), V0 = 64 * Cfg::v_first(CW);  // its d_v columns (dV; may be none)
  const int tid = threadIdx.x - 128 * (CW + 1);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int64_t delta_pos = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const int kv_pos = seq.kv_position[kv_tile.segment];
  const int kv_count = seq.kv_count[kv_tile.segment];
  const int key0 = kv_tile.position - kv_pos;
  const int64_t kp_lo = kv_tile.position, kp_hi = static_cast<int64_t>(kv_tile.position) + kv_tile.rows - 1;
  const bool keys_full = kv_tile.rows == BN;
  const float sl2 = p.scale_log2;
  const uint32_t k_tile = smem + Cfg::kOffK, v_tile = smem + Cfg::kOffV;

  float dk[NK / 2], dv[NV > 0 ? NV / 2 : 1];
#pragma unroll
  for (int i = 0; i < NK / 2; ++i) dk[i] = 0.f;
#pragma unroll
  for (int i = 0; i < (NV > 0 ? NV / 2 : 1); ++i) dv[i] = 0.f;

  if (qb.total > 0) {
    mbar_wait(kv_full, 0, dog, kWaitKV, -1);
    fence_proxy_async();
  }
#pragma unroll 1
  for (int it = 0; it < qb.total; ++it) {
    const int stage = ring.stage(it);
    const int head = kv_head * p.group + qb.head_offset(it);
    const int s_idx = qb.segment(it);
    const int row0 = qb.row0(it);
    const int q_count = seq.q_count[s_idx];
    const int q_pos = seq.q_position[s_idx];
    const int valid = min(BM, q_count - row0);
    const uint32_t q_tile = smem + Cfg::kOffQ + stage * Cfg::kQBytes;
    const uint32_t do_tile = smem + Cfg::kOffDo + stage * Cfg::kDoBytes;
    const float* lse_s = reinterpret_cast<const float*>(smem_ptr + Cfg::kOffLse) + stage * BM + QC * CW;
    const float* delta_s = reinterpret_cast<const float*>(smem_ptr + Cfg::kOffDelta) + stage * BM + QC * CW;

    // S^T = K Q^T and dP^T = V dO^T: 64 keys x this warpgroup's 32 queries.
    float st[QC / 2], dpt[QC / 2];
#pragma unroll
    for (int i = 0; i < QC / 2; ++i) st[i] = dpt[i] = 0.f;
    mbar_wait(ring.full_k(it), ring.parity(it), dog, kWaitQStage, it);
    fence_proxy_async();
    fence_registers(st);
    fence_registers(dpt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      Wgmma<QC, T, 0>::ss(st, desc_k_major(k_tile, BN, 0, 16 * kk), desc_k_major(q_tile, BM, QC * CW, 16 * kk),
                          kk > 0 ? 1 : 0);
    wgmma_commit();
    mbar_wait(ring.full_v(it), ring.parity(it), dog, kWaitDoStage, it);
    fence_proxy_async();
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk)
      Wgmma<QC, T, 0>::ss(dpt, desc_k_major(v_tile, BN, 0, 16 * kk), desc_k_major(do_tile, BM, QC * CW, 16 * kk),
                          kk > 0 ? 1 : 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(st);
    fence_registers(dpt);

    const int64_t qp_lo = static_cast<int64_t>(q_pos) + row0, qp_hi = qp_lo + valid - 1;
    const bool full = keys_full && valid == BM &&
                      tile_fully_visible(p.window_left, p.window_right, delta_pos, qp_lo, qp_hi, kp_lo, kp_hi);
    if (!full)
      apply_mask_transposed<QC>(st, p.window_left, p.window_right, delta_pos, key0 + 16 * warp + g, kv_pos, kv_count,
                                row0 + QC * CW, q_pos, q_count, c);
    // P^T and dS^T, as in BackwardSm90Config.
    probabilities_t<QC>(st, lse_s, sl2, c);
    score_grads_t<QC>(dpt, st, delta_s, c);
    uint32_t pa[QC / 16][4], dsa[QC / 16][4];
    accumulators_to_a<T, QC / 16>(pa, st);
    accumulators_to_a<T, QC / 16>(dsa, dpt);
    // Into the shared tiles as [keys][queries] (the fragment registers are key g.., queries 16 k + 2 c..). One
    // buffer: both warpgroups' products of block it - 1 have read it once both pass this barrier. Two buffers:
    // buffer it % 2 was last read by the products of block it - 2, complete before either passed the barrier of
    // block it - 1.
    const int buf = Cfg::kPBuffers == 2 ? it % 2 : 0;
    if constexpr (Cfg::kPBuffers == 1) named_barrier_sync(1, Cfg::kConsumerThreads);
    uint8_t* p_ptr = smem_ptr + Cfg::kOffP + buf * Cfg::kPBytes;
    uint8_t* ds_ptr = smem_ptr + Cfg::kOffDs + buf * Cfg::kPBytes;
    const int kr = 16 * warp + g;
#pragma unroll
    for (int k = 0; k < QC / 16; ++k) {
      const int col = QC * CW + 16 * k + 2 * c;
      *reinterpret_cast<uint32_t*>(p_ptr + sw128_offset(BN, kr, col)) = pa[k][0];
      *reinterpret_cast<uint32_t*>(p_ptr + sw128_offset(BN, kr + 8, col)) = pa[k][1];
      *reinterpret_cast<uint32_t*>(p_ptr + sw128_offset(BN, kr, col + 8)) = pa[k][2];
      *reinterpret_cast<uint32_t*>(p_ptr + sw128_offset(BN, kr + 8, col + 8)) = pa[k][3];
      *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr, col)) = dsa[k][0];
      *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr + 8, col)) = dsa[k][1];
      *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr, col + 8)) = dsa[k][2];
      *reinterpret_cast<uint32_t*>(ds_ptr + sw128_offset(BN, kr + 8, col + 8)) = dsa[k][3];
    }
    fence_proxy_async();
    named_barrier_sync(1, Cfg::kConsumerThreads);
    const uint32_t p_tile = smem + Cfg::kOffP + buf * Cfg::kPBytes;
    const uint32_t ds_tile = smem + Cfg::kOffDs + buf * Cfg::kPBytes;

    // dV[:, V0 ..] += P^T dO[:, V0 ..] and dK[:, K0 ..] += dS^T Q[:, K0 ..] (SS: A the [keys][queries] tiles,
    // K-major; dO and Q MN-major from their column block on).
    fence_registers(dk);
    fence_registers(dv);
    wgmma_fence();
    if constexpr (NV > 0) {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        Wgmma<NV, T, 1>::ss(dv, desc_k_major(p_tile, BN, 0, 16 * kk),
                            desc_mn_major(do_tile + (V0 / 64) * BM * 128, BM, 16 * kk), 1);
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      Wgmma<NK, T, 1>::ss(dk, desc_k_major(ds_tile, BN, 0, 16 * kk),
                          desc_mn_major(q_tile + (K0 / 64) * BM * 128, BM, 16 * kk), 1);
    wgmma_commit();
    if constexpr (Cfg::kAtomicDq) {
      // dQ[:, K0 ..] = dS K[:, K0 ..] over the 64 keys (A = dS through the transpose bit, B = K MN-major).
      float dq[NK / 2];
#pragma unroll
      for (int i = 0; i < NK / 2; ++i) dq[i] = 0.f;
      fence_registers(dq);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        WgmmaTA<NK, T, 1>::ss(dq, desc_mn_major_a(ds_tile, BN, 16 * kk),
                              desc_mn_major(k_tile + (K0 / 64) * BN * 128, BN, 16 * kk), kk > 0 ? 1 : 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(dq);
      fence_registers(dk);
      fence_registers(dv);
      ring.release(it);
      // Boxes of 64 rows x 32 columns (box b: columns K0 + 32 b ..), kDqRoundBoxes at a time in this warpgroup's
      // staging, each round after the previous round's reduces have read it (layout and row argument as in
      // bwd_consume's TMA dQ).
      constexpr int kBoxes = NK / 32, RB = Cfg::kDqRoundBoxes;
      const uint32_t stage_base = smem + Cfg::kOffDqStage + CW * RB * Cfg::kBoxBytes;
      const uint32_t row_addr = stage_base + static_cast<uint32_t>(16 * warp + g) * 128u;
      const uint32_t gx = opaque_u32(static_cast<uint32_t>(g));
      const int first_row = static_cast<int>(seq.q_first_row[s_idx] + row0);
#pragma unroll
      for (int b0 = 0; b0 < kBoxes; b0 += RB) {
        if (tid == 0) bulk_wait_group_read<0>();
        named_barrier_sync(2 + CW, 128);
#pragma unroll
        for (int b = b0; b < b0 + RB && b < kBoxes; ++b) {
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int j = 4 * b + jj;
            const uint32_t chunk = ((2u * jj + static_cast<uint32_t>(c / 2)) ^ gx) * 16u;
            const uint32_t addr = row_addr + (b - b0) * Cfg::kBoxBytes + chunk + static_cast<uint32_t>(c % 2) * 8u;
#pragma unroll
            for (int half = 0; half < 2; ++half)
              st_shared_f2(addr + half * 8u * 128u, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
          }
        }
        fence_proxy_async();
        named_barrier_sync(2 + CW, 128);
        if (tid == 0) {
          for (int b = b0; b < b0 + RB && b < kBoxes; ++b)
            tma_reduce_add_3d(dq_map, stage_base + (b - b0) * Cfg::kBoxBytes, K0 + 32 * b, head, first_row);
          bulk_commit_group();
        }
      }
    } else {
      wgmma_wait<0>();
      fence_registers(dk);
      fence_registers(dv);
      ring.release(it);
    }
  }
  if constexpr (Cfg::kTmaDq) {
    if (tid == 0) bulk_wait_group<0>();
  }

  // Epilogue: every wgmma read of K and V (both warpgroups' S^T, dP^T and dQ) is complete once both pass the
  // barrier; this warpgroup's columns of dK (x scale) and dV go as dtype into the same columns of the K and V tiles,
  // then out (or into the sums) for the tile's valid rows.
  named_barrier_sync(1, Cfg::kConsumerThreads);
  uint8_t* k_ptr = smem_ptr + Cfg::kOffK;
  uint8_t* v_ptr = smem_ptr + Cfg::kOffV;
  stage_accumulators<T, BN, NK>(k_ptr, 0, dk, p.softmax_scale, warp, g, c, K0);
  if constexpr (NV > 0) stage_accumulators<T, BN, NV>(v_ptr, 0, dv, 1.f, warp, g, c, V0);
  named_barrier_sync(2 + CW, 128);
  const int rows = kv_tile.rows;
  const int64_t k_stride = static_cast<int64_t>(p.heads_kv) * D, v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const int64_t first = kv_tile.first_row;
  if (p.dk_sum == nullptr) {
    T* dk_out = static_cast<T*>(p.dk) + first * k_stride + static_cast<int64_t>(kv_head) * D + K0;
    for (int i = tid; i < rows * (NK / 8); i += 128) {
      const int r = i / (NK / 8), ch = i % (NK / 8);
      *reinterpret_cast<uint4*>(dk_out + r * k_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(k_ptr + sw128_offset(BN, r, K0 + ch * 8));
    }
    if constexpr (NV > 0) {
      T* dv_out = static_cast<T*>(p.dv) + first * v_stride + static_cast<int64_t>(kv_head) * DV + V0;
      for (int i = tid; i < rows * (NV / 8); i += 128) {
        const int r = i / (NV / 8), ch = i % (NV / 8);
        *reinterpret_cast<uint4*>(dv_out + r * v_stride + ch * 8) =
            *reinterpret_cast<const uint4*>(v_ptr + sw128_offset(BN, r, V0 + ch * 8));
      }
    }
  } else {
    const int64_t* map = p.kv_sum_rows + first;
    add_rows_to_sum<T, kSumBatch>(
        rows, NK / 4, map, k_stride, static_cast<int64_t>(kv_head) * D + K0, p.dk_sum, p.dk_sum_assign != 0,
        static_cast<T*>(p.dk_result),
        [&](int r, int col) { return *reinterpret_cast<const uint2*>(k_ptr + sw128_offset(BN, r, K0 + col)); }, tid,
        128);
    if constexpr (NV > 0)
      add_rows_to_sum<T, kSumBatch>(
          rows, NV / 4, map, v_stride, static_cast<int64_t>(kv_head) * DV + V0, p.dv_sum, p.dv_sum_assign != 0,
          static_cast<T*>(p.dv_result),
          [&](int r, int col) { return *reinterpret_cast<const uint2*>(v_ptr + sw128_offset(BN, r, V0 + col)); },
          tid, 128);
  }
}

}  // namespace detail

// One CTA per (key tile of p.kv_tiles with kBlockN rows: 128, or 64 for BackwardWideSm90Config, kv head); grid
// (kv_tile_count, heads_kv).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_backward_dkdv_sm90_kernel(const AttentionParams p, const __grid_constant__ CUtensorMap dq_map,
                                        const Watchdog dog) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  uint8_t* smem_ptr = smem_raw + (smem - raw);

  const RowTile kv_tile = p.kv_tiles[blockIdx.x];
  const int kv_head = blockIdx.y;
  if (kv_tile.sequence < 0) {  // K/V rows outside every segment: dK = dV = 0 (or +0)
    constexpr int DV = Cfg::DV;
    detail::store_zero_rows<T, D, Cfg::kThreads>(kv_tile.first_row, kv_tile.rows, static_cast<T*>(p.dk),
                                                 static_cast<int64_t>(p.heads_kv) * D, static_cast<int64_t>(kv_head) * D,
                                                 p.dk_sum, p.kv_sum_rows, p.dk_sum_assign != 0,
                                                 static_cast<T*>(p.dk_result), threadIdx.x);
    detail::store_zero_rows<T, DV, Cfg::kThreads>(kv_tile.first_row, kv_tile.rows, static_cast<T*>(p.dv),
                                                  static_cast<int64_t>(p.heads_kv) * DV,
                                                  static_cast<int64_t>(kv_head) * DV, p.dv_sum, p.kv_sum_rows,
                                                  p.dv_sum_assign != 0, static_cast<T*>(p.dv_result), threadIdx.x);
    return;
  }
  const SequenceDesc& seq = p.sequences[kv_tile.sequence];
  const detail::QueryBlocks<Cfg::kBlockM> qb(p, seq, kv_tile);
  const uint32_t kv_full = smem + Cfg::kOffBarriers;
  const Ring<Cfg::kStages> ring{smem + Cfg::kOffBarriers + 8};
  if (threadIdx.x == 0) {
    mbar_init(kv_full, 128);
    ring.init(128, Cfg::kConsumerThreads);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    detail::bwd_produce<Cfg>(p, dog, kv_tile, seq, qb, smem, kv_full, ring, kv_head);
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    if constexpr (Cfg::kHeadSplit) {
      if (threadIdx.x < 256)
        detail::wide_consume<Cfg, 0>(p, dog, kv_tile, seq, qb, smem, smem_ptr, kv_full, ring, kv_head, &dq_map);
      else
        detail::wide_consume<Cfg, 1>(p, dog, kv_tile, seq, qb, smem, smem_ptr, kv_full, ring, kv_head, &dq_map);
    } else {
      detail::bwd_consume<Cfg>(p, dog, kv_tile, seq, qb, smem, smem_ptr, kv_full, ring, kv_head,
                               threadIdx.x / 128 - 1, &dq_map);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Deterministic dQ pass.

namespace detail {

template <class Cfg>
__device__ __forceinline__ void dq_produce(const AttentionParams& p, const Watchdog& dog, const RowTile& tile,
                                           const SequenceDesc& seq, const KeyBlocks<Cfg::kBlockN>& kb,
                                           uint32_t smem, uint32_t q_full, Ring<Cfg::kStages> ring, int head) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  const int tid = threadIdx.x;
  if (kb.total == 0) return;
  constexpr int DV = Cfg::DV;
  const int kv_head = head / p.group;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D, do_stride = static_cast<int64_t>(p.heads_q) * DV;
  const int64_t k_stride = static_cast<int64_t>(p.heads_kv) * D, v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  load_tile_sw128_cp_async<Cfg::kBlockM, Cfg::kQKCols, 128, T, D>(
      smem + Cfg::kOffQ, q + tile.first_row * q_stride + static_cast<int64_t>(head) * D, q_stride, tile.rows, q, tid);
  load_tile_sw128_cp_async<Cfg::kBlockM, Cfg::kVCols, 128, T, DV>(
      smem + Cfg::kOffDo, dout + tile.first_row * do_stride + static_cast<int64_t>(head) * DV, do_stride, tile.rows,
      dout, tid);
  mbar_arrive_on_cp_async(q_full);
#pragma unroll 1
  for (int it = 0; it < kb.total; ++it) {
    const int stage = ring.stage(it);
    ring.producer_acquire(it, dog);
    const int s = kb.segment(it);
    const int key0 = kb.key0(it);
    const int valid = min(Cfg::kBlockN, seq.kv_count[s] - key0);
    const int64_t row = seq.kv_first_row[s] + key0;
    load_tile_sw128_cp_async<Cfg::kBlockN, Cfg::kQKCols, 128, T, D>(
        smem + Cfg::kOffK + stage * Cfg::kKBytes, k + row * k_stride + static_cast<int64_t>(kv_head) * D, k_stride,
        valid, k, tid);
    mbar_arrive_on_cp_async(ring.full_k(it));
    load_tile_sw128_cp_async<Cfg::kBlockN, Cfg::kVCols, 128, T, DV>(
        smem + Cfg::kOffV + stage * Cfg::kVBytes, v + row * v_stride + static_cast<int64_t>(kv_head) * DV, v_stride,
        valid, v, tid);
    mbar_arrive_on_cp_async(ring.full_v(it));
  }
  cp_async_wait_all();
}

template <class Cfg>
__device__ __forceinline__ void dq_consume(const AttentionParams& p, const Watchdog& dog, const RowTile& tile,
                                           const SequenceDesc& seq, const KeyBlocks<Cfg::kBlockN>& kb, uint32_t smem,
                                           uint8_t* smem_ptr, uint32_t q_full, Ring<Cfg::kStages> ring, int head,
                                           int cw) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  constexpr int BN = Cfg::kBlockN;
  const int tid = threadIdx.x - 128 * (cw + 1);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int64_t delta_pos = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const int64_t qp_lo = tile.position, qp_hi = static_cast<int64_t>(tile.position) + tile.rows - 1;
  const int64_t qp0 = static_cast<int64_t>(tile.position) + 64 * cw + 16 * warp + g;
  const float sl2 = p.scale_log2;
  float lse2[2], dl[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 64 * cw + 16 * warp + g + 8 * half;
    const int64_t index = static_cast<int64_t>(head) * p.q_rows + tile.first_row + r;
    lse2[half] = r < tile.rows ? lse_to_log2(p.lse[index]) : INFINITY;
    dl[half] = r < tile.rows ? p.delta[index] : 0.f;
  }
  constexpr int QKC = Cfg::kQKCols;
  float dq[QKC / 2];
#pragma unroll
  for (int i = 0; i < QKC / 2; ++i) dq[i] = 0.f;
  const uint32_t q_tile = smem + Cfg::kOffQ, do_tile = smem + Cfg::kOffDo;
  if (kb.total > 0) {
    mbar_wait(q_full, 0, dog, kWaitQdO, -1);
    fence_proxy_async();
  }
#pragma unroll 1
  for (int it = 0; it < kb.total; ++it) {
    const int stage = ring.stage(it);
    const int s_idx = kb.segment(it);
    const int key0 = kb.key0(it);
    const int kv_count = seq.kv_count[s_idx];
    const int kv_pos = seq.kv_position[s_idx];
    const int valid = min(BN, kv_count - key0);
    const uint32_t k_tile = smem + Cfg::kOffK + stage * Cfg::kKBytes;
    const uint32_t v_tile = smem + Cfg::kOffV + stage * Cfg::kVBytes;
    float s[BN / 2], dp[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.f;
    mbar_wait(ring.full_k(it), ring.parity(it), dog, kWaitKStage, it);
    fence_proxy_async();
    fence_registers(s);
    fence_registers(dp);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      Wgmma<BN, T, 0>::ss(s, desc_k_major(q_tile, Cfg::kBlockM, 64 * cw, 16 * kk), desc_k_major(k_tile, BN, 0, 16 * kk),
                          kk > 0 ? 1 : 0);
    wgmma_commit();
    mbar_wait(ring.full_v(it), ring.parity(it), dog, kWaitVStage, it);
    fence_proxy_async();
#pragma unroll
    for (int kk = 0; kk < Cfg::DV / 16; ++kk)
      Wgmma<BN, T, 0>::ss(dp, desc_k_major(do_tile, Cfg::kBlockM, 64 * cw, 16 * kk),
                          desc_k_major(v_tile, BN, 0, 16 * kk), kk > 0 ? 1 : 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);
    fence_registers(dp);
    const bool full = valid == BN && tile_fully_visible(p.window_left, p.window_right, delta_pos, qp_lo, qp_hi,
                                                        kv_pos + key0, kv_pos + key0 + BN - 1);
    if (!full) apply_mask<BN>(s, p.window_left, p.window_right, delta_pos, qp0, key0, kv_pos, kv_count, c);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e / 2;
        const float pr = exp2f(fmaf(s[4 * j + e], sl2, -lse2[half]));
        dp[4 * j + e] = pr * (dp[4 * j + e] - dl[half]);
      }
    }
    uint32_t dsa[BN / 16][4];
    accumulators_to_a<T, BN / 16>(dsa, dp);
    fence_registers(dq);
    fence_registers(dsa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) Wgmma<QKC, T, 1>::rs(dq, dsa[kk], desc_mn_major(k_tile, BN, 16 * kk), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dq);
    fence_registers(dsa);
    ring.release(it);
  }
  // dQ = scale dS K, staged as dtype in this warpgroup's rows of the Q tile (its wgmma reads are complete).
  fence_proxy_async();
  uint8_t* q_ptr = smem_ptr + Cfg::kOffQ;
  stage_accumulators<T, Cfg::kBlockM, QKC>(q_ptr, 64 * cw, dq, p.softmax_scale, warp, g, c);
  named_barrier_sync(2 + cw, 128);
  const int rows = max(0, min(64, tile.rows - 64 * cw));
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t first = tile.first_row + 64 * cw;
  const int64_t col0 = static_cast<int64_t>(head) * D;
  if (p.dq_sum == nullptr) {
    T* out = static_cast<T*>(p.dq) + first * q_stride;
    constexpr int kChunks = D / 8;
    for (int i = tid; i < rows * kChunks; i += 128) {
      const int r = i / kChunks, ch = i % kChunks;
      *reinterpret_cast<uint4*>(out + r * q_stride + col0 + ch * 8) =
          *reinterpret_cast<const uint4*>(q_ptr + sw128_offset(Cfg::kBlockM, 64 * cw + r, ch * 8));
    }
  } else {
    add_rows_to_sum<T, kSumBatch>(
        rows, D / 4, p.q_sum_rows + first, q_stride, col0, p.dq_sum, p.dq_sum_assign != 0,
        static_cast<T*>(p.dq_result),
        [&](int r, int col) {
          return *reinterpret_cast<const uint2*>(q_ptr + sw128_offset(Cfg::kBlockM, 64 * cw + r, col));
        },
        tid, 128);
  }
}

}  // namespace detail

// One CTA per (Q tile of p.q_tiles with kBlockM = 128 rows, query head); grid (q_tile_count, heads_q).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_backward_dq_sm90_kernel(const AttentionParams p, const Watchdog dog) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  uint8_t* smem_ptr = smem_raw + (smem - raw);
  const RowTile tile = p.q_tiles[blockIdx.x];
  const int head = blockIdx.y;
  if (tile.sequence < 0) {
    detail::store_zero_rows<T, D, Cfg::kThreads>(tile.first_row, tile.rows, static_cast<T*>(p.dq),
                                                 static_cast<int64_t>(p.heads_q) * D, static_cast<int64_t>(head) * D,
                                                 p.dq_sum, p.q_sum_rows, p.dq_sum_assign != 0,
                                                 static_cast<T*>(p.dq_result), threadIdx.x);
    return;
  }
  const SequenceDesc& seq = p.sequences[tile.sequence];
  const detail::KeyBlocks<Cfg::kBlockN> kb(p, seq, tile);
  const uint32_t q_full = smem + Cfg::kOffBarriers;
  const Ring<Cfg::kStages> ring{smem + Cfg::kOffBarriers + 8};
  if (threadIdx.x == 0) {
    mbar_init(q_full, 128);
    ring.init(128, Cfg::kConsumerThreads);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    detail::dq_produce<Cfg>(p, dog, tile, seq, kb, smem, q_full, ring, head);
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    detail::dq_consume<Cfg>(p, dog, tile, seq, kb, smem, smem_ptr, q_full, ring, head, threadIdx.x / 128 - 1);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Small kernels of the backward: delta, dQ conversion and its summing form.

// ---------------------------------------------------------------------------------------------------------------
// Host side.

// The float32 dQ accumulator [q_rows, heads_q, d] as the TMA reduce's destination: boxes of 32 columns (128 bytes)
// by 64 rows.
inline std::string encode_dq_accum_map(CUtensorMap& map, float* dq_accum, int64_t q_rows, int heads_q, int d) {
  return encode_thd_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, dq_accum, q_rows, heads_q, d, 32, 64);
}

// The whole backward on p with the dK/dV pass Cfg (BackwardSm90Config or BackwardWideSm90Config) and, in
// deterministic mode, the dQ pass DqCfg: p.q_tiles must have DqCfg::kBlockM = 128 rows per tile (work and pad tiles
// covering every Q row), p.kv_tiles Cfg::kBlockN rows (covering every KV row); p.o, p.lse, p.dout inputs; p.delta
// [heads_q, q_rows] float workspace; atomic mode: p.dq_accum [q_rows, heads_q, d_qk] float workspace. Writes
// dq/dk/dv (or the summing form). compute_delta false: p.delta already holds the rows' delta (attention_row_delta,
// the same summation order as the delta kernel here) and is only read. Returns "" or the failed call.
template <class Cfg, class DqCfg>
std::string launch_backward_sm90_passes(const AttentionParams& p, Watchdog dog, cudaStream_t stream,
                                        bool compute_delta) {
  using T = typename Cfg::T;
  constexpr int D = Cfg::D, DV = Cfg::DV;
  constexpr bool ATOMIC_DQ = Cfg::kAtomicDq;
  static_assert(std::is_same_v<T, typename DqCfg::T> && DqCfg::D == D && DqCfg::DV == DV, "one head-dim pair");
  auto fail = [](const char* what, cudaError_t e) { return std::string(what) + ": " + cudaGetErrorString(e); };
  if (compute_delta && p.q_tile_count > 0 && p.heads_q > 0) {
    attention_backward_delta_kernel<T, DV><<<dim3(p.q_tile_count, p.heads_q), 128, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return fail("delta kernel launch", e);
  }
  if (ATOMIC_DQ && p.q_rows > 0) {
    if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, static_cast<size_t>(p.q_rows) * p.heads_q * D * 4, stream);
        e != cudaSuccess)
      return fail("cudaMemsetAsync(dq_accum)", e);
  }
  if (p.kv_tile_count > 0 && p.heads_kv > 0) {
    auto kernel = attention_backward_dkdv_sm90_kernel<Cfg>;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
        e != cudaSuccess)
      return fail("cudaFuncSetAttribute(dkdv)", e);
    CUtensorMap dq_map;
    std::memset(&dq_map, 0, sizeof dq_map);
    if constexpr (Cfg::kTmaDq) {
      if (p.q_rows > 0)
        if (std::string err = encode_dq_accum_map(dq_map, p.dq_accum, p.q_rows, p.heads_q, D); !err.empty())
          return "dQ accumulator tensor map: " + err;
    }
    kernel<<<dim3(p.kv_tile_count, p.heads_kv), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, dq_map, dog);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return fail("dkdv kernel launch", e);
  }
  if (p.q_tile_count > 0 && p.heads_q > 0) {
    if constexpr (ATOMIC_DQ) {
      attention_backward_finish_dq_kernel<T>
          <<<dim3(p.q_tile_count, finish_dq_grid_y(static_cast<int64_t>(p.heads_q) * D, DqCfg::kBlockM)), 128, 0, stream>>>(
              p, static_cast<int64_t>(p.heads_q) * D);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return fail("dq finish kernel launch", e);
    } else {
      auto kernel = attention_backward_dq_sm90_kernel<DqCfg>;
      if (cudaError_t e =
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, DqCfg::kSmemBytes);
          e != cudaSuccess)
        return fail("cudaFuncSetAttribute(dq)", e);
      kernel<<<dim3(p.q_tile_count, p.heads_q), DqCfg::kThreads, DqCfg::kSmemBytes, stream>>>(p, dog);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return fail("dq kernel launch", e);
    }
  }
  return {};
}

// The backward of head dims up to 128 (BackwardSm90Config: p.kv_tiles of 128 rows).
template <class T, int D, bool ATOMIC_DQ, DqSplit DQ_SPLIT = DqSplit::columns, bool OVERLAP = false,
          bool TMA_DQ = false, int DV = D>
std::string launch_backward_sm90(const AttentionParams& p, Watchdog dog, cudaStream_t stream,
                                 bool compute_delta = true) {
  return launch_backward_sm90_passes<BackwardSm90Config<T, D, ATOMIC_DQ, DQ_SPLIT, OVERLAP, TMA_DQ, DV>,
                                     BackwardDqSm90Config<T, D, DV>>(p, dog, stream, compute_delta);
}

// The backward of the wide head dims 192/128 and 256/256 (BackwardWideSm90Config: p.kv_tiles of 64 rows).
template <class T, int D, int DV, bool ATOMIC_DQ>
std::string launch_backward_wide_sm90(const AttentionParams& p, Watchdog dog, cudaStream_t stream,
                                      bool compute_delta = true) {
  return launch_backward_sm90_passes<BackwardWideSm90Config<T, D, DV, ATOMIC_DQ>, BackwardDqSm90Config<T, D, DV>>(
      p, dog, stream, compute_delta);
}

}  // namespace cpgold::gpu::sm90
