// Self-checking program for the Hopper (sm_90a) wgmma attention backward (gpu/kernels/sm90/attention_backward_sm90.cuh):
// unit tests of the operand forms the backward adds, the backward on varlen THD batches against a float64 CPU
// reference, and timing against the mma.sync backward (gpu/kernels/mma_sync/attention_kernels.cuh) in the same run. Built and run by
// bench/hopper_backward.sh (nvcc directly, -gencode=arch=compute_90a,code=sm_90a); docs/hopper-kernels.md, "Backward".
//
// Stages (each result line reads "RESULT|stage|name|PASS or FAIL|detail"; the summary table comes last):
//   unit      one warpgroup wgmma products against a CPU product: the transposed-A SS form of dQ = dS K (A = dS read
//             from a [keys][queries] tile through the transpose bit, B = one 64-column block of an MN-major K tile),
//             the S^T = K Q^T form (A = rows 64..127 of the K tile, N = 64 queries), the dV += P^T dO form (RS, B
//             MN-major, K = 64 queries, N = 128); a failing product probes other descriptor offsets.
//   backward  atomic and deterministic modes on varlen batches (fresh normal data per case, NaN in every pad row of
//             Q, K, V, O, dO and LSE/delta of pad rows, outputs poisoned with NaN): dQ, dK, dV against the float64
//             reference (relative Frobenius error, max abs error), pad rows exactly 0, rows without any visible pair
//             exactly 0, no non-finite value; a rerun bitwise identical for dK/dV (both modes) and dQ
//             (deterministic); the summing form (deterministic) bit-exact against sum + float(the plain outputs).
//   timing    causal and full, d 128 bf16, 16 heads, 16k and 64k tokens: the mma.sync backward (atomic and
//             deterministic) and the sm90 backward (both modes), O and LSE from the sm90 forward; outputs compared with
//             the mma.sync backward's; CUDA events, median of --reps; TFLOP/s count 2.5 x 4 d per visible pair.
//
// Options: --reps N, --skip-timing, --exclude a,b, --seed S. Exit status: 0 all passed, 1 a check failed, 4 a CUDA
// call failed (context lost), 5 a kernel hung.
#include "gpu/kernels/sm90/attention_backward_sm90.cuh"
#include "bench/hopper_harness.hpp"
#include "bench/hopper_unit_gemm.cuh"
#if __has_include("gpu/kernels/mma_sync/attention_kernels.cuh")
#include "gpu/kernels/mma_sync/attention_kernels.cuh"
#define HF_HAVE_MMA_SYNC_FORWARD 1
#endif

namespace hf {

const char* watchdog_wait_name(int code) {
  static const char* names[] = {"?", "Q full", "K full", "V full", "stage empty", "test barrier", "K/V tile full",
                                "Q stage full", "dO stage full", "Q/dO full", "K stage full", "V stage full", "?"};
  return names[code >= 1 && code <= 11 ? code : 0];
}

// ---------------------------------------------------------------------------------------------------------------
// Unit tests: kernels.





// ---------------------------------------------------------------------------------------------------------------
// Unit test of the transposed-A form: D (64 x 64) = A B with A [64][K] given as at [K][64] (stored as an SW128 tile of
// K rows x 64 columns: M contiguous) read through desc_mn_major_a and WgmmaTA (imm-trans-a = 1), and B = column block
// `bblock` of b [K][128] (MN-major, an SW128 tile of K rows x 128 columns). This is dQ = dS K of the atomic backward
// (at = dS^T [keys][queries], b = K [keys][d]).
template <int KSTEPS>
__global__ void __launch_bounds__(128)
    unit_wgmma_ta(const bf16* at, const bf16* b, int bblock, float* d, uint32_t lbo_a, uint32_t sbo_a, uint32_t lbo_b,
                  uint32_t sbo_b) {
  constexpr int K = 16 * KSTEPS;
  extern __shared__ uint8_t raw[];
  uint32_t smem;
  aligned_smem(raw, smem);
  const uint32_t a_tile = smem, b_tile = smem + K * 64 * 2;
  const int tid = threadIdx.x;
  sm90::load_tile_sw128_cp_async<K, 64, 128>(a_tile, at, 64, K, at, tid);
  sm90::load_tile_sw128_cp_async<K, 128, 128>(b_tile, b, 128, K, b, tid);
  sm90::cp_async_wait_all();
  sm90::fence_proxy_async();
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  sm90::fence_registers(acc);
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k)
    sm90::WgmmaTA<64, bf16, 1>::ss(acc, sm90::desc_mn_major_a(a_tile, K, 16 * k, lbo_a, sbo_a),
                                   sm90::desc_mn_major(b_tile + bblock * K * 128, K, 16 * k, lbo_b, sbo_b),
                                   k > 0 ? 1 : 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(acc);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) d[(16 * warp + g + 8 * (e / 2)) * 64 + 8 * j + 2 * c + (e % 2)] = acc[4 * j + e];
}

