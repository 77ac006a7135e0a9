// Varlen attention kernels (forward, backward) for sm_90 on AttentionParams (gpu/kernels/attention/kernel_params.hpp).
//
// Version history (measured on the device named in lab/records/gpu-results.md / lab/records/perf.md; TFLOP/s are bf16,
// causal, d=128, 16k tokens unless said otherwise):
//   v1  FlashAttention-2 structure on mma.sync m16n8k16 (bf16/fp16 in, float32 accumulate), ldmatrix from
//       padded shared-memory tiles (row pitch d + 8 elements: conflict-free), cp.async 16-byte loads with
//       zero-fill for rows outside a segment (their bytes are never read), online softmax in float32 with exp2.
//       Forward: one CTA per (64-row Q tile, head), 4 warps x 16 rows, 64-key K/V tiles, P kept in registers as
//       the A operand of P.V. Backward: KV-stationary CTA per (64-key tile, kv head) looping over the query
//       heads of its group and the Q tiles the mask lets through; dK/dV in registers (bitwise reproducible);
//       dQ by float32 atomics (atomic mode) or by a separate Q-stationary pass (deterministic mode).
//       Measured (H100, commit 179694b): forward 201 TFLOP/s (0.78x PyTorch varlen_attn's 258), backward atomic
//       117 (0.53x of 221), deterministic 161 (0.73x); causal d=128 16k tokens.
//   v2  Backward atomic dQ: each warp stages its 16 x 32 float32 dQ chunk in shared memory and adds it with
//       float4 atomics (a quarter of the atomics, coalesced). Prediction: the atomic path was slower than the
//       deterministic one (117 vs 161), so atomics dominate; expect about 150-180.
//       Measured (commit 91fd1c2 + v2): backward atomic 161 TFLOP/s at 16k, 183 at 64k (was 117 / 125): hit.
//   v2b (tried, reverted) Forward K/V pipelining in one buffer: K of tile i+1 loading during P.V of tile i, V during
//       Q.K^T and softmax. Predicted +10-20%; measured 192 vs 201 (d=128, 16k) and 163 vs 185 (d=64): no gain, a
//       loss at d=64 (a third barrier per tile; three CTAs per SM already hide the loads). Forward stays v1.
//   v3  (tried, reverted) Backward dK/dV kernel with 8 warps for d_qk > 128 (192/128): warps w and w + 4 shared a
//       16-row block and split the S/dP key columns and the dK/dV/dQ columns in halves (80 accumulator floats per
//       thread instead of 160). ptxas: 192/128 atomic 255 regs + 208 B spills -> 254 regs, 0 spills; deterministic
//       136 B -> 0. Occupancy the same 8 warps per SM (1 CTA x 8 instead of 2 x 4; shared memory 111.5 -> 120.5 KB).
//       Predicted 192/128 backward +5-15%. Measured (H200, commit 0df7012, A/B builds in one run; bf16, 16k/32k/64k
//       tokens): atomic causal 141.8 / 146.6 / 148.2 TFLOP/s vs 137.8 / 145.8 / 150.0 with 4 warps (+3% .. -1%),
//       full 154.7 / 156.0 / 159.5 vs 159.5 / 163.9 / 165.3 (-3..-5%); deterministic causal 141.1 / 146.9 / 149.3 vs
//       152.6 / 162.6 / 166.5 (-8..-10%), full 150.1 / 152.8 / 155.5 vs 172.2 / 177.1 / 179.1 (-13%). Repeat of the
//       8-warp build within 1%. Forcing 8 warps on 128/128 and 64/64 lost too (128 causal 16k atomic 144.1 vs
//       169.5). Miss: the spills were L1-resident and cheap; two independent 4-warp CTAs per SM hide each other's
//       barrier waits, one 8-warp CTA does not, and each Q/dO A fragment is read by two warps. Backward stays v2.
//
// Conventions. Accumulator fragment of mma.m16n8k16 for lane = 4 * g + t: c[0], c[1] -> row g, columns 2t, 2t+1;
// c[2], c[3] -> row g + 8. A fragment a[0..3] -> (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..),
// (row g+8, k 2t+8..); B fragment b[0], b[1] -> (k 2t.., column g), (k 2t+8.., column g).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "gpu/kernels/attention/backward_rows.cuh"
#include "gpu/kernels/attention/kernel_params.hpp"
#include "gpu/kernels/attention/mask_ranges.cuh"
#include "gpu/kernels/attention/online_softmax.cuh"

namespace cpgold::gpu::detail {

inline constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------------------------
// Element types
template <class T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack2<__nv_bfloat16>(lo, hi); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack2<__half>(lo, hi); }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int warp_index() { return static_cast<int>(threadIdx.x / 32); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// 16 bytes global -> shared; with valid == false nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------------------------
// Tiles in shared memory: [ROWS][COLS] with row pitch COLS + 8 elements (16 bytes): ldmatrix rows of one 8x8
// matrix then fall in distinct 16-byte bank groups.
template <int COLS>
struct Pitch {
  static constexpr int value = COLS + 8;
};

// Copies `valid` rows (row stride `stride` elements in global memory) into a ROWS x COLS shared tile; rows past
// `valid` are zero-filled without a global read (`safe` is any readable address, never dereferenced).
template <int ROWS, int COLS, int THREADS, class T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t stride, int valid, const T* safe) {
  constexpr int kChunks = COLS / 8;
  constexpr int kPitch = Pitch<COLS>::value;
#pragma unroll 4
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks;
    const int c = (i % kChunks) * 8;
    const bool ok = r < valid;
    cp_async_16(smem + r * kPitch + c, ok ? gmem + r * stride + c : safe, ok);
  }
}

