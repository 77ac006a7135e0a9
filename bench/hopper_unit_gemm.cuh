#pragma once
// Device pieces both hopper programs use: dynamic shared memory aligned to 1024 bytes, the single-warpgroup wgmma
// unit test with its descriptor-offset probe, and the fast normal fill of the timing inputs. Included after
// bench/hopper_harness.hpp (reporting, device buffers).
#include <cstdint>
#include <string>
#include <vector>

#include "bench/hopper_harness.hpp"
#include "gpu/kernels/sm90/wgmma_ops.cuh"

namespace hf {

__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw, uint32_t& addr) {
  const uint32_t a = sm90::smem_u32(raw);
  addr = (a + 1023u) & ~1023u;
  return raw + (addr - a);
}

// One warpgroup: D (64 x N, float) = A (rows a_row0 .. a_row0 + 63 of an A_ROWS x KTILE tile, row-major in `a`) times
// B over KSTEPS k-steps of 16. TRANS_B = 0: b is B^T [N][KTILE] (K-major); 1: b is B [KTILE][N] (MN-major).
// A_REGS: A from registers (fragments read straight from global memory by the documented layout), else from
// shared memory. Descriptor offsets are run-time arguments so that the test can probe alternatives.
template <int N, int KTILE, int KSTEPS, int A_ROWS, int TRANS_B, bool A_REGS>
__global__ void __launch_bounds__(128)
    unit_wgmma(const bf16* a, int a_row0, const bf16* b, float* d, uint32_t lbo_a, uint32_t sbo_a, uint32_t lbo_b,
               uint32_t sbo_b) {
  extern __shared__ uint8_t raw[];
  uint32_t smem;
  aligned_smem(raw, smem);
  const uint32_t a_tile = smem;
  const uint32_t b_tile = smem + A_ROWS * KTILE * 2;
  const int tid = threadIdx.x;
  if constexpr (!A_REGS) sm90::load_tile_sw128_cp_async<A_ROWS, KTILE, 128>(a_tile, a, KTILE, A_ROWS, a, tid);
  if constexpr (TRANS_B == 0)
    sm90::load_tile_sw128_cp_async<N, KTILE, 128>(b_tile, b, KTILE, N, b, tid);
  else
    sm90::load_tile_sw128_cp_async<KTILE, N, 128>(b_tile, b, N, KTILE, b, tid);
  sm90::cp_async_wait_all();
  sm90::fence_proxy_async();
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  uint32_t af[KSTEPS][4];
  if constexpr (A_REGS) {
    const uint16_t* ab = reinterpret_cast<const uint16_t*>(a);
    auto pair = [&](int row, int col) {
      const int r = a_row0 + 16 * warp + row;
      return static_cast<uint32_t>(ab[r * KTILE + col]) | (static_cast<uint32_t>(ab[r * KTILE + col + 1]) << 16);
    };
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      af[k][0] = pair(g, 16 * k + 2 * c);
      af[k][1] = pair(g + 8, 16 * k + 2 * c);
      af[k][2] = pair(g, 16 * k + 8 + 2 * c);
      af[k][3] = pair(g + 8, 16 * k + 8 + 2 * c);
    }
  }
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  sm90::fence_registers(acc);
  if constexpr (A_REGS) sm90::fence_registers(af);
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k) {
    const uint64_t bd = TRANS_B ? sm90::desc_mn_major(b_tile, KTILE, 16 * k, lbo_b, sbo_b)
                                : sm90::desc_k_major(b_tile, N, 0, 16 * k, lbo_b, sbo_b);
    if constexpr (A_REGS)
      sm90::Wgmma<N, bf16, TRANS_B>::rs(acc, af[k], bd, k > 0 ? 1 : 0);
    else
      sm90::Wgmma<N, bf16, TRANS_B>::ss(acc, sm90::desc_k_major(a_tile, A_ROWS, a_row0, 16 * k, lbo_a, sbo_a), bd,
                                        k > 0 ? 1 : 0);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(acc);
  if constexpr (A_REGS) sm90::fence_registers(af);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) d[(16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * c + (e % 2)] = acc[4 * j + e];
}

struct GemmProbe {
  uint32_t lbo_a, sbo_a, lbo_b, sbo_b;
};