template <int KSTEPS>
double run_gemm_ta(const std::vector<uint16_t>& at, const std::vector<uint16_t>& b, int bblock, GemmProbe pr,
                   double& max_ref, int& first_bad) {
  constexpr int K = 16 * KSTEPS;
  DeviceBuffer<uint16_t> da(at.size()), db(b.size());
  DeviceBuffer<float> dd(64 * 64);
  da.upload(at);
  db.upload(b);
  CK(cudaMemset(dd.ptr, 0xff, dd.count * sizeof(float)));
  auto kernel = unit_wgmma_ta<KSTEPS>;
  const int smem = K * 64 * 2 + K * 128 * 2 + 1024 + 65536;
  set_smem(kernel, smem);
  kernel<<<1, 128, smem>>>(reinterpret_cast<const bf16*>(da.ptr), reinterpret_cast<const bf16*>(db.ptr), bblock,
                           dd.ptr, pr.lbo_a, pr.sbo_a, pr.lbo_b, pr.sbo_b);
  const std::vector<float> d = download_after_launch(dd);
  return product_error(d, 64, [&](int m, int n) {
    double ref = 0;
    for (int k = 0; k < K; ++k)
      ref += static_cast<double>(bf16_to_float(at[k * 64 + m])) * bf16_to_float(b[k * 128 + 64 * bblock + n]);
    return ref;
  }, max_ref, first_bad);
}

template <int KSTEPS>
void unit_gemm_ta(const std::string& name, const std::string& what, int bblock, std::mt19937_64& rng) {
  if (excluded(name)) return;
  g_current = name;
  constexpr int K = 16 * KSTEPS;
  const std::vector<uint16_t> at = random_bf16(static_cast<size_t>(K) * 64, rng);
  const std::vector<uint16_t> b = random_bf16(static_cast<size_t>(K) * 128, rng);
  const GemmProbe chosen{K * 128, 1024, K * 128, 1024};
  double max_ref;
  int first_bad;
  const double err = run_gemm_ta<KSTEPS>(at, b, bblock, chosen, max_ref, first_bad);
  const bool ok = err <= 1e-3;
  std::string detail = what + ": max abs err " + fmt("%.3g", err) + " (max |ref| " + fmt("%.3g", max_ref) + ")";
  if (!ok && first_bad >= 0)
    detail += ", first bad at row " + std::to_string(first_bad / 64) + " col " + std::to_string(first_bad % 64);
  record("unit", name, ok, detail);
  if (!ok) {
    std::string found;
    for (uint32_t sbo : {1024u, 512u, 2048u, 128u, 256u, 8192u})
      for (uint32_t lbo : {16u, 128u, 1024u, 8192u, static_cast<uint32_t>(K * 128), 2u * K * 128}) {
        double mr;
        int fb;
        const GemmProbe pr{lbo, sbo, K * 128, 1024};
        if (run_gemm_ta<KSTEPS>(at, b, bblock, pr, mr, fb) <= 1e-3)
          found += " {A lbo " + std::to_string(lbo) + " sbo " + std::to_string(sbo) + "}";
      }
    record("unit", name + "-probe", false,
           found.empty() ? "no probed A descriptor offsets match" : "offsets that would match:" + found);
  }
}

void run_unit_tests(std::mt19937_64& rng) {
  std::printf("\n==== unit tests ====\n");
  // The forms of the dK/dV pass.
  unit_gemm<64, 128, 8, 128, 0, false>("bwd-ss-st-m64n64-k128-rows64",
                                       "S^T = K Q^T: A = rows 64..127 of a 128-row K tile, N = 64 queries", 64, rng);
  unit_gemm<128, 64, 4, 64, 1, true>("bwd-rs-bmn-m64n128-k64", "dV += P^T dO: RS, B = dO MN-major, K = 64 queries",
                                     0, rng);
  unit_gemm<64, 64, 4, 64, 1, true>("bwd-rs-bmn-m64n64-k64", "dV += P^T dO at d 64", 0, rng);
  // dQ = dS K through the transpose bit.
  unit_gemm_ta<8>("bwd-ss-ta-m64n64-k128-b0", "dQ = dS K: A MN-major (transpose bit), 128 keys, K block 0", 0, rng);
  unit_gemm_ta<8>("bwd-ss-ta-m64n64-k128-b1", "dQ = dS K: A MN-major (transpose bit), 128 keys, K block 1", 1, rng);
  unit_gemm_ta<1>("bwd-ss-ta-m64n64k16", "one m64n64k16 SS product with A MN-major", 0, rng);
  // The forms of the deterministic dQ pass: S = Q K^T (N = 64), dQ += dS K (RS, K MN-major, N = 128, K = 64 keys).
  unit_gemm<64, 128, 8, 128, 0, false>("bwd-ss-s-m64n64-k128-rows64", "S = Q K^T, rows 64..127 of a 128-row Q tile",
                                       64, rng);
}

// ---------------------------------------------------------------------------------------------------------------
// Backward: cases and the float64 CPU reference.

std::vector<Case> backward_cases() {
  std::vector<Case> cases = shared_cases(1500, 700, 600);
  {
    Case c = make_case("fp16-causal", {{1, 1}, {129, 129}, {1000, 1000}, {300, 300}}, 3, true);
    c.fp16 = true;
    cases.push_back(c);
  }
  {
    std::vector<std::pair<int, int>> l64;
    for (int l : {1, 17, 100, 128, 129, 1000, 0, 300}) l64.push_back({l, l});
    Case c = make_case("d64-causal-mixed", l64, 5, true);
    c.d = 64;
    cases.push_back(c);
  }
  for (size_t i = 0; i < cases.size(); ++i) cases[i].seed = 2000 + i;
  return cases;
}

