// Self-checking program for the Hopper (sm_90a) wgmma attention forward (gpu/kernels/sm90/): unit tests of its
// building blocks, the forward kernel variants against a float64 CPU reference on varlen THD batches, and timing
// against the mma.sync forward kernel (gpu/kernels/mma_sync/attention_kernels.cuh) in the same run. Built and run by
// bench/hopper_forward.sh (nvcc directly, -gencode=arch=compute_90a,code=sm_90a); docs/hopper-kernels.md.
//
// Stages (each result line reads "RESULT|stage|name|PASS or FAIL|detail"; the summary table comes last):
//   unit     one warpgroup wgmma products (SS, RS, K-major and MN-major B, k-chains) against a CPU product, the
//            swizzled copies (cp.async, TMA) read back through the inverse swizzle, the mbarrier ring with a
//            producer and two consumer warpgroups (cp.async and TMA), the S -> P -> P V chain of the kernel.
//   forward  every variant on varlen batches (lengths 0, 1, 17, 100, 128, 129, 1000, 4096, pads of NaN, q != kv
//            lengths, GQA, windows, two segments per sequence, d 64, fp16), output poisoned with NaN first,
//            against a float64 CPU reference: relative Frobenius error, max abs error, LSE error, pad rows exactly
//            0, LSE -inf exactly where no key is visible, a rerun bitwise identical.
//   timing   causal and full d = 128 bf16 batches of 16k and 64k tokens (lengths cycling 512..4096, 16 heads):
//            CUDA events, 5 warm-ups, median of --reps (default 30); TFLOP/s count 4 d per visible (q, k) pair.
//
// Options: --reps N, --skip-timing, --exclude a,b (skip unit tests or variants by name: the script reruns with the
// name of one that faulted the context, printed as "FAULTED <name>"), --seed S, --host-check (checks of the harness
// that need no GPU: tile lists, and compare() on the rounded reference and on planted faults).
// Exit status: 0 all passed, 1 a check failed, 4 a CUDA call failed (context lost), 5 a kernel hung.
#include "gpu/kernels/sm90/attention_forward_sm90.cuh"
#include "bench/hopper_harness.hpp"
#include "bench/hopper_unit_gemm.cuh"
#if __has_include("gpu/kernels/mma_sync/attention_kernels.cuh")
#include "gpu/kernels/mma_sync/attention_kernels.cuh"
#define HF_HAVE_MMA_SYNC_FORWARD 1
#endif