// Writes `valid` rows of a ROWS x COLS shared tile to global memory with 16-byte stores (cooperative over THREADS).
template <int ROWS, int COLS, int THREADS, class T>
__device__ __forceinline__ void store_tile(T* gmem, int64_t stride, const T* smem, int valid) {
  constexpr int kChunks = COLS / 8;
  constexpr int kPitch = Pitch<COLS>::value;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks;
    const int c = (i % kChunks) * 8;
    if (r < valid) *reinterpret_cast<uint4*>(gmem + r * stride + c) = *reinterpret_cast<const uint4*>(smem + r * kPitch + c);
  }
}

// Adds `valid` rows of a ROWS x COLS shared tile of dtype values (zeros where smem is null: pad rows) in float32 to
// rows map[0..valid) of `sum` (row stride `stride` floats, the tile's columns from `col0`): add_rows_to_sum
// (gpu/kernels/attention/backward_rows.cuh, the sm_90a backward's add), four pieces in flight per thread. With `result` (the
// sum's last contribution), dtype(sum + value) goes there instead and the sum is not written.
template <int ROWS, int COLS, int THREADS, class T>
__device__ __forceinline__ void sum_tile(float* sum, const int64_t* map, int64_t stride, int64_t col0, const T* smem,
                                         int valid, bool assign, T* result) {
  static_assert(COLS % 4 == 0, "float4 columns");
  constexpr int kPitch = Pitch<COLS>::value;
  add_rows_to_sum<T, 4>(
      valid, COLS / 4, map, stride, col0, sum, assign, result,
      [&](int r, int col) {
        return smem == nullptr ? make_uint2(0, 0) : *reinterpret_cast<const uint2*>(smem + r * kPitch + col);
      },
      threadIdx.x, THREADS);
}

// Zeros `rows` rows of COLS elements (16-byte stores).
template <int COLS, int THREADS, class T>
__device__ __forceinline__ void zero_rows(T* gmem, int64_t stride, int rows) {
  constexpr int kChunks = COLS / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += THREADS) {
    const int r = i / kChunks;
    const int c = (i % kChunks) * 8;
    *reinterpret_cast<uint4*>(gmem + r * stride + c) = make_uint4(0, 0, 0, 0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Warp-level products on 16 rows. acc[NT][4] covers 16 x (8 * NT).

// acc += A * Bt^T: A [16][K] row-major in shared memory (pitch lda), Bt [8*NT][K] row-major (pitch ldb).
template <int K, int NT, class T>
__device__ __forceinline__ void warp_gemm_a_bt(float (&acc)[NT][4], const T* a, int lda, const T* bt, int ldb) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "tile shape");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a + (lane % 16) * lda + kk * 16 + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];
      ldsm_x4(bf, bt + (nt * 8 + (lane / 16) * 8 + lane % 8) * ldb + kk * 16 + ((lane / 8) % 2) * 8);
      mma16816<T>(acc[nt], af, bf[0], bf[1]);
      mma16816<T>(acc[nt + 1], af, bf[2], bf[3]);
    }
  }
}

// acc += A * B: A from registers (KT k-steps of 16), B [16*KT][8*NT] row-major in shared memory (pitch ldb).
template <int KT, int NT, class T>
__device__ __forceinline__ void warp_gemm_areg_b(float (&acc)[NT][4], const uint32_t (&a)[KT][4], const T* b,
                                                 int ldb) {
  static_assert(NT % 2 == 0, "tile shape");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];
      ldsm_x4_t(bf, b + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ldb + nt * 8 + (lane / 16) * 8);
      mma16816<T>(acc[nt], a[kk], bf[0], bf[1]);
      mma16816<T>(acc[nt + 1], a[kk], bf[2], bf[3]);
    }
  }
}

// acc += A * B: A [16][K] row-major in shared memory (pitch lda), B [K][8*NT] row-major (pitch ldb).
template <int K, int NT, class T>
__device__ __forceinline__ void warp_gemm_a_b(float (&acc)[NT][4], const T* a, int lda, const T* b, int ldb) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "tile shape");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a + (lane % 16) * lda + kk * 16 + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];
      ldsm_x4_t(bf, b + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ldb + nt * 8 + (lane / 16) * 8);
      mma16816<T>(acc[nt], af, bf[0], bf[1]);
      mma16816<T>(acc[nt + 1], af, bf[2], bf[3]);
    }
  }
}