// Row tiles over the KV segments (then pad tiles), as q_tiles does for Q.
std::vector<RowTile> kv_tiles(const Case& c, int rows) {
  Case t = c;
  for (SequenceDesc& s : t.seqs)
    for (int g = 0; g < 2; ++g) {
      s.q_first_row[g] = s.kv_first_row[g];
      s.q_count[g] = s.kv_count[g];
      s.q_position[g] = s.kv_position[g];
    }
  t.q_rows = c.kv_rows;
  return q_tiles(t, rows);
}

struct BwdHost {
  std::vector<uint16_t> q, k, v, o, dout;       // dtype bits; NaN in pad rows
  std::vector<float> lse;                        // [heads_q][q_rows] float32 (NaN in pad rows)
  std::vector<double> dq, dk, dv;                // reference
  std::vector<uint8_t> q_valid, kv_valid;        // rows inside a segment
  std::vector<uint8_t> dq_zero, dkv_zero;        // [row][head]: no visible pair (the output must be exactly 0)
};

BwdHost make_bwd_host(const Case& c) {
  BwdHost h;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int d = c.d, hq = c.heads_q, hk = c.heads_kv, group = hq / hk;
  const uint16_t nanb = nan_bits(c.fp16);
  h.q.assign(static_cast<size_t>(c.q_rows) * hq * d, nanb);
  h.o = h.q;
  h.dout = h.q;
  h.k.assign(static_cast<size_t>(c.kv_rows) * hk * d, nanb);
  h.v = h.k;
  h.lse.assign(static_cast<size_t>(hq) * c.q_rows, NAN);
  h.q_valid.assign(c.q_rows, 0);
  h.kv_valid.assign(c.kv_rows, 0);
  for (const SequenceDesc& s : c.seqs)
    for (int g = 0; g < 2; ++g) {
      for (int r = 0; r < s.q_count[g]; ++r) h.q_valid[s.q_first_row[g] + r] = 1;
      for (int r = 0; r < s.kv_count[g]; ++r) h.kv_valid[s.kv_first_row[g] + r] = 1;
    }
  for (int64_t r = 0; r < c.q_rows; ++r)
    if (h.q_valid[r])
      for (int i = 0; i < hq * d; ++i) {
        h.q[r * hq * d + i] = to_bits(nd(rng), c.fp16);
        h.dout[r * hq * d + i] = to_bits(nd(rng), c.fp16);
      }
  for (int64_t r = 0; r < c.kv_rows; ++r)
    if (h.kv_valid[r])
      for (int i = 0; i < hk * d; ++i) {
        h.k[r * hk * d + i] = to_bits(nd(rng), c.fp16);
        h.v[r * hk * d + i] = to_bits(nd(rng), c.fp16);
      }
  h.dq.assign(h.q.size(), 0.0);
  h.dk.assign(h.k.size(), 0.0);
  h.dv.assign(h.k.size(), 0.0);
  h.dq_zero.assign(static_cast<size_t>(c.q_rows) * hq, 1);
  h.dkv_zero.assign(static_cast<size_t>(c.kv_rows) * hk, 1);
  auto F = [&](uint16_t b) { return static_cast<double>(from_bits(b, c.fp16)); };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // One item per (sequence, kv head): its dK/dV rows are its own, and so are the dQ rows of its query heads.
  const int64_t items = static_cast<int64_t>(c.seqs.size()) * hk;
  parallel_for(items, [&](int64_t item) {
    const SequenceDesc& s = c.seqs[item / hk];
    const int kvh = static_cast<int>(item % hk);
    const int64_t delta = static_cast<int64_t>(s.length_kv) - s.length_q;
    std::vector<int64_t> qr, qp, kr, kp;
    for (int g = 0; g < 2; ++g) {
      for (int i = 0; i < s.q_count[g]; ++i) qr.push_back(s.q_first_row[g] + i), qp.push_back(s.q_position[g] + i);
      for (int j = 0; j < s.kv_count[g]; ++j) kr.push_back(s.kv_first_row[g] + j), kp.push_back(s.kv_position[g] + j);
    }
    const size_t nk = kr.size();
    std::vector<double> kf(nk * d), vf(nk * d), sc(nk), pr(nk), qv(d), dov(d);
    for (size_t j = 0; j < nk; ++j)
      for (int x = 0; x < d; ++x) {
        kf[j * d + x] = F(h.k[(kr[j] * hk + kvh) * d + x]);
        vf[j * d + x] = F(h.v[(kr[j] * hk + kvh) * d + x]);
      }
    std::vector<double> o(d);
    for (int hh = kvh * group; hh < (kvh + 1) * group; ++hh)
      for (size_t i = 0; i < qr.size(); ++i) {
        const int64_t base = (qr[i] * hq + hh) * d;
        for (int x = 0; x < d; ++x) qv[x] = F(h.q[base + x]), dov[x] = F(h.dout[base + x]);
        double m = -INFINITY;
        std::vector<size_t> vis;
        for (size_t j = 0; j < nk; ++j) {
          if (!visible(c, delta, qp[i], kp[j])) continue;
          double dot = 0;
          for (int x = 0; x < d; ++x) dot += qv[x] * kf[j * d + x];
          sc[j] = dot * scale;
          m = std::max(m, sc[j]);
          vis.push_back(j);
        }
        const int64_t li = static_cast<int64_t>(hh) * c.q_rows + qr[i];
        if (vis.empty()) {  // O = 0, LSE = -inf: P = 0 everywhere, dQ = 0
          for (int x = 0; x < d; ++x) h.o[base + x] = to_bits(0.f, c.fp16);
          h.lse[li] = -INFINITY;
          continue;
        }
        h.dq_zero[qr[i] * hq + hh] = 0;
        double sum = 0;
        for (size_t j : vis) sum += std::exp(sc[j] - m);
        const double lse = m + std::log(sum);
        std::fill(o.begin(), o.end(), 0.0);
        for (size_t j : vis) {
          pr[j] = std::exp(sc[j] - lse);
          for (int x = 0; x < d; ++x) o[x] += pr[j] * vf[j * d + x];
        }
        // The kernel's inputs: O rounded to the dtype, LSE as float32; delta from them (as the kernel computes it).
        double dl = 0;
        for (int x = 0; x < d; ++x) {
          h.o[base + x] = to_bits(static_cast<float>(o[x]), c.fp16);
          dl += F(h.o[base + x]) * dov[x];
        }
        h.lse[li] = static_cast<float>(lse);
        for (size_t j : vis) {
          double dp = 0;
          for (int x = 0; x < d; ++x) dp += dov[x] * vf[j * d + x];
          const double ds = pr[j] * (dp - dl);
          const int64_t kb = (kr[j] * hk + kvh) * d;
          h.dkv_zero[kr[j] * hk + kvh] = 0;
          for (int x = 0; x < d; ++x) {
            h.dq[base + x] += scale * ds * kf[j * d + x];
            h.dk[kb + x] += scale * ds * qv[x];
            h.dv[kb + x] += pr[j] * dov[x];
          }
        }
      }
  });
  return h;
}