// Runs unit_wgmma once; returns the max abs error against the CPU product (and the max |ref|).
template <int N, int KTILE, int KSTEPS, int A_ROWS, int TRANS_B, bool A_REGS>
double run_gemm(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int a_row0, GemmProbe pr,
                double& max_ref, int& first_bad) {
  DeviceBuffer<uint16_t> da(a.size()), db(b.size());
  DeviceBuffer<float> dd(64 * N);
  da.upload(a);
  db.upload(b);
  CK(cudaMemset(dd.ptr, 0xff, dd.count * sizeof(float)));
  auto kernel = unit_wgmma<N, KTILE, KSTEPS, A_ROWS, TRANS_B, A_REGS>;
  // 64 KB of slack past the tiles: a probed descriptor with other offsets reads inside the allocation.
  const int smem = A_ROWS * KTILE * 2 + N * KTILE * 2 + 1024 + 65536;
  set_smem(kernel, smem);
  kernel<<<1, 128, smem>>>(reinterpret_cast<const bf16*>(da.ptr), a_row0, reinterpret_cast<const bf16*>(db.ptr),
                           dd.ptr, pr.lbo_a, pr.sbo_a, pr.lbo_b, pr.sbo_b);
  const std::vector<float> d = download_after_launch(dd);
  return product_error(d, N, [&](int m, int n) {
    double ref = 0;
    for (int k = 0; k < 16 * KSTEPS; ++k) {
      const double av = bf16_to_float(a[(a_row0 + m) * KTILE + k]);
      const double bv = bf16_to_float(TRANS_B ? b[k * N + n] : b[n * KTILE + k]);
      ref += av * bv;
    }
    return ref;
  }, max_ref, first_bad);
}

template <int N, int KTILE, int KSTEPS, int A_ROWS, int TRANS_B, bool A_REGS>
void unit_gemm(const std::string& name, const std::string& what, int a_row0, std::mt19937_64& rng) {
  if (excluded(name)) return;
  g_current = name;
  const std::vector<uint16_t> a = random_bf16(static_cast<size_t>(A_ROWS) * KTILE, rng);
  const std::vector<uint16_t> b = random_bf16(static_cast<size_t>(N) * KTILE, rng);
  const uint32_t mn_lbo = KTILE * 128;  // MN-major B: distance between 64-column blocks of the [KTILE][N] tile
  const GemmProbe chosen{16, 1024, TRANS_B ? mn_lbo : 16u, 1024};
  double max_ref;
  int first_bad;
  const double err = run_gemm<N, KTILE, KSTEPS, A_ROWS, TRANS_B, A_REGS>(a, b, a_row0, chosen, max_ref, first_bad);
  const bool ok = err <= 1e-3;
  std::string detail = what + ": max abs err " + fmt("%.3g", err) + " (max |ref| " + fmt("%.3g", max_ref) + ")";
  if (!ok && first_bad >= 0)
    detail += ", first bad at row " + std::to_string(first_bad / N) + " col " + std::to_string(first_bad % N);
  record("unit", name, ok, detail);
  if (!ok) {
    // Probe other descriptor offsets: which one would match names the field that is wrong.
    std::vector<GemmProbe> probes;
    for (uint32_t sbo : {512u, 1024u, 2048u, 128u, 256u})
      for (uint32_t lbo : {16u, 128u, 1024u, mn_lbo, 2 * mn_lbo, 8192u}) {
        probes.push_back({16, 1024, lbo, sbo});
        if (!A_REGS) probes.push_back({lbo, sbo, TRANS_B ? mn_lbo : 16u, 1024});
      }
    std::string found;
    for (const GemmProbe& pr : probes) {
      double mr;
      int fb;
      if (run_gemm<N, KTILE, KSTEPS, A_ROWS, TRANS_B, A_REGS>(a, b, a_row0, pr, mr, fb) <= 1e-3)
        found += " {A lbo " + std::to_string(pr.lbo_a) + " sbo " + std::to_string(pr.sbo_a) + ", B lbo " +
                 std::to_string(pr.lbo_b) + " sbo " + std::to_string(pr.sbo_b) + "}";
    }
    record("unit", name + "-probe", false,
           found.empty() ? "no probed descriptor offsets match" : "offsets that would match:" + found);
  }
}

// Normal-ish bf16/fp16 values from a hash of the index: timing inputs without a host round trip.
__global__ void fill_normal(uint16_t* x, int64_t n, uint64_t seed, bool fp16) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed ^ (static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull);
    float s = 0.f;
    for (int k = 0; k < 4; ++k) {  // sum of 4 uniforms, scaled to unit variance
      z ^= z >> 33;
      z *= 0xff51afd7ed558ccdull;
      z ^= z >> 33;
      z *= 0xc4ceb9fe1a85ec53ull;
      z ^= z >> 33;
      s += static_cast<float>(z >> 40) * (1.f / 16777216.f);
    }
    const float f = (s - 2.f) * 1.7320508f;
    x[i] = fp16 ? __half_as_ushort(__float2half_rn(f)) : __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}

}  // namespace hf