// acc += At^T * B: At [K][16] row-major in shared memory (pitch ldat; the 16 columns are A's rows),
// B [K][8*NT] row-major (pitch ldb).
template <int K, int NT, class T>
__device__ __forceinline__ void warp_gemm_at_b(float (&acc)[NT][4], const T* at, int ldat, const T* b, int ldb) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "tile shape");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4_t(af, at + (kk * 16 + (lane / 16) * 8 + lane % 8) * ldat + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];
      ldsm_x4_t(bf, b + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ldb + nt * 8 + (lane / 16) * 8);
      mma16816<T>(acc[nt], af, bf[0], bf[1]);
      mma16816<T>(acc[nt + 1], af, bf[2], bf[3]);
    }
  }
}

// Accumulator pairs of 16 x (16 * KT) scores as the A operand of the next product (FlashAttention-2 reuse).
template <class T, int NT>
__device__ __forceinline__ void scores_to_a(uint32_t (&a)[NT / 2][4], const float (&s)[NT][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    a[kk][0] = Elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
    a[kk][1] = Elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
    a[kk][2] = Elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[kk][3] = Elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Stores a warp's 16 x (8*NT) accumulators (times `scale`) as T into a shared tile (pitch ld), rows from `row0`.
template <class T, int NT>
__device__ __forceinline__ void acc_to_smem(T* smem, int ld, const float (&acc)[NT][4], float scale) {
  const int lane = threadIdx.x & 31;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint32_t lo = Elem<T>::pack(acc[nt][0] * scale, acc[nt][1] * scale);
    const uint32_t hi = Elem<T>::pack(acc[nt][2] * scale, acc[nt][3] * scale);
    *reinterpret_cast<uint32_t*>(smem + g * ld + nt * 8 + 2 * t) = lo;
    *reinterpret_cast<uint32_t*>(smem + (g + 8) * ld + nt * 8 + 2 * t) = hi;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Masks from global positions (docs/numerics.md; the visible ranges in gpu/kernels/attention/mask_ranges.cuh): key
// position kp visible to query position qp iff qp + delta - wl <= kp <= qp + delta + wr (a -1 side unbounded); keys
// past a segment's count are never visible.

// Sets masked scores of a warp's 16 x (8*NT) tile to -inf. Row r of the warp has position qp0 + r; column c has
// key index key0 + c within the segment (position kv_pos + index) and is invalid at or past kv_count.
template <int NT>
__device__ __forceinline__ void apply_mask(float (&s)[NT][4], int wl, int wr, int64_t delta, int64_t qp0, int key0,
                                           int kv_pos, int kv_count) {
  const int lane = threadIdx.x & 31;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + nt * 8 + 2 * t + (e & 1);
      const int64_t diag = qp0 + g + (e >= 2 ? 8 : 0) + delta;
      const int64_t kp = kv_pos + key;
      const bool hidden = key >= kv_count || (wr >= 0 && kp > diag + wr) || (wl >= 0 && kp < diag - wl);
      if (hidden) s[nt][e] = -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Forward: O, LSE.

template <class T, int D, int DV, int WARPS>
struct ForwardConfig {
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kBlockM = WARPS * 16;
  static constexpr int kBlockN = 64;
  static constexpr int kLdQ = Pitch<D>::value, kLdK = Pitch<D>::value, kLdV = Pitch<DV>::value;
  static constexpr int kSmemBytes = (kBlockM * kLdQ + kBlockN * kLdK + kBlockN * kLdV) * static_cast<int>(sizeof(T));
  static_assert(D % 16 == 0 && DV % 16 == 0 && DV <= D, "head dims");
};

template <class T, int D, int DV, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) attention_forward_kernel(AttentionParams p) {
  using Cfg = ForwardConfig<T, D, DV, WARPS>;
  constexpr int kNT = Cfg::kBlockN / 8;  // score column tiles
  constexpr int kOT = DV / 8;            // output column tiles
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Cfg::kBlockM * Cfg::kLdQ;
  T* sV = sK + Cfg::kBlockN * Cfg::kLdK;

  const RowTile tile = p.q_tiles[blockIdx.x];
  const int head = blockIdx.y;
  const int kv_head = head / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int g = lane / 4, t = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.heads_kv) * D;
  const int64_t v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const int64_t o_stride = static_cast<int64_t>(p.heads_q) * DV;
  T* o_tile = static_cast<T*>(p.o) + tile.first_row * o_stride + static_cast<int64_t>(head) * DV;

  if (tile.sequence < 0) {  // rows outside every Q segment: O = 0, LSE = -inf
    zero_rows<DV, Cfg::kThreads>(o_tile, o_stride, tile.rows);
    for (int r = threadIdx.x; r < tile.rows; r += Cfg::kThreads)
      p.lse[static_cast<int64_t>(head) * p.q_rows + tile.first_row + r] = -INFINITY;
    return;
  }
  const SequenceDesc& seq = p.sequences[tile.sequence];
  const int64_t delta = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const T* q_base = static_cast<const T*>(p.q);
  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);

  load_tile_async<Cfg::kBlockM, D, Cfg::kThreads>(sQ, q_base + tile.first_row * q_stride + head * D, q_stride,
                                                  tile.rows, q_base);
  cp_async_commit();

  float acc_o[kOT][4];
  zero_acc(acc_o);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int64_t qp_lo = tile.position, qp_hi = tile.position + tile.rows - 1;
  const int64_t warp_qp0 = tile.position + warp * 16;
  const float sl2 = p.scale_log2;

  for (int segment = 0; segment < 2; ++segment) {
    const int kv_count = seq.kv_count[segment];
    if (kv_count <= 0) continue;
    const int kv_pos = seq.kv_position[segment];
    int key_lo, key_hi;
    visible_key_range(p.window_left, p.window_right, delta, qp_lo, qp_hi, kv_pos, kv_count, key_lo, key_hi);
    if (key_lo > key_hi) continue;
    const T* k_seg = k_base + seq.kv_first_row[segment] * kv_stride + kv_head * D;
    const T* v_seg = v_base + seq.kv_first_row[segment] * v_stride + kv_head * DV;
    for (int n_block = key_lo / Cfg::kBlockN; n_block <= key_hi / Cfg::kBlockN; ++n_block) {
      const int key0 = n_block * Cfg::kBlockN;
      const int valid = min(Cfg::kBlockN, kv_count - key0);
      __syncthreads();  // previous K/V tile fully consumed
      load_tile_async<Cfg::kBlockN, D, Cfg::kThreads>(sK, k_seg + key0 * kv_stride, kv_stride, valid, k_base);
      load_tile_async<Cfg::kBlockN, DV, Cfg::kThreads>(sV, v_seg + key0 * v_stride, v_stride, valid, v_base);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();

      float s[kNT][4];
      zero_acc(s);
      warp_gemm_a_bt<D, kNT>(s, sQ + warp * 16 * Cfg::kLdQ, Cfg::kLdQ, sK, Cfg::kLdK);
      const bool full = valid == Cfg::kBlockN &&
                        tile_fully_visible(p.window_left, p.window_right, delta, qp_lo, qp_hi, kv_pos + key0,
                                           kv_pos + key0 + Cfg::kBlockN - 1);
      if (!full) apply_mask(s, p.window_left, p.window_right, delta, warp_qp0, key0, kv_pos, kv_count);

      // Online softmax over the two rows this thread holds (g and g + 8), exp2 domain.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) m = fmaxf(m, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
        const SoftmaxStep step = online_softmax_step(row_max[half], m, sl2);
        const float alpha = step.alpha, bias = step.bias;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          s[nt][2 * half] = exp2f(fmaf(s[nt][2 * half], sl2, bias));
          s[nt][2 * half + 1] = exp2f(fmaf(s[nt][2 * half + 1], sl2, bias));
          sum += s[nt][2 * half] + s[nt][2 * half + 1];
        }
        row_sum[half] = row_sum[half] * alpha + sum;
#pragma unroll
        for (int ot = 0; ot < kOT; ++ot) {
          acc_o[ot][2 * half] *= alpha;
          acc_o[ot][2 * half + 1] *= alpha;
        }
      }
      uint32_t pa[kNT / 2][4];
      scores_to_a<T, kNT>(pa, s);
      warp_gemm_areg_b<kNT / 2, kOT>(acc_o, pa, sV, Cfg::kLdV);
    }
  }
  cp_async_wait<0>();  // a tile with no visible key still has its Q load in flight

  // Finalize: O = acc / sum (0 for a row with no visible key), LSE = max * scale + ln(sum) (or -inf).
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + g + half * 8;
    inv[half] = finish_row(p, row_sum[half], row_max[half], head, tile.first_row, r, t == 0 && r < tile.rows);
  }