// Device copy of a backward case.
struct BwdDevice {
  DeviceBuffer<uint16_t> q, k, v, o, dout, dq, dk, dv;
  DeviceBuffer<float> lse, delta, dq_accum;
  DeviceBuffer<SequenceDesc> seqs;
  TileLists q_tile_lists, kv_tile_lists;
  AttentionParams base{};
  int d;
  BwdDevice(const Case& c)
      : q(static_cast<size_t>(c.q_rows) * c.heads_q * c.d),
        k(static_cast<size_t>(c.kv_rows) * c.heads_kv * c.d),
        v(k.count),
        o(q.count),
        dout(q.count),
        dq(q.count),
        dk(k.count),
        dv(k.count),
        lse(static_cast<size_t>(c.heads_q) * c.q_rows),
        delta(lse.count),
        dq_accum(q.count),
        seqs(c.seqs.size()),
        q_tile_lists(q_tiles(c, 64), q_tiles(c, 128)),
        kv_tile_lists(kv_tiles(c, 64), kv_tiles(c, 128)),
        d(c.d) {
    seqs.upload(c.seqs);
    base = case_params(c, seqs.ptr, q.ptr, k.ptr, v.ptr, o.ptr, lse.ptr);
    base.dout = dout.ptr;
    base.dq = dq.ptr;
    base.dk = dk.ptr;
    base.dv = dv.ptr;
    base.dq_accum = dq_accum.ptr;
    base.delta = delta.ptr;
  }
  AttentionParams params(int tile_rows) const {
    AttentionParams p = base;
    p.q_tiles = q_tile_lists.tiles(tile_rows);
    p.q_tile_count = q_tile_lists.count(tile_rows);
    p.kv_tiles = kv_tile_lists.tiles(tile_rows);
    p.kv_tile_count = kv_tile_lists.count(tile_rows);
    return p;
  }
  void poison() { fill_nan(dq, dk, dv, delta, dq_accum); }
};

struct BwdVariant {
  std::string name;
  int d;
  bool fp16;
  bool atomic;
  bool mma_sync = false;
  int tile_rows = 128;
  std::function<std::string(const AttentionParams&, sm90::Watchdog)> launch;
};

template <class T, int D, bool ATOMIC, sm90::DqSplit SPLIT = sm90::DqSplit::columns, bool OVERLAP = false,
          bool TMA_DQ = false>
BwdVariant sm90_variant(const std::string& name) {
  return {.name = name, .d = D, .fp16 = std::is_same_v<T, __half>, .atomic = ATOMIC,
          .launch = [](const AttentionParams& p, sm90::Watchdog dog) {
            return sm90::launch_backward_sm90<T, D, ATOMIC, SPLIT, OVERLAP, TMA_DQ>(p, dog, 0);
          }};
}

