#pragma once
// Hopper (sm_90a) building blocks of the wgmma attention kernels, as inline PTX: the 128-byte swizzled shared-memory
// layout, wgmma matrix descriptors, wgmma ordering, mbarriers (with a watchdog), cp.async into the swizzled layout,
// TMA tile loads, named barriers, proxy fences and register reallocation. Derivations: docs/hopper-kernels.md.
//
// Shared-memory tile layout used everywhere here ("SW128 tile"): a [rows][cols] tile of 16-bit elements is stored as
// cols / 64 column blocks, block b holding columns 64 b .. 64 b + 63 of every row; in a block, row r occupies the
// 128 bytes at r * 128, and its 16-byte chunk c (elements 8 c .. 8 c + 7) sits at chunk position c ^ (r % 8). Every
// block starts at a multiple of 1024 bytes of the shared address space, so the XOR acts on address bits [4, 7) with
// bits [7, 10), which is the pattern that TMA's SWIZZLE_128B writes and that a descriptor with swizzle mode 1 (128B)
// reads (both apply it to the absolute shared address).
#include <cuda.h>  // CUtensorMap (a type only: nothing here calls the driver)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "gpu/kernels/attention/dtype_pack.cuh"  // pack2

namespace cpgold::gpu::sm90 {

// ---------------------------------------------------------------------------------------------------------------
// Shared memory addresses and the SW128 layout.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of element (row, col) in an SW128 tile of `rows` rows (rows a multiple of 8).
__host__ __device__ __forceinline__ constexpr uint32_t sw128_offset(int rows, int row, int col) {
  return static_cast<uint32_t>((col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) +
                               (col % 8) * 2);
}

// ---------------------------------------------------------------------------------------------------------------
// wgmma matrix descriptors (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4, 16-29 leading
// dimension byte offset >> 4, 32-45 stride dimension byte offset >> 4, 49-51 base offset (0: every swizzle atom
// starts on a 1024-byte boundary), 62-63 swizzle mode (1 = 128B).
//
// K-major operand (A, or B with TransB = 0) in an SW128 tile: the 16 K-elements of one instruction are 32 bytes of
// a row, inside one column block; 8-row core-matrix groups are 1024 bytes apart (SBO); LBO is unused with a 128-byte
// swizzle (set to 1, i.e. 16 bytes, as CUTLASS does). Start address: block base + row0 * 128 + (k0 % 64) * 2.
// MN-major B (TransB = 1, e.g. V [keys][d]: N = d contiguous): the 16 K-rows (keys) of one instruction are rows
// k0 .. k0 + 15 of the tile; 8-row groups along K are 1024 bytes apart (SBO); the 64-column blocks along N are
// LBO = rows * 128 bytes apart. Start address: tile base + k0 * 128.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_address, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= uint64_t{1} << 62;
  return d;
}

// Descriptor of a K-major operand at rows row0.. and K-columns k0 .. k0 + 15 of an SW128 tile of `rows` rows
// (k0 a multiple of 16: the 32 bytes never cross a column block).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int rows, int row0, int k0, uint32_t lbo = 16,
                                                 uint32_t sbo = 1024) {
  return make_desc_sw128(tile + (k0 / 64) * rows * 128 + row0 * 128 + (k0 % 64) * 2, lbo, sbo);
}
// Descriptor of an MN-major B at K-rows k0 .. k0 + 15 (k0 a multiple of 16) of an SW128 tile of `rows` rows whose
// columns are the N dimension.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile, int rows, int k0, uint32_t lbo = 0,
                                                  uint32_t sbo = 1024) {
  return make_desc_sw128(tile + k0 * 128, lbo == 0 ? static_cast<uint32_t>(rows * 128) : lbo, sbo);
}

// ---------------------------------------------------------------------------------------------------------------
// wgmma ordering.

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins registers at this point of the program: the compiler may neither read accumulators that an asynchronous
// wgmma still writes before the wait, nor reuse the registers of an A fragment that it still reads.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Fences, named barriers, register reallocation.