namespace hf {

const char* watchdog_wait_name(int code) {
  static const char* names[] = {"?", "Q full", "K full", "V full", "stage empty", "test barrier"};
  return names[code >= 1 && code <= 5 ? code : 0];
}

// ---------------------------------------------------------------------------------------------------------------
// Unit tests: kernels.


// Copies a ROWS x COLS tile (row stride `stride`, `valid` rows) into an SW128 tile by cp.async, then writes the tile
// back row-major through the layout formula (out[r][c] = tile element (r, c)).
template <int ROWS, int COLS>
__global__ void __launch_bounds__(128) unit_copy_cp_async(const bf16* src, int64_t stride, int valid, uint16_t* out) {
  extern __shared__ uint8_t raw[];
  uint32_t smem;
  uint8_t* p = aligned_smem(raw, smem);
  sm90::load_tile_sw128_cp_async<ROWS, COLS, 128>(smem, src, stride, valid, src, threadIdx.x);
  sm90::cp_async_wait_all();
  __syncthreads();
  for (int i = threadIdx.x; i < ROWS * COLS; i += 128)
    out[i] = *reinterpret_cast<const uint16_t*>(p + sm90::sw128_offset(ROWS, i / COLS, i % COLS));
}

// The same through TMA: box (64 columns, 1 head, ROWS rows) per column block at (head, row0), one mbarrier with the
// transaction count of the whole box.
template <int ROWS, int COLS>
__global__ void __launch_bounds__(128)
    unit_copy_tma(const __grid_constant__ CUtensorMap map, int head, int row0, uint16_t* out, sm90::Watchdog dog) {
  extern __shared__ uint8_t raw[];
  uint32_t smem;
  uint8_t* p = aligned_smem(raw, smem);
  const uint32_t bar = smem + ROWS * COLS * 2;
  if (threadIdx.x == 0) {
    sm90::mbar_init(bar, 1);
    sm90::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sm90::mbar_arrive_expect_tx(bar, ROWS * COLS * 2);
    for (int b = 0; b < COLS / 64; ++b) sm90::tma_load_3d(smem + b * ROWS * 128, &map, 64 * b, head, row0, bar);
  }
  sm90::mbar_wait(bar, 0, dog, sm90::kWaitTest, 0);
  for (int i = threadIdx.x; i < ROWS * COLS; i += 128)
    out[i] = *reinterpret_cast<const uint16_t*>(p + sm90::sw128_offset(ROWS, i / COLS, i % COLS));
}


// The forward kernel's per-tile sequence for one warpgroup: S = Q K^T (SS, K-major), P = dtype(S) repacked by
// accumulators_to_a, O = P V (RS, V MN-major); writes S and O (float).
template <int BN, int D>
__global__ void __launch_bounds__(128)
    unit_chain(const bf16* q, const bf16* k, const bf16* v, float* s_out, float* o_out) {
  extern __shared__ uint8_t raw[];
  uint32_t smem;
  aligned_smem(raw, smem);
  const uint32_t q_tile = smem, k_tile = smem + 64 * D * 2, v_tile = k_tile + BN * D * 2;
  const int tid = threadIdx.x;
  sm90::load_tile_sw128_cp_async<64, D, 128>(q_tile, q, D, 64, q, tid);
  sm90::load_tile_sw128_cp_async<BN, D, 128>(k_tile, k, D, BN, k, tid);
  sm90::load_tile_sw128_cp_async<BN, D, 128>(v_tile, v, D, BN, v, tid);
  sm90::cp_async_wait_all();
  sm90::fence_proxy_async();
  __syncthreads();
  float s[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
  sm90::fence_registers(s);
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    sm90::Wgmma<BN, bf16, 0>::ss(s, sm90::desc_k_major(q_tile, 64, 0, 16 * kk), sm90::desc_k_major(k_tile, BN, 0, 16 * kk),
                                 kk > 0 ? 1 : 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(s);
  uint32_t pa[BN / 16][4];
  sm90::accumulators_to_a<bf16, BN / 16>(pa, s);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  sm90::fence_registers(o);
  sm90::fence_registers(pa);
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) sm90::Wgmma<D, bf16, 1>::rs(o, pa[kk], sm90::desc_mn_major(v_tile, BN, 16 * kk), 1);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(o);
  sm90::fence_registers(pa);
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s_out[(16 * warp + g + 8 * (e / 2)) * BN + 8 * j + 2 * c + (e % 2)] = s[4 * j + e];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o_out[(16 * warp + g + 8 * (e / 2)) * D + 8 * j + 2 * c + (e % 2)] = o[4 * j + e];
}

// The mbarrier ring of the kernel (sm90::Ring<2>) with a producer warpgroup and two consumer warpgroups over `tiles`
// tiles of 64 rows x 64 columns of `src` ([rows][64], integers as bf16): every consumer warpgroup sums each tile it
// sees (exact in int64) into sums[cw][it]. Consumers sleep at pseudo-random points so that the stages are taken
// and released in varying orders.
template <sm90::Loader LOADER>
__global__ void __launch_bounds__(384)
    unit_ring(const bf16* src, int rows, int tiles, const __grid_constant__ CUtensorMap map,
              unsigned long long* sums, sm90::Watchdog dog) {
  constexpr int kTileBytes = 64 * 64 * 2;
  extern __shared__ uint8_t raw[];
  uint32_t smem;
  uint8_t* p = aligned_smem(raw, smem);
  const sm90::Ring<2> ring{smem + 2 * kTileBytes};
  if (threadIdx.x == 0) {
    ring.init(LOADER == sm90::Loader::tma ? 1 : 128, 256);
    sm90::fence_mbarrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (wg == 0) {
    for (int it = 0; it < tiles; ++it) {
      ring.producer_acquire(it, dog);
      const uint32_t dst = smem + ring.stage(it) * kTileBytes;
      if constexpr (LOADER == sm90::Loader::cp_async) {
        const int valid = min(64, rows - 64 * it);
        sm90::load_tile_sw128_cp_async<64, 64, 128>(dst, src + static_cast<int64_t>(64) * 64 * it, 64, valid, src, tid);
        sm90::mbar_arrive_on_cp_async(ring.full_k(it));
      } else if (tid == 0) {
        sm90::mbar_arrive_expect_tx(ring.full_k(it), kTileBytes);
        sm90::tma_load_3d(dst, &map, 0, 0, 64 * it, ring.full_k(it));
      }
    }
    if constexpr (LOADER == sm90::Loader::cp_async) sm90::cp_async_wait_all();
  } else {
    const int cw = wg - 1;
    for (int it = 0; it < tiles; ++it) {
      ring.wait_k(it, dog);
      const uint8_t* t = p + ring.stage(it) * kTileBytes;
      long long sum = 0;
      for (int i = tid; i < 64 * 64; i += 128) {
        const uint16_t bits = *reinterpret_cast<const uint16_t*>(t + sm90::sw128_offset(64, i / 64, i % 64));
        sum += static_cast<long long>(__bfloat162float(__ushort_as_bfloat16(bits)));
      }
      const unsigned h = (static_cast<unsigned>(it) * 2654435761u) ^ (static_cast<unsigned>(tid + 977 * cw) * 40503u);
      if ((h >> 7) % 5 == 0) __nanosleep(200 + (h % 1500));
#pragma unroll
      for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (tid % 32 == 0) atomicAdd(&sums[cw * tiles + it], static_cast<unsigned long long>(sum));
      ring.release(it);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Unit tests: host side.

void unit_copies(std::mt19937_64& rng) {
  constexpr int kRows = 128, kCols = 128, kHeads = 3;
  // cp.async: rows 50.. of head 1 of a [300][3][128] tensor, 100 valid rows.
  if (!excluded("copy-cp-async")) {
    g_current = "copy-cp-async";
    const int total_rows = 300, row0 = 50, head = 1, valid = 100;
    std::vector<uint16_t> h = random_bf16(static_cast<size_t>(total_rows) * kHeads * kCols, rng);
    DeviceBuffer<uint16_t> src(h.size()), out(kRows * kCols);
    src.upload(h);
    CK(cudaMemset(out.ptr, 0xff, out.count * 2));
    auto kernel = unit_copy_cp_async<kRows, kCols>;
    set_smem(kernel, kRows * kCols * 2 + 1024);
    kernel<<<1, 128, kRows * kCols * 2 + 1024>>>(
        reinterpret_cast<const bf16*>(src.ptr) + (static_cast<int64_t>(row0) * kHeads + head) * kCols, kHeads * kCols,
        valid, out.ptr);
    CK(cudaGetLastError());
    sync_or_die();
    const std::vector<uint16_t> o = out.download();
    int bad = 0, first = -1;
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kCols; ++c) {
        const uint16_t want = r < valid ? h[(static_cast<size_t>(row0 + r) * kHeads + head) * kCols + c] : 0;
        if (o[r * kCols + c] != want) {
          if (first < 0) first = r * kCols + c;
          ++bad;
        }
      }
    record("unit", "copy-cp-async", bad == 0,
           "128x128 tile, 100 valid rows, row stride 384: " + std::to_string(bad) + " elements differ" +
               (first >= 0 ? " (first at row " + std::to_string(first / kCols) + " col " +
                                 std::to_string(first % kCols) + ")"
                           : ", zero-filled rows exact"));
  }
  // TMA: head 2, rows 150..277 of a [200][3][128] tensor: 50 rows in bounds, the rest zero-filled.
  if (!excluded("copy-tma")) {
    g_current = "copy-tma";
    const int total_rows = 200, row0 = 150, head = 2;
    std::vector<uint16_t> h = random_bf16(static_cast<size_t>(total_rows) * kHeads * kCols, rng);
    DeviceBuffer<uint16_t> src(h.size()), out(kRows * kCols);
    src.upload(h);
    CK(cudaMemset(out.ptr, 0xff, out.count * 2));
    CUtensorMap map;
    const std::string err = sm90::encode_thd_tile_map(map, false, src.ptr, total_rows, kHeads, kCols, kRows);
    if (!err.empty()) {
      record("unit", "copy-tma", false, err);
    } else {
      DeviceWatchdog dog;
      auto kernel = unit_copy_tma<kRows, kCols>;
      set_smem(kernel, kRows * kCols * 2 + 1024 + 64);
      kernel<<<1, 128, kRows * kCols * 2 + 1024 + 64>>>(map, head, row0, out.ptr, dog.arm());
      CK(cudaGetLastError());
      sync_or_die();
      const std::string w = dog.report();
      const std::vector<uint16_t> o = out.download();
      int bad = 0, first = -1;
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < kCols; ++c) {
          const int gr = row0 + r;
          const uint16_t want = gr < total_rows ? h[(static_cast<size_t>(gr) * kHeads + head) * kCols + c] : 0;
          if (o[r * kCols + c] != want) {
            if (first < 0) first = r * kCols + c;
            ++bad;
          }
        }
      record("unit", "copy-tma", bad == 0 && w.empty(),
             (w.empty() ? "" : w + " (the transaction count of a box that crosses the tensor end?); ") +
                 "SWIZZLE_128B box vs the SW128 formula, 78 rows past the tensor end: " + std::to_string(bad) +
                 " elements differ" +
                 (first >= 0 ? " (first at row " + std::to_string(first / kCols) + " col " +
                                   std::to_string(first % kCols) + ")"
                             : ""));
    }
  }
}


void unit_chain_test(std::mt19937_64& rng) {
  const std::string name = "chain-s-p-pv";
  if (excluded(name)) return;
  g_current = name;
  constexpr int BN = 128, D = 128;
  const std::vector<uint16_t> q = random_bf16(64 * D, rng), k = random_bf16(BN * D, rng),
                              v = random_bf16(BN * D, rng);
  DeviceBuffer<uint16_t> dq(q.size()), dk(k.size()), dv(v.size());
  DeviceBuffer<float> ds(64 * BN), dout(64 * D);
  dq.upload(q);
  dk.upload(k);
  dv.upload(v);
  CK(cudaMemset(ds.ptr, 0xff, ds.count * 4));
  CK(cudaMemset(dout.ptr, 0xff, dout.count * 4));
  auto kernel = unit_chain<BN, D>;
  const int smem = (64 * D + 2 * BN * D) * 2 + 1024;
  set_smem(kernel, smem);
  kernel<<<1, 128, smem>>>(reinterpret_cast<const bf16*>(dq.ptr), reinterpret_cast<const bf16*>(dk.ptr),
                           reinterpret_cast<const bf16*>(dv.ptr), ds.ptr, dout.ptr);
  CK(cudaGetLastError());
  sync_or_die();
  const std::vector<float> s = ds.download(), o = dout.download();
  double s_err = 0, o_err2 = 0, o_ref2 = 0, o_max = 0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < BN; ++n) {
      double ref = 0;
      for (int x = 0; x < D; ++x) ref += double(bf16_to_float(q[m * D + x])) * bf16_to_float(k[n * D + x]);
      s_err = std::max(s_err, std::isfinite(s[m * BN + n]) ? std::fabs(s[m * BN + n] - ref) : 1e30);
    }
  for (int m = 0; m < 64; ++m)
    for (int x = 0; x < D; ++x) {
      double ref = 0;  // P = dtype(S as the kernel computed it): the O check does not depend on S's rounding
      for (int n = 0; n < BN; ++n) ref += double(bf16_to_float(float_to_bf16(s[m * BN + n]))) * bf16_to_float(v[n * D + x]);
      const double e = std::isfinite(o[m * D + x]) ? o[m * D + x] - ref : 1e30;
      o_err2 += e * e;
      o_ref2 += ref * ref;
      o_max = std::max(o_max, std::fabs(e));
    }
  const double rel = std::sqrt(o_err2 / std::max(o_ref2, 1e-300));
  record("unit", name, s_err <= 1e-3 && rel <= 1e-5,
         "S = Q K^T (64x128, d 128) max abs err " + fmt("%.3g", s_err) + "; O = bf16(S) V rel err " + fmt("%.3g", rel) +
             " (max abs " + fmt("%.3g", o_max) + ")");
}

void unit_ring_test(sm90::Loader loader, std::mt19937_64& rng) {
  const std::string name = loader == sm90::Loader::tma ? "ring-tma" : "ring-cp-async";
  if (excluded(name)) return;
  g_current = name;
  const int tiles = 37, rows = tiles * 64 - 23;  // the last tile holds 41 rows: zero-fill / out-of-bounds fill
  std::uniform_int_distribution<int> ud(-100, 100);
  std::vector<uint16_t> h(static_cast<size_t>(rows) * 64);
  for (auto& x : h) x = float_to_bf16(static_cast<float>(ud(rng)));
  DeviceBuffer<uint16_t> src(h.size());
  DeviceBuffer<unsigned long long> sums(2 * tiles);
  src.upload(h);
  CK(cudaMemset(sums.ptr, 0, sums.count * 8));
  CUtensorMap map;
  std::memset(&map, 0, sizeof map);
  if (loader == sm90::Loader::tma) {
    const std::string err = sm90::encode_thd_tile_map(map, false, src.ptr, rows, 1, 64, 64);
    if (!err.empty()) {
      record("unit", name, false, err);
      return;
    }
  }
  DeviceWatchdog dog;
  const int smem = 2 * 64 * 64 * 2 + 1024 + 64;
  if (loader == sm90::Loader::tma) {
    set_smem(unit_ring<sm90::Loader::tma>, smem);
    unit_ring<sm90::Loader::tma><<<1, 384, smem>>>(reinterpret_cast<const bf16*>(src.ptr), rows, tiles, map,
                                                  sums.ptr, dog.arm());
  } else {
    set_smem(unit_ring<sm90::Loader::cp_async>, smem);
    unit_ring<sm90::Loader::cp_async><<<1, 384, smem>>>(reinterpret_cast<const bf16*>(src.ptr), rows, tiles, map,
                                                       sums.ptr, dog.arm());
  }
  CK(cudaGetLastError());
  sync_or_die();
  const std::string w = dog.report();
  const std::vector<unsigned long long> got = sums.download();
  int bad = 0;
  for (int it = 0; it < tiles; ++it) {
    long long want = 0;
    for (int r = 64 * it; r < std::min(rows, 64 * it + 64); ++r)
      for (int c = 0; c < 64; ++c) want += static_cast<long long>(bf16_to_float(h[static_cast<size_t>(r) * 64 + c]));
    for (int cw = 0; cw < 2; ++cw)
      if (static_cast<long long>(got[cw * tiles + it]) != want) ++bad;
  }
  record("unit", name, bad == 0 && w.empty(),
         (w.empty() ? "" : w + "; ") + "2-stage ring, 37 tiles, 1 producer + 2 consumer warpgroups: " +
             std::to_string(bad) + " of 74 tile sums wrong");
}

void run_unit_tests(std::mt19937_64& rng) {
  std::printf("\n==== unit tests ====\n");
  unit_copies(rng);
  // SS, both operands K-major in SW128 tiles.
  unit_gemm<64, 64, 1, 64, 0, false>("wgmma-ss-m64n64k16", "one m64n64k16 SS product", 0, rng);
  unit_gemm<64, 64, 4, 64, 0, false>("wgmma-ss-m64n64-k64", "m64n64k16 x4 (k offsets 32/64/96 B in the atom)", 0, rng);
  unit_gemm<64, 128, 8, 64, 0, false>("wgmma-ss-m64n64-k128", "m64n64k16 x8 (d 128: two column blocks; S of BN 64)", 0,
                                      rng);
  unit_gemm<128, 128, 8, 128, 0, false>("wgmma-ss-m64n128-k128-rows64",
                                        "m64n128k16 x8, A = rows 64..127 of a 128-row tile (S of warpgroup 2)", 64, rng);
  // B MN-major (the P V operand) from shared memory, and A from registers with a K-major B: each isolates one part.
  unit_gemm<128, 128, 8, 64, 1, false>("wgmma-ss-bmn-m64n128-k128", "SS with B MN-major, N 128 (LBO between blocks)", 0,
                                       rng);
  unit_gemm<64, 64, 4, 64, 0, true>("wgmma-rs-m64n64-k64", "RS (A fragments from registers), B K-major", 0, rng);
  // The P V shapes: RS with B MN-major.
  unit_gemm<128, 128, 8, 64, 1, true>("wgmma-rs-bmn-m64n128-k128", "RS, B MN-major: P V of d 128, BN 128", 0, rng);
  unit_gemm<128, 64, 4, 64, 1, true>("wgmma-rs-bmn-m64n128-k64", "RS, B MN-major: P V of d 128, BN 64", 0, rng);
  unit_gemm<64, 128, 8, 64, 1, true>("wgmma-rs-bmn-m64n64-k128", "RS, B MN-major: P V of d 64, BN 128", 0, rng);
  unit_chain_test(rng);
  unit_ring_test(sm90::Loader::cp_async, rng);
  unit_ring_test(sm90::Loader::tma, rng);
}

// ---------------------------------------------------------------------------------------------------------------
// Forward: CPU reference, variants.

struct HostData {
  std::vector<uint16_t> q, k, v;  // dtype bits, NaN in pad rows
  std::vector<double> o_ref;      // [q_rows][heads_q][d]
  std::vector<double> lse_ref;    // [heads_q][q_rows]; -inf: no visible key
  std::vector<uint8_t> valid;     // [q_rows]: inside a Q segment
  double visible_pairs = 0;       // per head
};

HostData make_host_data(const Case& c) {
  HostData h;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Every row starts as NaN: pad rows keep it, so a pad value that reaches an output shows.
  h.q.assign(static_cast<size_t>(c.q_rows) * c.heads_q * c.d, nan_bits(c.fp16));
  h.k.assign(static_cast<size_t>(c.kv_rows) * c.heads_kv * c.d, nan_bits(c.fp16));
  h.v.assign(h.k.size(), nan_bits(c.fp16));
  h.valid.assign(c.q_rows, 0);
  std::vector<uint8_t> kv_valid(c.kv_rows, 0);
  for (const SequenceDesc& s : c.seqs)
    for (int g = 0; g < 2; ++g) {
      for (int r = 0; r < s.q_count[g]; ++r) h.valid[s.q_first_row[g] + r] = 1;
      for (int r = 0; r < s.kv_count[g]; ++r) kv_valid[s.kv_first_row[g] + r] = 1;
    }
  for (int64_t r = 0; r < c.q_rows; ++r)
    if (h.valid[r])
      for (int i = 0; i < c.heads_q * c.d; ++i) h.q[r * c.heads_q * c.d + i] = to_bits(nd(rng), c.fp16);
  for (int64_t r = 0; r < c.kv_rows; ++r)
    if (kv_valid[r])
      for (int i = 0; i < c.heads_kv * c.d; ++i) {
        h.k[r * c.heads_kv * c.d + i] = to_bits(nd(rng), c.fp16);
        h.v[r * c.heads_kv * c.d + i] = to_bits(nd(rng), c.fp16);
      }
  // Reference in float64 on the dtype values.
  std::vector<float> qf(h.q.size()), kf(h.k.size()), vf(h.v.size());
  for (size_t i = 0; i < h.q.size(); ++i) qf[i] = from_bits(h.q[i], c.fp16);
  for (size_t i = 0; i < h.k.size(); ++i) kf[i] = from_bits(h.k[i], c.fp16);
  for (size_t i = 0; i < h.v.size(); ++i) vf[i] = from_bits(h.v[i], c.fp16);
  h.o_ref.assign(static_cast<size_t>(c.q_rows) * c.heads_q * c.d, 0.0);
  h.lse_ref.assign(static_cast<size_t>(c.heads_q) * c.q_rows, -INFINITY);
  struct Item {
    int s, g, i;
  };
  std::vector<Item> items;
  for (size_t s = 0; s < c.seqs.size(); ++s)
    for (int g = 0; g < 2; ++g)
      for (int i = 0; i < c.seqs[s].q_count[g]; ++i) items.push_back({static_cast<int>(s), g, i});
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const int group = c.heads_q / c.heads_kv;
  std::vector<double> pairs(items.size(), 0.0);
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t idx) {
    const Item it = items[idx];
    const SequenceDesc& s = c.seqs[it.s];
    const int64_t delta = static_cast<int64_t>(s.length_kv) - s.length_q;
    const int64_t row = s.q_first_row[it.g] + it.i;
    const int64_t qp = s.q_position[it.g] + it.i;
    std::vector<double> sc;
    std::vector<int64_t> kr;
    for (int h_ = 0; h_ < c.heads_q; ++h_) {
      const int kvh = h_ / group;
      sc.clear();
      kr.clear();
      const float* qv = &qf[(row * c.heads_q + h_) * c.d];
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < s.kv_count[g]; ++j) {
          if (!visible(c, delta, qp, static_cast<int64_t>(s.kv_position[g]) + j)) continue;
          const int64_t r = s.kv_first_row[g] + j;
          const float* kv = &kf[(r * c.heads_kv + kvh) * c.d];
          double dot = 0;
          for (int x = 0; x < c.d; ++x) dot += static_cast<double>(qv[x]) * kv[x];
          sc.push_back(dot * scale);
          kr.push_back(r);
        }
      if (h_ == 0) pairs[idx] = static_cast<double>(sc.size());
      double* o = &h.o_ref[(row * c.heads_q + h_) * c.d];
      if (sc.empty()) continue;  // O = 0, LSE = -inf
      const double m = *std::max_element(sc.begin(), sc.end());
      double sum = 0;
      for (double& x : sc) sum += (x = std::exp(x - m));
      for (size_t j = 0; j < sc.size(); ++j) {
        const float* vv = &vf[(kr[j] * c.heads_kv + kvh) * c.d];
        const double w = sc[j] / sum;
        for (int x = 0; x < c.d; ++x) o[x] += w * vv[x];
      }
      h.lse_ref[static_cast<int64_t>(h_) * c.q_rows + row] = m + std::log(sum);
    }
  });
  for (double p : pairs) h.visible_pairs += p;
  return h;
}