#ifdef HF_HAVE_MMA_SYNC_FORWARD
// The mma.sync backward (gpu/kernels/mma_sync/attention_kernels.cuh) launched as gpu/kernels/mma_sync/attention_launch.cuh does (64-row tiles).
template <class T, int D, bool ATOMIC>
BwdVariant mma_sync_variant_bwd(const std::string& name) {
  auto launch = [](const AttentionParams& p, sm90::Watchdog) -> std::string {
    namespace dt = cpgold::gpu::detail;
    using Cfg = dt::BackwardConfig<T, D, D>;
    auto err = [](const char* w) -> std::string {
      const cudaError_t e = cudaGetLastError();
      return e == cudaSuccess ? std::string() : std::string(w) + ": " + cudaGetErrorString(e);
    };
    if (p.q_tile_count > 0)
      cpgold::gpu::attention_backward_delta_kernel<T, D><<<dim3(p.q_tile_count, p.heads_q), 128>>>(p);
    if (auto e = err("delta"); !e.empty()) return e;
    auto dkdv = dt::attention_backward_dkdv_kernel<T, D, D, ATOMIC, 1>;
    if (cudaError_t e = cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
        e != cudaSuccess)
      return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
    const int64_t elems = p.q_rows * p.heads_q * D;
    if (ATOMIC && elems > 0)
      if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, elems * 4); e != cudaSuccess) return "memset";
    if (p.kv_tile_count > 0) dkdv<<<dim3(p.kv_tile_count, p.heads_kv), Cfg::kThreads, Cfg::kSmemBytes>>>(p);
    if (auto e = err("dkdv"); !e.empty()) return e;
    if (ATOMIC) {
      if (elems > 0 && p.q_tile_count > 0)
        cpgold::gpu::attention_backward_finish_dq_kernel<T>
            <<<dim3(p.q_tile_count, cpgold::gpu::finish_dq_grid_y(p.heads_q * D, 64)), 128>>>(p, p.heads_q * D);
    } else {
      using Dq = dt::DqConfig<T, D, D>;
      auto dqk = dt::attention_backward_dq_kernel<T, D, D>;
      if (cudaError_t e = cudaFuncSetAttribute(dqk, cudaFuncAttributeMaxDynamicSharedMemorySize, Dq::kSmemBytes);
          e != cudaSuccess)
        return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
      if (p.q_tile_count > 0) dqk<<<dim3(p.q_tile_count, p.heads_q), Dq::kThreads, Dq::kSmemBytes>>>(p);
    }
    return err("dq");
  };
  return {.name = name, .d = D, .fp16 = std::is_same_v<T, __half>, .atomic = ATOMIC, .mma_sync = true, .tile_rows = 64,
          .launch = launch};
}
#endif

std::vector<BwdVariant> all_bwd_variants() {
  std::vector<BwdVariant> v;
  using sm90::DqSplit;
  // The configurations attention_backward runs (gpu/kernels/sm90/attention_sm90_backward_launch.cuh): atomic mode d 128
  // with the dQ columns split, the overlapped softmax and dQ by TMA reduce-add; d 64 with the keys split and TMA.
  v.push_back(sm90_variant<bf16, 128, true, DqSplit::columns, true, true>("sm90-bwd-atomic"));
  v.push_back(sm90_variant<bf16, 128, false>("sm90-bwd-deterministic"));
  v.push_back(sm90_variant<__half, 128, true, DqSplit::columns, true, true>("sm90-bwd-atomic-fp16"));
  v.push_back(sm90_variant<__half, 128, false>("sm90-bwd-deterministic-fp16"));
  v.push_back(sm90_variant<bf16, 64, true, DqSplit::keys, false, true>("sm90-bwd-atomic-d64"));
  v.push_back(sm90_variant<bf16, 64, false>("sm90-bwd-deterministic-d64"));
  // The schedules measured against them (run B2 of lab/records/gpu-results.md): float2 atomics from every consumer thread
  // (the v1 dQ write), without the overlap, d 64's columns split with warpgroup 1's copy discarded (v1) or with
  // warpgroup 0 alone.
  v.push_back(sm90_variant<bf16, 128, true>("sm90-bwd-atomic-v1"));
  v.push_back(sm90_variant<bf16, 128, true, DqSplit::columns, false, true>("sm90-bwd-atomic-tma-no-ov"));
  v.push_back(sm90_variant<bf16, 64, true>("sm90-bwd-atomic-d64-v1"));
  v.push_back(sm90_variant<bf16, 64, true, DqSplit::first_warpgroup, false>("sm90-bwd-atomic-d64-first"));
  v.push_back(sm90_variant<bf16, 64, true, DqSplit::keys, true, true>("sm90-bwd-atomic-d64-keys-tma-ov"));
#ifdef HF_HAVE_MMA_SYNC_FORWARD
  v.push_back(mma_sync_variant_bwd<bf16, 128, true>("mma-sync-bwd-atomic"));
  v.push_back(mma_sync_variant_bwd<bf16, 128, false>("mma-sync-bwd-deterministic"));
  v.push_back(mma_sync_variant_bwd<bf16, 64, true>("mma-sync-bwd-atomic-d64"));
#else
  record("setup", "mma-sync-bwd", false, "gpu/kernels/mma_sync/attention_kernels.cuh not found: no baseline to time against");
#endif
  return v;
}