// Orders this thread's generic-proxy shared-memory accesses with later async-proxy ones (wgmma, TMA) and back.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Makes mbarrier.init visible to the async proxy (TMA complete_tx) and to the other threads after a barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// ---------------------------------------------------------------------------------------------------------------
// mbarriers. Phase k (k = 0, 1, ...) of a barrier completes when its expected arrivals have arrived and its
// transaction count is back to 0; try_wait.parity(k % 2) succeeds once phase k has completed, and also, before
// phase 0 completes, for parity 1 (the "preceding" phase).

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// One arrival on `bar` once every cp.async this thread issued before has completed. The arrival is counted in the
// barrier's expected count (.noinc): a barrier fed this way expects one arrival per issuing thread.
__device__ __forceinline__ void mbar_arrive_on_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Watchdog of the waits: with `flag` set, a wait that has not completed after kWatchdogCycles records
// {code, block x, block y, thread, iteration} in flag[0..4] (first one only), then gives up; once flag[0] is set,
// every later slow wait gives up at once, so that a broken pipeline ends the kernel with a diagnosis instead of a hang.
struct Watchdog {
  int* flag = nullptr;  // device int[8], zero before the launch
};
inline constexpr long long kWatchdogCycles = 4000000000LL;  // about 2 s at 1.98 GHz; a real wait takes microseconds

enum WaitCode : int { kWaitQ = 1, kWaitK = 2, kWaitV = 3, kWaitEmpty = 4, kWaitTest = 5 };

__device__ __forceinline__ void mbar_wait_slow(uint32_t bar, uint32_t parity, Watchdog dog, int code, int iteration) {
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity)) {
    if (dog.flag == nullptr) continue;
    if (*reinterpret_cast<volatile int*>(dog.flag) != 0) return;
    if (clock64() - t0 > kWatchdogCycles) {
      if (atomicCAS(dog.flag, 0, code) == 0) {
        dog.flag[1] = static_cast<int>(blockIdx.x);
        dog.flag[2] = static_cast<int>(blockIdx.y);
        dog.flag[3] = static_cast<int>(threadIdx.x);
        dog.flag[4] = iteration;
        __threadfence();
      }
      return;
    }
  }
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, Watchdog dog, int code, int iteration) {
  if (mbar_try_wait(bar, parity)) return;
  mbar_wait_slow(bar, parity, dog, code, iteration);
}

// Ring of STAGES shared-memory stages for a sequence of tiles it = 0, 1, ...: tile it lives in stage it % STAGES;
// full_k / full_v (one barrier per stage each) complete their phase it / STAGES when tile it is loaded, empty
// completes its phase it / STAGES when every consumer thread has released tile it. The producer may load tile it
// once tile it - STAGES is released (phase it / STAGES - 1 of empty); a consumer waits phase it / STAGES of full.
// Neither barrier can run two phases ahead of a waiter: the producer loads tile it + STAGES only after tile it was
// released, which needs the consumers' wait on tile it.
template <int STAGES>
struct Ring {
  uint32_t base;  // 3 * STAGES barriers: full_k[STAGES], full_v[STAGES], empty[STAGES]
  static __device__ __forceinline__ int stage(int it) { return it % STAGES; }
  static __device__ __forceinline__ uint32_t parity(int it) { return static_cast<uint32_t>(it / STAGES) & 1u; }
  __device__ __forceinline__ uint32_t full_k(int it) const { return base + 8 * stage(it); }
  __device__ __forceinline__ uint32_t full_v(int it) const { return base + 8 * (STAGES + stage(it)); }
  __device__ __forceinline__ uint32_t empty(int it) const { return base + 8 * (2 * STAGES + stage(it)); }
  // One thread, before the CTA-wide barrier that precedes any use.
  __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(base + 8 * s, full_arrivals);
      mbar_init(base + 8 * (STAGES + s), full_arrivals);
      mbar_init(base + 8 * (2 * STAGES + s), empty_arrivals);
    }
  }
  __device__ __forceinline__ void producer_acquire(int it, const Watchdog& dog) const {
    if (it >= STAGES) mbar_wait(empty(it), (static_cast<uint32_t>(it / STAGES) - 1u) & 1u, dog, kWaitEmpty, it);
  }
  __device__ __forceinline__ void wait_k(int it, const Watchdog& dog) const {
    mbar_wait(full_k(it), parity(it), dog, kWaitK, it);
  }
  __device__ __forceinline__ void wait_v(int it, const Watchdog& dog) const {
    mbar_wait(full_v(it), parity(it), dog, kWaitV, it);
  }
  __device__ __forceinline__ void release(int it) const { mbar_arrive(empty(it)); }
};

// ---------------------------------------------------------------------------------------------------------------
// Loads into SW128 tiles.