struct Variant {
  std::string name;
  int d;
  bool fp16;
  int block_m;
  bool tma = false;
  bool mma_sync = false;  // the existing forward kernel (gpu/kernels/mma_sync/attention_kernels.cuh)
  std::function<std::string(const AttentionParams&, sm90::ForwardTensorMaps&)> prepare;
  std::function<std::string(const AttentionParams&, const sm90::ForwardTensorMaps&, sm90::Watchdog)> launch;
  std::vector<std::string> depends;  // unit tests the variant relies on
};

template <class Cfg>
Variant wgmma_variant(const std::string& name) {
  Variant v;
  v.name = name;
  v.d = Cfg::D;
  v.fp16 = std::is_same_v<typename Cfg::T, __half>;
  v.block_m = Cfg::kBlockM;
  v.tma = Cfg::kLoader == sm90::Loader::tma;
  v.prepare = [](const AttentionParams& p, sm90::ForwardTensorMaps& maps) -> std::string {
    if constexpr (Cfg::kLoader == sm90::Loader::tma) return sm90::encode_forward_maps<Cfg>(p, maps);
    return {};
  };
  v.launch = [](const AttentionParams& p, const sm90::ForwardTensorMaps& maps, sm90::Watchdog dog) {
    return sm90::launch_forward_sm90<Cfg>(p, maps, dog, 0);
  };
  v.depends = {"wgmma-ss-m64n128-k128-rows64", "wgmma-rs-bmn-m64n128-k128", "chain-s-p-pv",
               v.tma ? "ring-tma" : "ring-cp-async", v.tma ? "copy-tma" : "copy-cp-async"};
  return v;
}