std::string run_bwd_once(const BwdVariant& v, BwdDevice& dd, DeviceWatchdog& dog, const AttentionParams& p) {
  dd.poison();
  if (std::string e = v.launch(p, dog.arm()); !e.empty()) return e;
  sync_or_die();
  return dog.report();
}

struct TensorCheck {
  bool pass = true;
  std::string detail;
};

// One output tensor [rows][heads][d] against the reference: relative Frobenius error and max abs error over the valid
// rows; every element of an invalid row exactly +0 bits; every row without a visible pair exactly 0; no non-finite.
TensorCheck check_tensor(const char* what, const Case& c, const std::vector<uint16_t>& got,
                         const std::vector<double>& ref, const std::vector<uint8_t>& valid,
                         const std::vector<uint8_t>& zero_rows, int heads) {
  TensorCheck t;
  double e2 = 0, r2 = 0, max_abs = 0, max_ref = 0;
  int64_t nonfinite = 0, pad_bad = 0, zero_bad = 0;
  const int d = c.d;
  const int64_t rows = static_cast<int64_t>(valid.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const int64_t base = (r * heads + h) * d;
      if (!valid[r]) {
        for (int x = 0; x < d; ++x) pad_bad += got[base + x] != 0;
        continue;
      }
      const bool must_zero = zero_rows[r * heads + h] != 0;
      for (int x = 0; x < d; ++x) {
        const float g = from_bits(got[base + x], c.fp16);
        if (!std::isfinite(g)) {
          ++nonfinite;
          continue;
        }
        if (must_zero && g != 0.f) ++zero_bad;
        const double e = g - ref[base + x];
        e2 += e * e;
        r2 += ref[base + x] * ref[base + x];
        max_abs = std::max(max_abs, std::fabs(e));
        max_ref = std::max(max_ref, std::fabs(ref[base + x]));
      }
    }
  const double rel = std::sqrt(e2 / std::max(r2, 1e-300));
  const double rel_tol = c.fp16 ? 6e-3 : 2.5e-2;
  const double abs_tol = (c.fp16 ? 2e-2 : 8e-2) * std::max(max_ref, 1e-6);
  t.pass = nonfinite == 0 && pad_bad == 0 && zero_bad == 0 && rel <= rel_tol && max_abs <= abs_tol;
  t.detail = std::string(what) + " rel " + fmt("%.2e", rel) + " max abs " + fmt("%.2e", max_abs) + " (max |ref| " +
             fmt("%.2e", max_ref) + ")" + (nonfinite ? ", non-finite " + std::to_string(nonfinite) : "") +
             (pad_bad ? ", pad not 0: " + std::to_string(pad_bad) : "") +
             (zero_bad ? ", no-pair rows not 0: " + std::to_string(zero_bad) : "");
  return t;
}