#pragma unroll
  for (int ot = 0; ot < kOT; ++ot) {
    acc_o[ot][0] *= inv[0];
    acc_o[ot][1] *= inv[0];
    acc_o[ot][2] *= inv[1];
    acc_o[ot][3] *= inv[1];
  }
  __syncthreads();  // every warp done with sQ (it may not have reached its last product yet)
  T* sO = sQ + warp * 16 * Cfg::kLdQ;
  acc_to_smem<T, kOT>(sO, Cfg::kLdQ, acc_o, 1.f);
  __syncthreads();
  // Cooperative 16-byte stores of the whole tile (pitch of sQ).
  constexpr int kChunks = DV / 8;
  for (int i = threadIdx.x; i < Cfg::kBlockM * kChunks; i += Cfg::kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    if (r < tile.rows)
      *reinterpret_cast<uint4*>(o_tile + r * o_stride + c) = *reinterpret_cast<const uint4*>(sQ + r * Cfg::kLdQ + c);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Backward.

template <class T, int D, int DV>
struct BackwardConfig {
  static constexpr int kThreads = 128;
  static constexpr int kBlockM = 64;  // query rows per step
  static constexpr int kBlockN = 64;  // keys per CTA
  static constexpr int kLdQ = Pitch<D>::value, kLdK = Pitch<D>::value, kLdV = Pitch<DV>::value;
  static constexpr int kLdO = Pitch<DV>::value, kLdP = Pitch<kBlockN>::value;
  static constexpr int kLdDq = 36;  // float32 staging of a warp's 16 x 32 dQ chunk (rows 16-byte aligned)
  static constexpr int kSmemBytes =
      (kBlockN * kLdK + kBlockN * kLdV + kBlockM * kLdQ + kBlockM * kLdO + 2 * kBlockM * kLdP) *
          static_cast<int>(sizeof(T)) +
      2 * kBlockM * static_cast<int>(sizeof(float)) + 4 * 16 * kLdDq * static_cast<int>(sizeof(float));
};

// LSE in the exp2 domain for one row; a row with no visible key (LSE -inf) or outside the tile gets +inf, so that
// its P = exp2(s - inf) = 0 (never NaN).
__device__ __forceinline__ float lse_log2_or_inf(const float* lse, int64_t index, bool valid) {
  if (!valid) return INFINITY;
  const float x = lse[index];
  return x == -INFINITY ? INFINITY : x * kLog2e;
}

// KV-stationary backward: one CTA per (64-key tile, kv head, column slice). dK, dV accumulate in registers over the
// query heads of the group and every Q tile the mask lets through; dQ goes to dq_accum with float32 atomics when
// ATOMIC_DQ. With SLICES > 1 (head dim 256: 2 x 128 columns), CTA z computes the columns [z * D / SLICES, (z + 1) *
// D / SLICES) of dK and of dV: the scores and dP (which need every column) are computed by each slice, so the
// accumulators stay at 128 floats per thread instead of 256 (which would not fit in registers); only slice 0 adds dQ
// and writes the rows outside every segment.
template <class T, int D, int DV, bool ATOMIC_DQ, int SLICES = 1>
__global__ void __launch_bounds__(128) attention_backward_dkdv_kernel(AttentionParams p) {
  using Cfg = BackwardConfig<T, D, DV>;
  static_assert(D % (32 * SLICES) == 0 && DV % (32 * SLICES) == 0, "whole 32-column slices");
  constexpr int kDS = D / SLICES, kDVS = DV / SLICES;  // this CTA's columns of dK and dV
  constexpr int kNT = Cfg::kBlockN / 8;
  const int slice = SLICES == 1 ? 0 : static_cast<int>(blockIdx.z);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Cfg::kBlockN * Cfg::kLdK;
  T* sQ = sV + Cfg::kBlockN * Cfg::kLdV;
  T* sdO = sQ + Cfg::kBlockM * Cfg::kLdQ;
  T* sP = sdO + Cfg::kBlockM * Cfg::kLdO;
  T* sdS = sP + Cfg::kBlockM * Cfg::kLdP;
  float* sLse = reinterpret_cast<float*>(sdS + Cfg::kBlockM * Cfg::kLdP);
  float* sDelta = sLse + Cfg::kBlockM;
  float* sDq = sDelta + Cfg::kBlockM + warp_index() * 16 * Cfg::kLdDq;  // this warp's dQ staging

  const RowTile kv_tile = p.kv_tiles[blockIdx.x];
  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int g = lane / 4, t = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t o_stride = static_cast<int64_t>(p.heads_q) * DV;
  const int64_t k_stride = static_cast<int64_t>(p.heads_kv) * D;
  const int64_t v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const bool summing = p.dk_sum != nullptr;
  const int64_t* sum_map = summing ? p.kv_sum_rows + kv_tile.first_row : nullptr;
  T* dk_tile =
      summing ? nullptr : static_cast<T*>(p.dk) + kv_tile.first_row * k_stride + static_cast<int64_t>(kv_head) * D;
  T* dv_tile =
      summing ? nullptr : static_cast<T*>(p.dv) + kv_tile.first_row * v_stride + static_cast<int64_t>(kv_head) * DV;
  if (kv_tile.sequence < 0) {  // K/V rows outside every segment: dK = dV = 0
    if (slice != 0) return;
    if (summing) {
      sum_tile<Cfg::kBlockN, D, Cfg::kThreads, T>(p.dk_sum, sum_map, k_stride, int64_t{kv_head} * D, nullptr,
                                                  kv_tile.rows, p.dk_sum_assign != 0, static_cast<T*>(p.dk_result));
      sum_tile<Cfg::kBlockN, DV, Cfg::kThreads, T>(p.dv_sum, sum_map, v_stride, int64_t{kv_head} * DV, nullptr,
                                                   kv_tile.rows, p.dv_sum_assign != 0, static_cast<T*>(p.dv_result));
    } else {
      zero_rows<D, Cfg::kThreads>(dk_tile, k_stride, kv_tile.rows);
      zero_rows<DV, Cfg::kThreads>(dv_tile, v_stride, kv_tile.rows);
    }
    return;
  }
  const SequenceDesc& seq = p.sequences[kv_tile.sequence];
  const int64_t delta_pos = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const T* q_base = static_cast<const T*>(p.q);
  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);
  const T* do_base = static_cast<const T*>(p.dout);
  const int kv_pos = seq.kv_position[kv_tile.segment];
  const int kv_count = seq.kv_count[kv_tile.segment];
  const int key0 = kv_tile.position - kv_pos;  // index of the tile's first key within its segment

  load_tile_async<Cfg::kBlockN, D, Cfg::kThreads>(sK, k_base + kv_tile.first_row * k_stride + kv_head * D, k_stride,
                                                  kv_tile.rows, k_base);
  load_tile_async<Cfg::kBlockN, DV, Cfg::kThreads>(sV, v_base + kv_tile.first_row * v_stride + kv_head * DV,
                                                   v_stride, kv_tile.rows, v_base);
  cp_async_commit();

  float acc_dk[kDS / 8][4], acc_dv[kDVS / 8][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);
  const float sl2 = p.scale_log2;
  const int64_t kp_lo = kv_tile.position, kp_hi = kv_tile.position + kv_tile.rows - 1;
  const bool keys_full = kv_tile.rows == Cfg::kBlockN;

  for (int head = kv_head * p.group; head < (kv_head + 1) * p.group; ++head) {
    for (int segment = 0; segment < 2; ++segment) {
      const int q_count = seq.q_count[segment];
      if (q_count <= 0) continue;
      const int q_pos = seq.q_position[segment];
      int row_lo, row_hi;
      visible_query_range(p.window_left, p.window_right, delta_pos, kp_lo, kp_hi, q_pos, q_count, row_lo, row_hi);
      if (row_lo > row_hi) continue;
      const int64_t q_first = seq.q_first_row[segment];
      for (int m_block = row_lo / Cfg::kBlockM; m_block <= row_hi / Cfg::kBlockM; ++m_block) {
        const int row0 = m_block * Cfg::kBlockM;
        const int valid = min(Cfg::kBlockM, q_count - row0);
        const int64_t first_row = q_first + row0;
        __syncthreads();  // previous step's shared tiles fully consumed
        load_tile_async<Cfg::kBlockM, D, Cfg::kThreads>(sQ, q_base + first_row * q_stride + head * D, q_stride,
                                                        valid, q_base);
        load_tile_async<Cfg::kBlockM, DV, Cfg::kThreads>(sdO, do_base + first_row * o_stride + head * DV, o_stride,
                                                         valid, do_base);
        cp_async_commit();
        for (int r = threadIdx.x; r < Cfg::kBlockM; r += Cfg::kThreads) {
          const int64_t index = static_cast<int64_t>(head) * p.q_rows + first_row + r;
          sLse[r] = lse_log2_or_inf(p.lse, index, r < valid);
          sDelta[r] = r < valid ? p.delta[index] : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();

        const int64_t qp_lo = q_pos + row0, qp_hi = q_pos + row0 + valid - 1;
        const bool full =
            keys_full && tile_fully_visible(p.window_left, p.window_right, delta_pos, qp_lo, qp_hi, kp_lo, kp_hi);
        float s[kNT][4];
        zero_acc(s);
        warp_gemm_a_bt<D, kNT>(s, sQ + warp * 16 * Cfg::kLdQ, Cfg::kLdQ, sK, Cfg::kLdK);
        if (!full) apply_mask(s, p.window_left, p.window_right, delta_pos, qp_lo + warp * 16, key0, kv_pos, kv_count);
        const float lse0 = sLse[warp * 16 + g], lse1 = sLse[warp * 16 + g + 8];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          s[nt][0] = exp2f(fmaf(s[nt][0], sl2, -lse0));
          s[nt][1] = exp2f(fmaf(s[nt][1], sl2, -lse0));
          s[nt][2] = exp2f(fmaf(s[nt][2], sl2, -lse1));
          s[nt][3] = exp2f(fmaf(s[nt][3], sl2, -lse1));
        }
        float dp[kNT][4];
        zero_acc(dp);
        warp_gemm_a_bt<DV, kNT>(dp, sdO + warp * 16 * Cfg::kLdO, Cfg::kLdO, sV, Cfg::kLdV);
        const float d0 = sDelta[warp * 16 + g], d1 = sDelta[warp * 16 + g + 8];
        T* p_rows = sP + warp * 16 * Cfg::kLdP;
        T* ds_rows = sdS + warp * 16 * Cfg::kLdP;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float ds0 = s[nt][0] * (dp[nt][0] - d0), ds1 = s[nt][1] * (dp[nt][1] - d0);
          const float ds2 = s[nt][2] * (dp[nt][2] - d1), ds3 = s[nt][3] * (dp[nt][3] - d1);
          *reinterpret_cast<uint32_t*>(p_rows + g * Cfg::kLdP + nt * 8 + 2 * t) = Elem<T>::pack(s[nt][0], s[nt][1]);
          *reinterpret_cast<uint32_t*>(p_rows + (g + 8) * Cfg::kLdP + nt * 8 + 2 * t) =
              Elem<T>::pack(s[nt][2], s[nt][3]);
          *reinterpret_cast<uint32_t*>(ds_rows + g * Cfg::kLdP + nt * 8 + 2 * t) = Elem<T>::pack(ds0, ds1);
          *reinterpret_cast<uint32_t*>(ds_rows + (g + 8) * Cfg::kLdP + nt * 8 + 2 * t) = Elem<T>::pack(ds2, ds3);
        }
        __syncthreads();

        // dV += P^T dO and dK += dS^T Q for this warp's 16 keys.
        warp_gemm_at_b<Cfg::kBlockM, kDVS / 8>(acc_dv, sP + warp * 16, Cfg::kLdP, sdO + slice * kDVS, Cfg::kLdO);
        warp_gemm_at_b<Cfg::kBlockM, kDS / 8>(acc_dk, sdS + warp * 16, Cfg::kLdP, sQ + slice * kDS, Cfg::kLdQ);

        if (ATOMIC_DQ && slice == 0) {
          // dQ (unscaled) += dS K for this warp's 16 query rows, 32 columns at a time.
          // Each 16 x 32 chunk is staged in shared memory and added with 16-byte float4 atomics (sm_90), a
          // quarter of the scalar atomics and coalesced along the row.
          float* dq_rows = p.dq_accum + (first_row + warp * 16) * q_stride + static_cast<int64_t>(head) * D;
          const int warp_rows = min(16, valid - warp * 16);
#pragma unroll 1
          for (int c0 = 0; c0 < D; c0 += 32) {
            float acc_dq[4][4];
            zero_acc(acc_dq);
            warp_gemm_a_b<Cfg::kBlockN, 4>(acc_dq, sdS + warp * 16 * Cfg::kLdP, Cfg::kLdP, sK + c0, Cfg::kLdK);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              *reinterpret_cast<float2*>(sDq + g * Cfg::kLdDq + nt * 8 + 2 * t) = make_float2(acc_dq[nt][0], acc_dq[nt][1]);
              *reinterpret_cast<float2*>(sDq + (g + 8) * Cfg::kLdDq + nt * 8 + 2 * t) =
                  make_float2(acc_dq[nt][2], acc_dq[nt][3]);
            }
            __syncwarp();
#pragma unroll
            for (int i = lane; i < 16 * 8; i += 32) {
              const int r = i / 8, c4 = (i % 8) * 4;
              if (r < warp_rows)
                atomicAdd(reinterpret_cast<float4*>(dq_rows + r * q_stride + c0 + c4),
                          *reinterpret_cast<const float4*>(sDq + r * Cfg::kLdDq + c4));
            }
            __syncwarp();
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // dK = scale * dS^T Q, dV = P^T dO (this slice's columns), staged through sQ / sdO (free now; pitch of the slice's
  // width) for 16-byte stores.
  constexpr int kLdDk = Pitch<kDS>::value, kLdDv = Pitch<kDVS>::value;
  static_assert(kLdDk <= Cfg::kLdQ && kLdDv <= Cfg::kLdO, "staging inside sQ / sdO");
  acc_to_smem<T, kDS / 8>(sQ + warp * 16 * kLdDk, kLdDk, acc_dk, p.softmax_scale);
  acc_to_smem<T, kDVS / 8>(sdO + warp * 16 * kLdDv, kLdDv, acc_dv, 1.f);
  __syncthreads();
  if (summing) {
    sum_tile<Cfg::kBlockN, kDS, Cfg::kThreads>(p.dk_sum, sum_map, k_stride, int64_t{kv_head} * D + slice * kDS, sQ,
                                               kv_tile.rows, p.dk_sum_assign != 0, static_cast<T*>(p.dk_result));
    sum_tile<Cfg::kBlockN, kDVS, Cfg::kThreads>(p.dv_sum, sum_map, v_stride, int64_t{kv_head} * DV + slice * kDVS,
                                                sdO, kv_tile.rows, p.dv_sum_assign != 0,
                                                static_cast<T*>(p.dv_result));
  } else {
    store_tile<Cfg::kBlockN, kDS, Cfg::kThreads>(dk_tile + slice * kDS, k_stride, sQ, kv_tile.rows);
    store_tile<Cfg::kBlockN, kDVS, Cfg::kThreads>(dv_tile + slice * kDVS, v_stride, sdO, kv_tile.rows);
  }
}

template <class T, int D, int DV>
struct DqConfig {
  static constexpr int kThreads = 128;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kLdQ = Pitch<D>::value, kLdK = Pitch<D>::value, kLdV = Pitch<DV>::value;
  static constexpr int kLdO = Pitch<DV>::value;
  static constexpr int kSmemBytes =
      (kBlockM * kLdQ + kBlockM * kLdO + kBlockN * kLdK + kBlockN * kLdV) * static_cast<int>(sizeof(T));
};

// Deterministic dQ: one CTA per (64-row Q tile, head), looping over the visible K/V tiles in a fixed order.
template <class T, int D, int DV>
__global__ void __launch_bounds__(128) attention_backward_dq_kernel(AttentionParams p) {
  using Cfg = DqConfig<T, D, DV>;
  constexpr int kNT = Cfg::kBlockN / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + Cfg::kBlockM * Cfg::kLdQ;
  T* sK = sdO + Cfg::kBlockM * Cfg::kLdO;
  T* sV = sK + Cfg::kBlockN * Cfg::kLdK;

  const RowTile tile = p.q_tiles[blockIdx.x];
  const int head = blockIdx.y;
  const int kv_head = head / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int g = lane / 4;
  const int64_t q_stride = static_cast<int64_t>(p.heads_q) * D;
  const int64_t o_stride = static_cast<int64_t>(p.heads_q) * DV;
  const int64_t k_stride = static_cast<int64_t>(p.heads_kv) * D;
  const int64_t v_stride = static_cast<int64_t>(p.heads_kv) * DV;
  const bool summing = p.dq_sum != nullptr;
  const int64_t* sum_map = summing ? p.q_sum_rows + tile.first_row : nullptr;
  T* dq_tile =
      summing ? nullptr : static_cast<T*>(p.dq) + tile.first_row * q_stride + static_cast<int64_t>(head) * D;
  if (tile.sequence < 0) {
    if (summing)
      sum_tile<Cfg::kBlockM, D, Cfg::kThreads, T>(p.dq_sum, sum_map, q_stride, int64_t{head} * D, nullptr, tile.rows,
                                                  p.dq_sum_assign != 0, static_cast<T*>(p.dq_result));
    else
      zero_rows<D, Cfg::kThreads>(dq_tile, q_stride, tile.rows);
    return;
  }
  const SequenceDesc& seq = p.sequences[tile.sequence];
  const int64_t delta_pos = static_cast<int64_t>(seq.length_kv) - seq.length_q;
  const T* q_base = static_cast<const T*>(p.q);
  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);
  const T* do_base = static_cast<const T*>(p.dout);
  load_tile_async<Cfg::kBlockM, D, Cfg::kThreads>(sQ, q_base + tile.first_row * q_stride + head * D, q_stride,
                                                  tile.rows, q_base);
  load_tile_async<Cfg::kBlockM, DV, Cfg::kThreads>(sdO, do_base + tile.first_row * o_stride + head * DV, o_stride,
                                                   tile.rows, do_base);
  cp_async_commit();
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int64_t lse_row = static_cast<int64_t>(head) * p.q_rows + tile.first_row;
  const float lse0 = lse_log2_or_inf(p.lse, lse_row + r0, r0 < tile.rows);
  const float lse1 = lse_log2_or_inf(p.lse, lse_row + r1, r1 < tile.rows);
  const float d0 = r0 < tile.rows ? p.delta[lse_row + r0] : 0.f;
  const float d1 = r1 < tile.rows ? p.delta[lse_row + r1] : 0.f;

  float acc_dq[D / 8][4];
  zero_acc(acc_dq);
  const float sl2 = p.scale_log2;
  const int64_t qp_lo = tile.position, qp_hi = tile.position + tile.rows - 1;
  for (int segment = 0; segment < 2; ++segment) {
    const int kv_count = seq.kv_count[segment];
    if (kv_count <= 0) continue;
    const int kv_pos = seq.kv_position[segment];
    int key_lo, key_hi;
    visible_key_range(p.window_left, p.window_right, delta_pos, qp_lo, qp_hi, kv_pos, kv_count, key_lo, key_hi);
    if (key_lo > key_hi) continue;
    const T* k_seg = k_base + seq.kv_first_row[segment] * k_stride + kv_head * D;
    const T* v_seg = v_base + seq.kv_first_row[segment] * v_stride + kv_head * DV;
    for (int n_block = key_lo / Cfg::kBlockN; n_block <= key_hi / Cfg::kBlockN; ++n_block) {
      const int key0 = n_block * Cfg::kBlockN;
      const int valid = min(Cfg::kBlockN, kv_count - key0);
      __syncthreads();
      load_tile_async<Cfg::kBlockN, D, Cfg::kThreads>(sK, k_seg + key0 * k_stride, k_stride, valid, k_base);
      load_tile_async<Cfg::kBlockN, DV, Cfg::kThreads>(sV, v_seg + key0 * v_stride, v_stride, valid, v_base);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      float s[kNT][4];
      zero_acc(s);
      warp_gemm_a_bt<D, kNT>(s, sQ + warp * 16 * Cfg::kLdQ, Cfg::kLdQ, sK, Cfg::kLdK);
      const bool full = valid == Cfg::kBlockN &&
                        tile_fully_visible(p.window_left, p.window_right, delta_pos, qp_lo, qp_hi, kv_pos + key0,
                                           kv_pos + key0 + Cfg::kBlockN - 1);
      if (!full) apply_mask(s, p.window_left, p.window_right, delta_pos, qp_lo + warp * 16, key0, kv_pos, kv_count);
      float dp[kNT][4];
      zero_acc(dp);
      warp_gemm_a_bt<DV, kNT>(dp, sdO + warp * 16 * Cfg::kLdO, Cfg::kLdO, sV, Cfg::kLdV);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        s[nt][0] = exp2f(fmaf(s[nt][0], sl2, -lse0)) * (dp[nt][0] - d0);
        s[nt][1] = exp2f(fmaf(s[nt][1], sl2, -lse0)) * (dp[nt][1] - d0);
        s[nt][2] = exp2f(fmaf(s[nt][2], sl2, -lse1)) * (dp[nt][2] - d1);
        s[nt][3] = exp2f(fmaf(s[nt][3], sl2, -lse1)) * (dp[nt][3] - d1);
      }
      uint32_t dsa[kNT / 2][4];
      scores_to_a<T, kNT>(dsa, s);
      warp_gemm_areg_b<kNT / 2, D / 8>(acc_dq, dsa, sK, Cfg::kLdK);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  acc_to_smem<T, D / 8>(sQ + warp * 16 * Cfg::kLdQ, Cfg::kLdQ, acc_dq, p.softmax_scale);
  __syncthreads();
  if (summing)
    sum_tile<Cfg::kBlockM, D, Cfg::kThreads>(p.dq_sum, sum_map, q_stride, int64_t{head} * D, sQ, tile.rows,
                                             p.dq_sum_assign != 0, static_cast<T*>(p.dq_result));
  else
    store_tile<Cfg::kBlockM, D, Cfg::kThreads>(dq_tile, q_stride, sQ, tile.rows);
}

}  // namespace cpgold::gpu::detail