// 16 bytes global -> shared; with valid == false nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Copies rows 0 .. valid - 1 of a ROWS x COLS tile (row stride `stride` elements) into the SW128 tile at `dst`
// (shared address, 1024-aligned) by THREADS threads (thread index `tid`); rows valid .. ROWS - 1 are zero-filled
// without a global read (`safe` is any readable address, never dereferenced). Consecutive threads take consecutive
// 16-byte chunks of a row (coalesced reads). Columns VALID_COLS .. COLS - 1 (a head dim of 32 or 96 in a tile of 64 or
// 128 columns) are zero-filled the same way: their source would be the next head's columns.
template <int ROWS, int COLS, int THREADS, class T, int VALID_COLS = COLS>
__device__ __forceinline__ void load_tile_sw128_cp_async(uint32_t dst, const T* src, int64_t stride, int valid,
                                                         const T* safe, int tid) {
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "SW128 tile shape");
  static_assert(VALID_COLS % 8 == 0 && VALID_COLS <= COLS, "whole 16-byte chunks");
  constexpr int kChunks = COLS / 8;
#pragma unroll 4
  for (int i = tid; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks;
    const int c = i % kChunks;
    const bool ok = r < valid && (VALID_COLS == COLS || c < VALID_COLS / 8);
    cp_async_16(dst + sw128_offset(ROWS, r, c * 8), ok ? src + r * stride + c * 8 : safe, ok);
  }
}

// TMA: box of a 3-D tensor map (dims: column, head, row) -> shared memory at `dst`, completing `bytes` of
// transactions on `bar` (the caller counts them with mbar_arrive_expect_tx).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int col, int head, int row,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(head), "r"(row), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Accumulators of a 64 x (16 KT) wgmma product (d[4 j + e]: row g + 8 (e / 2), column 8 j + 2 c + e % 2 of the
// warp's 16 rows) as the A fragments of KT k-steps of an RS wgmma: a[k] = {(g, 16k + 2c..), (g + 8, 16k + 2c..),
// (g, 16k + 8 + 2c..), (g + 8, 16k + 8 + 2c..)}, two elements per register, lower column in the low half.
template <class T, int KT>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[KT][4], const float (&d)[KT * 8]) {
#pragma unroll
  for (int k = 0; k < KT; ++k) {
    a[k][0] = pack2<T>(d[8 * k + 0], d[8 * k + 1]);
    a[k][1] = pack2<T>(d[8 * k + 2], d[8 * k + 3]);
    a[k][2] = pack2<T>(d[8 * k + 4], d[8 * k + 5]);
    a[k][3] = pack2<T>(d[8 * k + 6], d[8 * k + 7]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Added for the backward (gpu/kernels/sm90/attention_backward_sm90.cuh).

// 4 bytes global -> shared (cp.async.ca: 4-byte copies must go through L1); with valid == false nothing is read and
// the 4 bytes are zero-filled. Used for per-row float32 values (LSE, delta) whose rows need not be 16-byte aligned.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

// The value, opaque to the compiler (keeps address arithmetic inside a loop instead of hoisted into live registers).
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// 8-byte store to a shared memory address (32-bit: no generic 64-bit address per store).
__device__ __forceinline__ void st_shared_f2(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// TMA reduce: adds a box in shared memory (at `src`, laid out as the map's box with its swizzle) into the global
// tensor of a 3-D tensor map (dims: column, head, row) at the coordinates, element-wise (float32 add for a float32
// map); rows and columns outside the tensor are skipped. Tracked by the issuing thread's bulk async-groups.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, uint32_t src, int col, int head, int row) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(col), "r"(head), "r"(row), "r"(src)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of the thread's bulk groups are still reading their shared memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of the thread's bulk groups are incomplete (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Descriptor of an MN-major A (imm-trans-a = 1: A [M][K] stored as K-rows of M contiguous elements, e.g. dS^T
// [keys][queries] read as A = dS) at K-rows k0 .. k0 + 15 of an SW128 tile of `rows` K-rows whose columns are the M
// dimension: the same canonical layout as an MN-major B (CUTLASS builds both with one function): K-rows 128 bytes
// apart, 8-row groups SBO = 1024 apart, 64-element M blocks LBO = rows * 128 apart.
__device__ __forceinline__ uint64_t desc_mn_major_a(uint32_t tile, int rows, int k0, uint32_t lbo = 0,
                                                    uint32_t sbo = 1024) {
  return make_desc_sw128(tile + k0 * 128, lbo == 0 ? static_cast<uint32_t>(rows * 128) : lbo, sbo);
}

}  // namespace cpgold::gpu::sm90