// Summing form (deterministic mode): a float32 sum preloaded with random values and a row map that reverses the
// rows; after the summing run, sum[map[r]] must equal old[map[r]] + float(plain output[r]) bit for bit (assign = 0),
// and a second run with assign = 1 and a result tensor must write dtype(0 + value) = the plain output to the result
// at map[r] and leave the sum alone.
void check_summing(const BwdVariant& v, const Case& c, BwdDevice& dd, DeviceWatchdog& dog,
                   const std::vector<uint16_t>& dq1, const std::vector<uint16_t>& dk1,
                   const std::vector<uint16_t>& dv1, const std::string& test) {
  std::mt19937_64 rng(c.seed + 77);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t nq = dd.q.count, nk = dd.k.count;
  std::vector<float> old_q(nq), old_k(nk), old_v(nk);
  for (auto& x : old_q) x = nd(rng);
  for (auto& x : old_k) x = nd(rng);
  for (auto& x : old_v) x = nd(rng);
  std::vector<int64_t> qmap(c.q_rows), kmap(c.kv_rows);
  for (int64_t r = 0; r < c.q_rows; ++r) qmap[r] = c.q_rows - 1 - r;
  for (int64_t r = 0; r < c.kv_rows; ++r) kmap[r] = c.kv_rows - 1 - r;
  DeviceBuffer<float> sq(nq), sk(nk), sv(nk);
  DeviceBuffer<int64_t> mq(qmap.size()), mk(kmap.size());
  sq.upload(old_q), sk.upload(old_k), sv.upload(old_v), mq.upload(qmap), mk.upload(kmap);
  AttentionParams p = dd.params(v.tile_rows);
  p.dq_sum = sq.ptr, p.dk_sum = sk.ptr, p.dv_sum = sv.ptr;
  p.q_sum_rows = mq.ptr, p.kv_sum_rows = mk.ptr;
  if (std::string e = run_bwd_once(v, dd, dog, p); !e.empty()) {
    record("backward", test + " summing", false, e);
    return;
  }
  const std::vector<float> gq = sq.download(), gk = sk.download(), gv = sv.download();
  int64_t bad = 0;
  const int d = c.d;
  auto cmp = [&](const std::vector<float>& got, const std::vector<float>& old, const std::vector<uint16_t>& plain,
                 const std::vector<int64_t>& map, int heads) {
    const int64_t w = static_cast<int64_t>(heads) * d;
    for (size_t r = 0; r < map.size(); ++r)
      for (int64_t x = 0; x < w; ++x) {
        const float want = old[map[r] * w + x] + from_bits(plain[r * w + x], c.fp16);
        bad += std::memcmp(&want, &got[map[r] * w + x], 4) != 0;
      }
  };
  cmp(gq, old_q, dq1, qmap, c.heads_q);
  cmp(gk, old_k, dk1, kmap, c.heads_kv);
  cmp(gv, old_v, dv1, kmap, c.heads_kv);
  // assign = 1 with result tensors: result[map[r]] = dtype(0 + value) = plain[r]; the sums untouched.
  DeviceBuffer<uint16_t> rq(nq), rk(nk), rv(nk);
  CK(cudaMemset(rq.ptr, 0xff, nq * 2));
  CK(cudaMemset(rk.ptr, 0xff, nk * 2));
  CK(cudaMemset(rv.ptr, 0xff, nk * 2));
  p.dq_sum_assign = p.dk_sum_assign = p.dv_sum_assign = 1;
  p.dq_result = rq.ptr, p.dk_result = rk.ptr, p.dv_result = rv.ptr;
  int64_t bad2 = 0, touched = 0;
  if (std::string e = run_bwd_once(v, dd, dog, p); !e.empty()) {
    record("backward", test + " summing", false, e);
    return;
  }
  const std::vector<uint16_t> hq = rq.download(), hk = rk.download(), hv = rv.download();
  auto cmp2 = [&](const std::vector<uint16_t>& got, const std::vector<uint16_t>& plain, const std::vector<int64_t>& map,
                  int heads) {
    const int64_t w = static_cast<int64_t>(heads) * d;
    for (size_t r = 0; r < map.size(); ++r)
      for (int64_t x = 0; x < w; ++x) {
        // dtype(0 + float(v)) == v, except that -0 becomes +0.
        const uint16_t want = from_bits(plain[r * w + x], c.fp16) == 0.f ? 0 : plain[r * w + x];
        bad2 += got[map[r] * w + x] != want;
      }
  };
  cmp2(hq, dq1, qmap, c.heads_q);
  cmp2(hk, dk1, kmap, c.heads_kv);
  cmp2(hv, dv1, kmap, c.heads_kv);
  touched += sq.download() != gq;
  touched += sk.download() != gk;
  touched += sv.download() != gv;
  record("backward", test + " summing", bad == 0 && bad2 == 0 && touched == 0,
         "sum != old + float(plain): " + std::to_string(bad) + " elements; result != plain: " + std::to_string(bad2) +
             "; sums written with a result tensor: " + std::to_string(touched));
}

void run_backward_tests(const std::vector<BwdVariant>& variants) {
  std::printf("\n==== backward ====\n");
  DeviceWatchdog dog;
  for (const Case& c : backward_cases()) {
    const BwdHost h = make_reference(c, make_bwd_host);
    BwdDevice dd(c);
    dd.q.upload(h.q), dd.k.upload(h.k), dd.v.upload(h.v), dd.o.upload(h.o), dd.dout.upload(h.dout);
    dd.lse.upload(h.lse);
    for (const BwdVariant& v : variants) {
      const std::string test = begin_test(v, c);
      if (test.empty()) continue;
      const AttentionParams p = dd.params(v.tile_rows);
      if (std::string e = run_bwd_once(v, dd, dog, p); !e.empty()) {
        record("backward", test, false, e);
        continue;
      }
      const std::vector<uint16_t> dq1 = dd.dq.download(), dk1 = dd.dk.download(), dv1 = dd.dv.download();
      const TensorCheck a = check_tensor("dQ", c, dq1, h.dq, h.q_valid, h.dq_zero, c.heads_q);
      const TensorCheck b = check_tensor("dK", c, dk1, h.dk, h.kv_valid, h.dkv_zero, c.heads_kv);
      const TensorCheck e = check_tensor("dV", c, dv1, h.dv, h.kv_valid, h.dkv_zero, c.heads_kv);
      if (std::string err = run_bwd_once(v, dd, dog, p); !err.empty()) {
        record("backward", test, false, "rerun: " + err);
        continue;
      }
      const bool same_kv = dd.dk.download() == dk1 && dd.dv.download() == dv1;
      const bool same_q = dd.dq.download() == dq1;
      const bool rerun_ok = same_kv && (v.atomic || same_q);
      record("backward", test, a.pass && b.pass && e.pass && rerun_ok,
             a.detail + "; " + b.detail + "; " + e.detail + "; rerun dK/dV " + (same_kv ? "identical" : "DIFFERS") +
                 ", dQ " + (same_q ? "identical" : (v.atomic ? "differs (atomic order)" : "DIFFERS")));
      if (!v.atomic && !v.mma_sync) check_summing(v, c, dd, dog, dq1, dk1, dv1, test);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Timing.

// Relative Frobenius difference and max abs difference of two dtype tensors (host side).
std::string host_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, bool& ok) {
  double e2 = 0, r2 = 0, mx = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) {
      ++bad;
      continue;
    }
    e2 += (x - y) * (x - y);
    r2 += y * y;
    mx = std::max(mx, std::fabs(x - y));
  }
  const double rel = std::sqrt(e2 / std::max(r2, 1e-300));
  ok = bad == 0 && rel <= 2.5e-2;
  return fmt("%.2e", rel) + (bad ? " non-finite " + std::to_string(bad) : "");
}