#ifdef HF_HAVE_MMA_SYNC_FORWARD
template <class T, int D>
Variant mma_sync_variant(const std::string& name) {
  Variant v;
  v.name = name;
  v.d = D;
  v.fp16 = std::is_same_v<T, __half>;
  v.block_m = 64;
  v.mma_sync = true;
  v.prepare = [](const AttentionParams&, sm90::ForwardTensorMaps&) { return std::string(); };
  v.launch = [](const AttentionParams& p, const sm90::ForwardTensorMaps&, sm90::Watchdog) -> std::string {
    using Cfg = cpgold::gpu::detail::ForwardConfig<T, D, D, 4>;
    auto kernel = cpgold::gpu::detail::attention_forward_kernel<T, D, D, 4>;
    if (p.q_tile_count == 0) return {};
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
        e != cudaSuccess)
      return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
    kernel<<<dim3(p.q_tile_count, p.heads_q), Cfg::kThreads, Cfg::kSmemBytes>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return std::string("launch: ") + cudaGetErrorString(e);
    return {};
  };
  return v;
}
#endif

std::vector<Variant> all_variants() {
  using sm90::ForwardSm90Config;
  using sm90::Loader;
  std::vector<Variant> v;
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 128, 128, 1, 64, Loader::cp_async>>("wgmma-cpasync-m64n64"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 128, 128, 2, 128, Loader::cp_async>>("wgmma-cpasync-m128n128"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 128, 128, 1, 64, Loader::tma>>("wgmma-tma-m64n64"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 128, 128, 2, 128, Loader::tma>>("wgmma-tma-m128n128"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 128, 128, 2, 128, Loader::cp_async, true>>("wgmma-cpasync-m128n128-pp"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 128, 128, 2, 128, Loader::tma, true>>("wgmma-tma-m128n128-pp"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 64, 64, 1, 64, Loader::cp_async>>("wgmma-cpasync-m64n64-d64"));
  v.push_back(wgmma_variant<ForwardSm90Config<bf16, 64, 64, 2, 128, Loader::tma>>("wgmma-tma-m128n128-d64"));
  v.push_back(wgmma_variant<ForwardSm90Config<__half, 128, 128, 2, 128, Loader::tma>>("wgmma-tma-m128n128-fp16"));
#ifdef HF_HAVE_MMA_SYNC_FORWARD
  v.push_back(mma_sync_variant<bf16, 128>("mma-sync-v1"));
  v.push_back(mma_sync_variant<bf16, 64>("mma-sync-v1-d64"));
  v.push_back(mma_sync_variant<__half, 128>("mma-sync-v1-fp16"));
#endif
  return v;
}

// Device copy of one case: inputs, tile lists, outputs.
struct DeviceCase {
  DeviceBuffer<uint16_t> q, k, v, o;
  DeviceBuffer<float> lse;
  DeviceBuffer<SequenceDesc> seqs;
  TileLists q_tile_lists;
  AttentionParams base{};
  DeviceCase(const Case& c, const HostData* h)
      : q(static_cast<size_t>(c.q_rows) * c.heads_q * c.d),
        k(static_cast<size_t>(c.kv_rows) * c.heads_kv * c.d),
        v(static_cast<size_t>(c.kv_rows) * c.heads_kv * c.d),
        o(static_cast<size_t>(c.q_rows) * c.heads_q * c.d),
        lse(static_cast<size_t>(c.heads_q) * c.q_rows),
        seqs(c.seqs.size()),
        q_tile_lists(q_tiles(c, 64), q_tiles(c, 128)) {
    if (h != nullptr) {
      q.upload(h->q);
      k.upload(h->k);
      v.upload(h->v);
    }
    seqs.upload(c.seqs);
    base = case_params(c, seqs.ptr, q.ptr, k.ptr, v.ptr, o.ptr, lse.ptr);
  }
  AttentionParams params(int block_m) const {
    AttentionParams p = base;
    p.q_tiles = q_tile_lists.tiles(block_m);
    p.q_tile_count = q_tile_lists.count(block_m);
    return p;
  }
  void poison() { fill_nan(o, lse); }
};

// Runs variant `v` on the device case once (output poisoned first); "" or the failure.
std::string run_once(const Variant& v, DeviceCase& dc, DeviceWatchdog& dog) {
  dc.poison();
  const AttentionParams p = dc.params(v.block_m);
  sm90::ForwardTensorMaps maps;
  std::memset(&maps, 0, sizeof maps);
  if (std::string e = v.prepare(p, maps); !e.empty()) return e;
  if (std::string e = v.launch(p, maps, dog.arm()); !e.empty()) return e;
  sync_or_die();
  return dog.report();
}

struct Check {
  bool pass = true;
  std::string detail;
  double rel = 0, max_abs = 0, lse_err = 0;
};

Check compare(const Case& c, const HostData& h, const std::vector<uint16_t>& o, const std::vector<float>& lse) {
  Check r;
  double e2 = 0, r2 = 0;
  int64_t nonfinite = 0, pad_bad = 0, empty_bad = 0, lse_set_bad = 0, empty_rows = 0;
  for (int64_t row = 0; row < c.q_rows; ++row)
    for (int hq = 0; hq < c.heads_q; ++hq) {
      const uint16_t* orow = &o[(row * c.heads_q + hq) * c.d];
      const double* ref = &h.o_ref[(row * c.heads_q + hq) * c.d];
      const float l = lse[static_cast<int64_t>(hq) * c.q_rows + row];
      const double lref = h.lse_ref[static_cast<int64_t>(hq) * c.q_rows + row];
      if (!h.valid[row]) {
        for (int x = 0; x < c.d; ++x) pad_bad += orow[x] != 0;
        pad_bad += !(std::isinf(l) && l < 0);
        continue;
      }
      if (std::isinf(lref)) {
        ++empty_rows;
        for (int x = 0; x < c.d; ++x) empty_bad += from_bits(orow[x], c.fp16) != 0.f;
        lse_set_bad += !(std::isinf(l) && l < 0);
        continue;
      }
      if (!std::isfinite(l)) {
        ++lse_set_bad;
      } else {
        r.lse_err = std::max(r.lse_err, std::fabs(l - lref));
      }
      for (int x = 0; x < c.d; ++x) {
        const float got = from_bits(orow[x], c.fp16);
        if (!std::isfinite(got)) {
          ++nonfinite;
          continue;
        }
        const double e = got - ref[x];
        e2 += e * e;
        r2 += ref[x] * ref[x];
        r.max_abs = std::max(r.max_abs, std::fabs(e));
      }
    }
  r.rel = std::sqrt(e2 / std::max(r2, 1e-300));
  const double rel_tol = c.fp16 ? 3e-3 : 1e-2, abs_tol = c.fp16 ? 1e-2 : 4e-2, lse_tol = 2e-3;
  r.pass = nonfinite == 0 && pad_bad == 0 && empty_bad == 0 && lse_set_bad == 0 && r.rel <= rel_tol &&
           r.max_abs <= abs_tol && r.lse_err <= lse_tol;
  r.detail = "rel " + fmt("%.2e", r.rel) + " (tol " + fmt("%.0e", rel_tol) + "), max abs " + fmt("%.2e", r.max_abs) +
             ", lse err " + fmt("%.2e", r.lse_err) + ", non-finite " + std::to_string(nonfinite) +
             ", pad values not 0/-inf " + std::to_string(pad_bad) + ", no-key rows " + std::to_string(empty_rows) +
             " (O not 0: " + std::to_string(empty_bad) + ", LSE -inf set differs: " + std::to_string(lse_set_bad) +
             ")";
  return r;
}

void run_forward_tests(const std::vector<Variant>& variants) {
  std::printf("\n==== forward ====\n");
  DeviceWatchdog dog;
  for (const Case& c : forward_cases()) {
    const HostData h = make_reference(c, make_host_data);
    DeviceCase dc(c, &h);
    for (const Variant& v : variants) {
      const std::string test = begin_test(v, c);
      if (test.empty()) continue;
      std::string deps;
      for (const std::string& u : v.depends)
        if (!passed("unit", u)) deps += (deps.empty() ? "" : ", ") + u;
      const std::string note = deps.empty() ? "" : " [depends on failed unit tests: " + deps + "]";
      if (std::string e = run_once(v, dc, dog); !e.empty()) {
        record("forward", test, false, e + note);
        continue;
      }
      const std::vector<uint16_t> o1 = dc.o.download();
      const std::vector<float> l1 = dc.lse.download();
      Check r = compare(c, h, o1, l1);
      // Rerun on the same inputs: a different bit anywhere is a race.
      if (std::string e = run_once(v, dc, dog); !e.empty()) {
        record("forward", test, false, "rerun: " + e + note);
        continue;
      }
      const std::vector<uint16_t> o2 = dc.o.download();
      const std::vector<float> l2 = dc.lse.download();
      const bool same = o1 == o2 && std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0;
      record("forward", test, r.pass && same, r.detail + (same ? ", rerun identical" : ", RERUN DIFFERS") + note);
    }
  }
}

// Checks of the harness itself that need no GPU (--host-check): the tile lists cover every Q row once and stay
// inside their segments, and compare() passes the reference rounded to the dtype and fails planted faults.
int host_check() {
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    failures += ok ? 0 : 1;
  };
  for (const Case& c : forward_cases()) {
    const HostData h = make_host_data(c);
    for (int rows : {64, 128}) {
      std::vector<int> cover(c.q_rows, 0);
      bool inside = true;
      for (const RowTile& t : q_tiles(c, rows)) {
        inside = inside && t.rows >= 1 && t.rows <= rows;
        for (int r = 0; r < t.rows; ++r) {
          cover[t.first_row + r]++;
          if (t.sequence >= 0) {
            const SequenceDesc& s = c.seqs[t.sequence];
            const int64_t i = t.first_row + r - s.q_first_row[t.segment];
            inside = inside && i >= 0 && i < s.q_count[t.segment] && t.position + r == s.q_position[t.segment] + i;
          } else {
            inside = inside && !h.valid[t.first_row + r];
          }
        }
      }
      expect(inside && std::all_of(cover.begin(), cover.end(), [](int n) { return n == 1; }),
             c.name + ": tiles of " + std::to_string(rows) + " rows cover every row once, inside their segments");
    }
    std::vector<uint16_t> o(h.o_ref.size());
    std::vector<float> lse(h.lse_ref.size());
    int64_t no_key = -1, valid_elem = -1, pad_row = -1;
    for (int64_t row = 0; row < c.q_rows; ++row)
      for (int hq = 0; hq < c.heads_q; ++hq) {
        const int64_t li = static_cast<int64_t>(hq) * c.q_rows + row;
        lse[li] = h.valid[row] ? static_cast<float>(h.lse_ref[li]) : -INFINITY;
        for (int x = 0; x < c.d; ++x) {
          const int64_t oi = (row * c.heads_q + hq) * c.d + x;
          o[oi] = h.valid[row] ? to_bits(static_cast<float>(h.o_ref[oi]), c.fp16) : 0;
        }
        if (h.valid[row] && std::isinf(h.lse_ref[li])) no_key = li;
        if (h.valid[row] && !std::isinf(h.lse_ref[li])) valid_elem = (row * c.heads_q + hq) * c.d;
        if (!h.valid[row]) pad_row = (row * c.heads_q + hq) * c.d;
      }
    const Check good = compare(c, h, o, lse);
    expect(good.pass, c.name + ": the reference rounded to the dtype passes (" + good.detail + ")");
    if (valid_elem >= 0) {
      std::vector<uint16_t> bad = o;
      bad[valid_elem] = to_bits(from_bits(bad[valid_elem], c.fp16) + 0.5f, c.fp16);
      expect(!compare(c, h, bad, lse).pass, c.name + ": an error of 0.5 in one element fails");
      bad = o;
      bad[valid_elem] = nan_bits(c.fp16);
      expect(!compare(c, h, bad, lse).pass, c.name + ": one NaN fails");
    }
    if (pad_row >= 0) {
      std::vector<uint16_t> bad = o;
      bad[pad_row] = to_bits(-0.0f, c.fp16);
      expect(!compare(c, h, bad, lse).pass, c.name + ": a pad element -0 (not exactly 0 bits) fails");
    }
    if (no_key >= 0) {
      std::vector<float> bad = lse;
      bad[no_key] = 0.f;
      expect(!compare(c, h, o, bad).pass, c.name + ": a finite LSE on a row with no visible key fails");
    }
    int64_t empty = 0;
    for (int hq = 0; hq < c.heads_q; ++hq)
      for (int64_t row = 0; row < c.q_rows; ++row)
        empty += h.valid[row] && std::isinf(h.lse_ref[static_cast<int64_t>(hq) * c.q_rows + row]);
    std::printf("  %s: %.3g visible pairs per head, %lld (row, head) with no visible key\n", c.name.c_str(),
                h.visible_pairs, static_cast<long long>(empty));
  }
  std::printf("host check: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------------------------
// Timing.


// Per block: sum of squared differences and of squared reference values, max |difference|, non-finite count.
__global__ void diff_kernel(const uint16_t* a, const uint16_t* ref, int64_t n, double* out) {
  __shared__ double s_e2[256], s_r2[256], s_max[256], s_bad[256];
  double e2 = 0, r2 = 0, mx = 0, bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(__ushort_as_bfloat16(a[i])), y = __bfloat162float(__ushort_as_bfloat16(ref[i]));
    if (!isfinite(x) || !isfinite(y)) {
      bad += 1;
      continue;
    }
    const double e = static_cast<double>(x) - y;
    e2 += e * e;
    r2 += static_cast<double>(y) * y;
    mx = fmax(mx, fabs(e));
  }
  s_e2[threadIdx.x] = e2, s_r2[threadIdx.x] = r2, s_max[threadIdx.x] = mx, s_bad[threadIdx.x] = bad;
  __syncthreads();
  for (int off = 128; off > 0; off /= 2) {
    if (threadIdx.x < off) {
      s_e2[threadIdx.x] += s_e2[threadIdx.x + off];
      s_r2[threadIdx.x] += s_r2[threadIdx.x + off];
      s_max[threadIdx.x] = fmax(s_max[threadIdx.x], s_max[threadIdx.x + off]);
      s_bad[threadIdx.x] += s_bad[threadIdx.x + off];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[4 * blockIdx.x + 0] = s_e2[0];
    out[4 * blockIdx.x + 1] = s_r2[0];
    out[4 * blockIdx.x + 2] = s_max[0];
    out[4 * blockIdx.x + 3] = s_bad[0];
  }
}

struct Diff {
  double rel = 0, max_abs = 0, nonfinite = 0;
};
Diff device_diff(const uint16_t* a, const uint16_t* ref, int64_t n) {
  constexpr int kBlocks = 512;
  DeviceBuffer<double> part(4 * kBlocks);
  diff_kernel<<<kBlocks, 256>>>(a, ref, n, part.ptr);
  const std::vector<double> h = download_after_launch(part);
  double e2 = 0, r2 = 0;
  Diff d;
  for (int b = 0; b < kBlocks; ++b) {
    e2 += h[4 * b], r2 += h[4 * b + 1];
    d.max_abs = std::max(d.max_abs, h[4 * b + 2]);
    d.nonfinite += h[4 * b + 3];
  }
  d.rel = std::sqrt(e2 / std::max(r2, 1e-300));
  return d;
}

void run_timing(const std::vector<Variant>& variants, int reps) {
  std::printf("\n==== timing ====\n");
  const int heads = 16, d = 128;
  char line[512];
  std::snprintf(line, sizeof line, "%-7s %-6s %-26s %9s %9s %8s  %s", "mask", "tokens", "kernel", "ms", "TFLOP/s",
                "vs v1", "check against mma-sync-v1 (O rel / max abs)");
  g_timing_rows.push_back(line);
  for (int64_t total : {16384, 65536})
    for (bool causal : {true, false}) {
      double pairs = 0;
      const Case c = timing_case(std::string(causal ? "causal" : "full") + "-" + std::to_string(total), heads, d,
                                 total, causal, pairs);
      const double flops = 4.0 * d * pairs * heads;
      g_current = "timing-setup";
      DeviceCase dc(c, nullptr);
      fill_normal<<<1024, 256>>>(dc.q.ptr, static_cast<int64_t>(dc.q.count), 11 + total + causal, false);
      fill_normal<<<1024, 256>>>(dc.k.ptr, static_cast<int64_t>(dc.k.count), 22 + total + causal, false);
      fill_normal<<<1024, 256>>>(dc.v.ptr, static_cast<int64_t>(dc.v.count), 33 + total + causal, false);
      CK(cudaGetLastError());
      sync_or_die();
      DeviceBuffer<uint16_t> o_v1(dc.o.count);
      bool have_v1 = false;
      double v1_ms = 0;
      DeviceWatchdog dog;
      // mma-sync-v1 first (the baseline and the check), then the wgmma variants.
      for (const Variant* vp : timing_order(variants, d)) {
        const Variant& v = *vp;
        if (!begin_timing(v, c)) continue;
        if (std::string e = run_once(v, dc, dog); !e.empty()) {
          record("timing", v.name + " / " + c.name, false, e);
          continue;
        }
        std::string check = "-";
        bool ok = true;
        if (v.mma_sync) {
          CK(cudaMemcpy(o_v1.ptr, dc.o.ptr, dc.o.count * 2, cudaMemcpyDeviceToDevice));
          have_v1 = true;
        } else if (have_v1) {
          const Diff df = device_diff(dc.o.ptr, o_v1.ptr, static_cast<int64_t>(dc.o.count));
          ok = df.nonfinite == 0 && df.rel <= 1.5e-2;
          check = fmt("%.2e", df.rel) + " / " + fmt("%.2e", df.max_abs) +
                  (df.nonfinite > 0 ? ", non-finite " + fmt("%.0f", df.nonfinite) : "");
          record("timing", v.name + " / " + c.name + " agrees with mma-sync-v1", ok, "O rel " + check);
        }
        const AttentionParams p = dc.params(v.block_m);
        sm90::ForwardTensorMaps maps;
        std::memset(&maps, 0, sizeof maps);
        if (std::string e = v.prepare(p, maps); !e.empty()) fatal(e, 4);
        const sm90::Watchdog off{};  // no watchdog in the timed launches
        const std::vector<float> sorted = time_launches(5, reps, [&] { return v.launch(p, maps, off); });
        const double med = sorted[reps / 2];
        if (v.mma_sync) v1_ms = med;
        const double tflops = flops / (med * 1e-3) / 1e12;
        std::snprintf(line, sizeof line, "%-7s %-6lld %-26s %9.3f %9.1f %8s  %s (min %.3f, max %.3f ms)",
                      causal ? "causal" : "full", static_cast<long long>(total), v.name.c_str(), med, tflops,
                      v1_ms > 0 ? fmt("%.2fx", v1_ms / med).c_str() : "-", check.c_str(), sorted.front(),
                      sorted.back());
        add_timing_row(line);
      }
    }
}

}  // namespace hf

int main(int argc, char** argv) {
  using namespace hf;
  Options options{30, 20, 20261201};  // --reps 30 (at least 20), --seed 20261201
  auto host_check_option = [](const std::string& a) {
    return a == "--host-check" ? std::optional<int>(host_check()) : std::nullopt;
  };
  if (const std::optional<int> code = read_options(argc, argv, "hopper_forward", options, host_check_option))
    return *code;
  if (!device_is_sm90(true)) return 2;
  return run_stages(options, all_variants, run_forward_tests, run_timing);
}