void run_timing(const std::vector<BwdVariant>& variants, int reps) {
  std::printf("\n==== timing ====\n");
  char line[512];
  std::snprintf(line, sizeof line, "%-7s %-6s %-28s %9s %9s %8s  %s", "mask", "tokens", "kernel", "ms", "TFLOP/s",
                "vs mma", "rel diff to mma-sync-bwd-atomic (dQ / dK / dV)");
  g_timing_rows.push_back(line);
  for (int d : {128, 64})
  for (int64_t total : {16384, 65536})
    for (bool causal : {true, false}) {
      const int heads = 2048 / d;  // bench/gpu/varlen_batches.md
      double pairs = 0;
      const Case c = timing_case(
          std::string(causal ? "causal" : "full") + "-d" + std::to_string(d) + "-" + std::to_string(total), heads, d,
          total, causal, pairs);
      const double flops = 2.5 * 4.0 * d * pairs * heads;
      g_current = "timing-setup";
      BwdDevice dd(c);
      fill_normal<<<1024, 256>>>(dd.q.ptr, static_cast<int64_t>(dd.q.count), 11 + total + causal, false);
      fill_normal<<<1024, 256>>>(dd.k.ptr, static_cast<int64_t>(dd.k.count), 22 + total + causal, false);
      fill_normal<<<1024, 256>>>(dd.v.ptr, static_cast<int64_t>(dd.v.count), 33 + total + causal, false);
      fill_normal<<<1024, 256>>>(dd.dout.ptr, static_cast<int64_t>(dd.dout.count), 44 + total + causal, false);
      CK(cudaGetLastError());
      {
        AttentionParams pf = dd.params(128);
        sm90::ForwardTensorMaps maps;
        std::memset(&maps, 0, sizeof maps);
        auto forward = [&](auto cfg) {
          using FwdCfg = decltype(cfg);
          if (std::string e = sm90::encode_forward_maps<FwdCfg>(pf, maps); !e.empty()) fatal(e, 4);
          if (std::string e = sm90::launch_forward_sm90<FwdCfg>(pf, maps, sm90::Watchdog{}, 0); !e.empty())
            fatal(e, 4);
        };
        if (d == 128)
          forward(sm90::ForwardSm90Config<bf16, 128, 128, 2, 128, sm90::Loader::tma>{});
        else
          forward(sm90::ForwardSm90Config<bf16, 64, 64, 2, 128, sm90::Loader::tma>{});
      }
      sync_or_die();
      std::vector<uint16_t> base_q, base_k, base_v;
      double base_ms = 0;
      DeviceWatchdog dog;
      for (const BwdVariant* vp : timing_order(variants, d)) {
        const BwdVariant& v = *vp;
        if (!begin_timing(v, c)) continue;
        const AttentionParams p = dd.params(v.tile_rows);
        if (std::string e = run_bwd_once(v, dd, dog, p); !e.empty()) {
          record("timing", v.name + " / " + c.name, false, e);
          continue;
        }
        std::string check = "-";
        if (base_q.empty() && v.mma_sync && v.atomic) {
          base_q = dd.dq.download(), base_k = dd.dk.download(), base_v = dd.dv.download();
        } else if (!base_q.empty()) {
          bool o1, o2, o3;
          check = host_diff(dd.dq.download(), base_q, o1) + " / " + host_diff(dd.dk.download(), base_k, o2) + " / " +
                  host_diff(dd.dv.download(), base_v, o3);
          record("timing", v.name + " / " + c.name + " agrees with mma-sync-bwd-atomic", o1 && o2 && o3, check);
        }
        const std::vector<float> ms = time_launches(3, reps, [&] { return v.launch(p, sm90::Watchdog{}); });
        const double med = ms[reps / 2];
        if (v.mma_sync && v.atomic) base_ms = med;
        const double tflops = flops / (med * 1e-3) / 1e12;
        std::snprintf(line, sizeof line, "%-7s %-6lld %-28s %9.3f %9.1f %8s  %s (min %.3f, max %.3f ms)",
                      causal ? "causal" : "full", static_cast<long long>(total), v.name.c_str(), med, tflops,
                      base_ms > 0 ? fmt("%.2fx", base_ms / med).c_str() : "-", check.c_str(), ms.front(), ms.back());
        add_timing_row(line);
      }
    }
}

}  // namespace hf

int main(int argc, char** argv) {
  using namespace hf;
  Options options{20, 5, 20261202};  // --reps 20 (at least 5), --seed 20261202
  if (const std::optional<int> code = read_options(argc, argv, "hopper_backward", options,
                                                   [](const std::string&) { return std::optional<int>(); }))
    return *code;
  if (!device_is_sm90(false)) return 2;
  return run_stages(options, all_bwd_variants, run_backward_tests, run_timing);
}
