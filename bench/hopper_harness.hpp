#pragma once
// Host harness shared by the self-checking programs bench/hopper_forward.cu and bench/hopper_backward.cu (one
// translation unit each, built by bench/hopper_forward.sh and hopper_backward.sh): RESULT lines and the summary,
// CUDA error checks and the hang limit (exit 4 and 5, "FAULTED <name>" for the scripts' reruns), bf16/fp16 bits,
// device buffers, the mbarrier watchdog, random data, the unit tests' product check, the varlen test cases with their
// tile lists and kernel parameters, and the stages both programs run (options, device check, reference and test
// lines, the timing cases, order and timed launches). Include it after the sm90 kernel header the program tests.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/kernels/attention/kernel_params.hpp"
#include "gpu/kernels/sm90/ptx_sm90.cuh"

namespace hf {

using cpgold::gpu::AttentionParams;
using cpgold::gpu::RowTile;
using cpgold::gpu::SequenceDesc;
namespace sm90 = cpgold::gpu::sm90;
using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------------------------------
// Reporting.

struct Result {
  std::string stage, name;
  bool pass;
  std::string detail;
};
std::vector<Result> g_results;
std::vector<std::string> g_timing_rows;
std::vector<std::string> g_exclude;
std::string g_current = "setup";  // what runs now, named on a fatal error

bool excluded(const std::string& name) {
  return std::find(g_exclude.begin(), g_exclude.end(), name) != g_exclude.end();
}

void record(const std::string& stage, const std::string& name, bool pass, const std::string& detail) {
  g_results.push_back({stage, name, pass, detail});
  std::printf("RESULT|%s|%s|%s|%s\n", stage.c_str(), name.c_str(), pass ? "PASS" : "FAIL", detail.c_str());
  std::fflush(stdout);
}

bool passed(const std::string& stage, const std::string& name) {
  for (const Result& r : g_results)
    if (r.stage == stage && r.name == name) return r.pass;
  return false;
}

void print_summary() {
  std::printf("\n==== summary ====\n");
  int pass = 0, fail = 0;
  for (const Result& r : g_results) {
    // Passing lines shortened (the full ones are the RESULT lines above); failing ones in full.
    const std::string detail = r.pass && r.detail.size() > 96 ? r.detail.substr(0, 93) + "..." : r.detail;
    std::printf("%-7s %-4s %-52s %s\n", r.stage.c_str(), r.pass ? "PASS" : "FAIL", r.name.c_str(), detail.c_str());
    (r.pass ? pass : fail)++;
  }
  if (!g_timing_rows.empty()) {
    std::printf("\n==== timing ====\n");
    for (const std::string& s : g_timing_rows) std::printf("%s\n", s.c_str());
  }
  std::printf("\n%d passed, %d failed\n", pass, fail);
  std::fflush(stdout);
}

[[noreturn]] void fatal(const std::string& what, int code) {
  std::printf("FATAL while running %s: %s\n", g_current.c_str(), what.c_str());
  std::printf("FAULTED %s\n", g_current.c_str());
  print_summary();
  std::exit(code);
}

void check(cudaError_t e, const char* call, int line) {
  if (e != cudaSuccess) fatal(std::string(call) + " (line " + std::to_string(line) + "): " + cudaGetErrorString(e), 4);
}
#define CK(call) ::hf::check((call), #call, __LINE__)

// Adds the names of a comma-separated --exclude list.
void add_excludes(const std::string& list) {
  for (size_t p = 0; p <= list.size();) {
    const size_t q = list.find(',', p);
    const std::string name = list.substr(p, q == std::string::npos ? std::string::npos : q - p);
    if (!name.empty()) g_exclude.push_back(name);
    if (q == std::string::npos) break;
    p = q + 1;
  }
}

// The "excluded:" line at the start of a run with --exclude.
void print_excluded() {
  if (!g_exclude.empty()) {
    std::printf("excluded:");
    for (const auto& e : g_exclude) std::printf(" %s", e.c_str());
    std::printf("\n");
  }
}

bool any_failed() {
  for (const Result& r : g_results)
    if (!r.pass) return true;
  return false;
}

// Waits for all work on the device with a wall-clock limit: a kernel that never ends (a deadlock the mbarrier
// watchdog cannot see) is reported by name instead of hanging the run.
void sync_or_die(double seconds = 120.0) {
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaEventRecord(ev, 0));
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) check(e, "cudaEventQuery", __LINE__);
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      std::printf("HANG: the device did not finish within %.0f s\n", seconds);
      std::printf("FAULTED %s\n", g_current.c_str());
      print_summary();
      std::fflush(stdout);
      std::_Exit(5);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  CK(cudaEventDestroy(ev));
  CK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------------------------
// Host element types.

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_half(float f) {
  const __half h = __float2half_rn(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float half_to_float(uint16_t b) {
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}
uint16_t to_bits(float f, bool fp16) { return fp16 ? float_to_half(f) : float_to_bf16(f); }
float from_bits(uint16_t b, bool fp16) { return fp16 ? half_to_float(b) : bf16_to_float(b); }
uint16_t nan_bits(bool fp16) { return fp16 ? 0x7e00 : 0x7fc0; }

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (n > 0) CK(cudaMalloc(&ptr, n * sizeof(T)));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  void reset(size_t n) {
    if (ptr != nullptr) CK(cudaFree(ptr));
    ptr = nullptr;
    count = n;
    if (n > 0) CK(cudaMalloc(&ptr, n * sizeof(T)));
  }
  void upload(const std::vector<T>& h) {
    if (!h.empty()) CK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(count);
    if (count > 0) CK(cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Fills device buffers with 0xff bytes: NaN in bf16, fp16 and float32 alike (outputs poisoned before a run).
template <class... Buffers>
void fill_nan(Buffers&... buffers) {
  (CK(cudaMemset(buffers.ptr, 0xff, buffers.count * sizeof(*buffers.ptr))), ...);
}

// What the kernels launched last wrote to `out`, once they have finished (a launch error or a hang is fatal).
template <class T>
std::vector<T> download_after_launch(const DeviceBuffer<T>& out) {
  CK(cudaGetLastError());
  sync_or_die();
  return out.download();
}

// The name of the barrier a watchdog code stands for ("?" for an unknown code); each program defines it for the
// codes its kernels use.
const char* watchdog_wait_name(int code);

// Watchdog flag of the kernels' mbarrier waits (gpu/kernels/sm90/ptx_sm90.cuh).
struct DeviceWatchdog {
  DeviceBuffer<int> flag{8};
  sm90::Watchdog arm() {
    CK(cudaMemset(flag.ptr, 0, 8 * sizeof(int)));
    return sm90::Watchdog{flag.ptr};
  }
  // "" or a description of the wait that timed out.
  std::string report() const {
    const std::vector<int> f = flag.download();
    if (f[0] == 0) return {};
    return std::string("watchdog: a wait on '") + watchdog_wait_name(f[0]) + "' timed out (block " +
           std::to_string(f[1]) + "," + std::to_string(f[2]) + ", thread " + std::to_string(f[3]) + ", iteration " +
           std::to_string(f[4]) + ")";
  }
};

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// ---------------------------------------------------------------------------------------------------------------
// Random data.

std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(nd(rng));
  return v;
}

template <class Kernel>
void set_smem(Kernel k, int bytes) {
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// The max abs error of a unit test's product d (64 x cols, row-major) against ref(m, n), the CPU product (a
// non-finite element counts as 1e30); max_ref: the max |ref|; first_bad: the first element off by more than 1e-3
// (m * cols + n; -1: none).
template <class Ref>
double product_error(const std::vector<float>& d, int cols, Ref ref, double& max_ref, int& first_bad) {
  double worst = 0;
  max_ref = 0;
  first_bad = -1;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < cols; ++n) {
      const double r = ref(m, n);
      const double err = std::isfinite(d[m * cols + n]) ? std::fabs(d[m * cols + n] - r) : 1e30;
      if (err > 1e-3 && first_bad < 0) first_bad = m * cols + n;
      worst = std::max(worst, err);
      max_ref = std::max(max_ref, std::fabs(r));
    }
  return worst;
}

// ---------------------------------------------------------------------------------------------------------------
// Test cases: varlen THD batches and their tile lists.

struct Case {
  std::string name;
  bool fp16 = false;
  int d = 128;
  int heads_q = 2, heads_kv = 2;
  int wl = -1, wr = -1;  // window (wr = 0, wl = -1: causal)
  std::vector<SequenceDesc> seqs;
  int64_t q_rows = 0, kv_rows = 0;
  uint64_t seed = 1;
};

SequenceDesc one_segment(int64_t q_row, int q_len, int64_t kv_row, int kv_len) {
  SequenceDesc s{};
  s.q_first_row[0] = q_row;
  s.q_count[0] = q_len;
  s.kv_first_row[0] = kv_row;
  s.kv_count[0] = kv_len;
  s.length_q = q_len;
  s.length_kv = kv_len;
  return s;
}

// Sequences (q length, kv length) laid out one after the other with `pad` rows after each (none after the last).
Case make_case(std::string name, const std::vector<std::pair<int, int>>& lens, int pad, bool causal) {
  Case c;
  c.name = std::move(name);
  if (causal) c.wr = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    c.seqs.push_back(one_segment(c.q_rows, lens[i].first, c.kv_rows, lens[i].second));
    const int gap = i + 1 < lens.size() ? pad : 0;
    c.q_rows += lens[i].first + gap;
    c.kv_rows += lens[i].second + gap;
  }
  return c;
}

// The varlen cases both programs check first: mixed lengths (full and causal), L_q != L_kv, GQA with a window, a
// two-sided band, and a context-parallel rank's two segments. `longest` and `last` are two of the mixed lengths (the
// last ends at the tensor end), `equal` the one L_q = L_kv sequence of length above 129 in the L_q != L_kv case.
std::vector<Case> shared_cases(int longest, int last, int equal) {
  std::vector<Case> cases;
  const std::vector<int> mixed = {1, 17, 100, 128, 129, longest, 0, last};
  std::vector<std::pair<int, int>> same;
  for (int l : mixed) same.push_back({l, l});
  cases.push_back(make_case("full-mixed", same, 5, false));
  cases.push_back(make_case("causal-mixed", same, 5, true));
  cases.push_back(make_case("causal-q-ne-kv", {{100, 40}, {17, 300}, {50, 0}, {129, 129}, {equal, equal}, {3, 700}}, 7,
                            true));
  {
    Case c = make_case("gqa4-2-window-96-0", {{300, 300}, {777, 777}, {64, 64}, {1, 1}}, 3, false);
    c.heads_q = 4;
    c.wl = 96;
    c.wr = 0;
    cases.push_back(c);
  }
  {
    Case c = make_case("band-40-24-q-ne-kv", {{300, 500}, {200, 130}, {129, 257}}, 2, false);
    c.wl = 40;
    c.wr = 24;
    cases.push_back(c);
  }
  {
    // Two segments per sequence as a context-parallel rank holds them (length 1000, 4 chunks of 250: chunks 0 and 3
    // of Q and KV, causal), and a sequence whose Q is chunk 2 alone against all 1000 keys in two KV segments.
    Case c;
    c.name = "causal-two-segments";
    c.wr = 0;
    SequenceDesc a{};
    a.q_first_row[0] = 0, a.q_count[0] = 250, a.q_position[0] = 0;
    a.q_first_row[1] = 250, a.q_count[1] = 250, a.q_position[1] = 750;
    a.kv_first_row[0] = 0, a.kv_count[0] = 250, a.kv_position[0] = 0;
    a.kv_first_row[1] = 250, a.kv_count[1] = 250, a.kv_position[1] = 750;
    a.length_q = a.length_kv = 1000;
    SequenceDesc b{};
    b.q_first_row[0] = 503, b.q_count[0] = 250, b.q_position[0] = 500;
    b.kv_first_row[0] = 503, b.kv_count[0] = 600, b.kv_position[0] = 0;
    b.kv_first_row[1] = 1110, b.kv_count[1] = 400, b.kv_position[1] = 600;
    b.length_q = b.length_kv = 1000;
    c.seqs = {a, b};
    c.q_rows = 753 + 4;
    c.kv_rows = 1510;
    cases.push_back(c);
  }
  return cases;
}

std::vector<Case> forward_cases() {
  std::vector<Case> cases = shared_cases(4096, 1000, 1000);
  {
    std::vector<std::pair<int, int>> l64;
    for (int l : {1, 17, 100, 128, 129, 2048, 0, 1000}) l64.push_back({l, l});
    Case c = make_case("d64-causal-mixed", l64, 5, true);
    c.d = 64;
    cases.push_back(c);
  }
  {
    Case c = make_case("fp16-full", {{1, 1}, {129, 129}, {1000, 1000}, {2048, 2048}}, 3, false);
    c.fp16 = true;
    cases.push_back(c);
  }
  for (size_t i = 0; i < cases.size(); ++i) cases[i].seed = 1000 + i;
  return cases;
}

// Row tiles of `rows` rows over the Q segments, then pad tiles over the rows no segment covers.
std::vector<RowTile> q_tiles(const Case& c, int rows) {
  std::vector<RowTile> tiles;
  std::vector<uint8_t> covered(c.q_rows, 0);
  for (size_t s = 0; s < c.seqs.size(); ++s)
    for (int g = 0; g < 2; ++g) {
      const SequenceDesc& q = c.seqs[s];
      for (int r0 = 0; r0 < q.q_count[g]; r0 += rows) {
        tiles.push_back({q.q_first_row[g] + r0, std::min(rows, q.q_count[g] - r0), q.q_position[g] + r0,
                         static_cast<int32_t>(s), g});
      }
      for (int r = 0; r < q.q_count[g]; ++r) covered[q.q_first_row[g] + r] = 1;
    }
  for (int64_t r = 0; r < c.q_rows;) {
    if (covered[r]) {
      ++r;
      continue;
    }
    int64_t e = r;
    while (e < c.q_rows && !covered[e] && e - r < rows) ++e;
    tiles.push_back({r, static_cast<int32_t>(e - r), 0, -1, 0});
    r = e;
  }
  return tiles;
}

// A case's tile list of 64-row and of 128-row tiles on the device (the kernels' two tile heights).
struct TileLists {
  DeviceBuffer<RowTile> tiles64, tiles128;
  int count64 = 0, count128 = 0;
  TileLists(const std::vector<RowTile>& t64, const std::vector<RowTile>& t128)
      : tiles64(t64.size()), tiles128(t128.size()), count64(static_cast<int>(t64.size())),
        count128(static_cast<int>(t128.size())) {
    tiles64.upload(t64);
    tiles128.upload(t128);
  }
  const RowTile* tiles(int rows) const { return rows == 64 ? tiles64.ptr : tiles128.ptr; }
  int count(int rows) const { return rows == 64 ? count64 : count128; }
};

// The kernel parameters of case `c` with its sequences, Q, K, V, O and LSE at these device pointers: the tensors, rows,
// heads, window and softmax scale (the backward's tensors and the tile lists are the program's).
AttentionParams case_params(const Case& c, const SequenceDesc* sequences, const void* q, const void* k, const void* v,
                            void* o, float* lse) {
  AttentionParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.q_rows = c.q_rows;
  p.kv_rows = c.kv_rows;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.group = c.heads_q / c.heads_kv;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  p.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.sequences = sequences;
  return p;
}

bool visible(const Case& c, int64_t delta, int64_t qp, int64_t kp) {
  return (c.wl < 0 || kp >= qp + delta - c.wl) && (c.wr < 0 || kp <= qp + delta + c.wr);
}

template <class F>
void parallel_for(int64_t n, F f) {
  const int threads = std::max(1u, std::min(64u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int64_t i; (i = next.fetch_add(1)) < n;) f(i);
    });
  for (auto& t : pool) t.join();
}

// ---------------------------------------------------------------------------------------------------------------
// The stages both programs run.

// The reference data of case `c` (make(c), the float64 CPU reference), made while g_current names the reference, and
// the case's line with the time it took.
template <class Make>
auto make_reference(const Case& c, Make make) {
  g_current = "reference";
  const auto t0 = std::chrono::steady_clock::now();
  auto host = make(c);
  std::printf("case %s: %lld q rows, %lld kv rows, %d/%d heads, d %d, %s, window (%d, %d); reference %.1f s\n",
              c.name.c_str(), static_cast<long long>(c.q_rows), static_cast<long long>(c.kv_rows), c.heads_q,
              c.heads_kv, c.d, c.fp16 ? "fp16" : "bf16", c.wl, c.wr,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::fflush(stdout);
  return host;
}

// The test of variant `v` on case `c`, "<variant> / <case>", named as what runs now and announced; "" where the
// variant does not run on the case (another head dim or element type) or is excluded.
template <class Variant>
std::string begin_test(const Variant& v, const Case& c) {
  if (v.d != c.d || v.fp16 != c.fp16 || excluded(v.name)) return "";
  g_current = v.name;
  const std::string test = v.name + " / " + c.name;
  std::printf("running %s\n", test.c_str());
  std::fflush(stdout);
  return test;
}

// The timing case of `total` tokens: sequences of the lengths of bench/gpu/varlen_batches.md's cycle, one after the
// other without padding, `heads` heads of dim d, causal or full; pairs: its visible (query, key) pairs per head.
Case timing_case(std::string name, int heads, int d, int64_t total, bool causal, double& pairs) {
  static const int cycle[] = {512, 1536, 2560, 3584, 1024, 3072, 2048, 4096};
  Case c;
  c.name = std::move(name);
  c.heads_q = c.heads_kv = heads;
  c.d = d;
  if (causal) c.wr = 0;
  pairs = 0;
  for (int i = 0; c.q_rows < total; ++i) {
    const int len = static_cast<int>(std::min<int64_t>(cycle[i % 8], total - c.q_rows));
    c.seqs.push_back(one_segment(c.q_rows, len, c.q_rows, len));
    c.q_rows += len;
    pairs += causal ? 0.5 * len * (len + 1.0) : 1.0 * len * len;
  }
  c.kv_rows = c.q_rows;
  return c;
}

// The bf16 variants of head dim d in the order they are timed: the mma.sync ones (the baseline) first.
template <class Variant>
std::vector<const Variant*> timing_order(const std::vector<Variant>& variants, int d) {
  std::vector<const Variant*> order;
  for (const Variant& v : variants)
    if (v.mma_sync && v.d == d && !v.fp16) order.push_back(&v);
  for (const Variant& v : variants)
    if (!v.mma_sync && v.d == d && !v.fp16) order.push_back(&v);
  return order;
}

// Whether variant `v` is timed on case `c` (not excluded); if so it is named as what runs now and announced.
template <class Variant>
bool begin_timing(const Variant& v, const Case& c) {
  if (excluded(v.name)) return false;
  g_current = v.name;
  std::printf("running %s on %s\n", v.name.c_str(), c.name.c_str());
  std::fflush(stdout);
  return true;
}

// Device times of `reps` launches (launch() returns "" or an error, which is fatal), after `warmups` untimed ones:
// CUDA events around each, in ms, sorted.
template <class Launch>
std::vector<float> time_launches(int warmups, int reps, Launch launch) {
  for (int w = 0; w < warmups; ++w)
    if (std::string e = launch(); !e.empty()) fatal(e, 4);
  sync_or_die();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(ev[2 * r], 0));
    if (std::string e = launch(); !e.empty()) fatal(e, 4);
    CK(cudaEventRecord(ev[2 * r + 1], 0));
  }
  sync_or_die();
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) CK(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
  for (auto& e : ev) CK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms;
}

// A row of the timing table: kept for the summary and printed as a TIMING line now.
void add_timing_row(const char* line) {
  g_timing_rows.push_back(line);
  std::printf("TIMING|%s\n", line);
  std::fflush(stdout);
}

// The options both programs take: --reps N, --skip-timing, --seed S, --exclude a,b.
struct Options {
  int reps;      // default, then as given
  int min_reps;  // fewer is an error
  uint64_t seed;
  bool timing = true;
};

// Reads the options into `o`; `other(argument)` is asked first about each argument and may end the program there
// with an exit status (--host-check). An exit status to end with (2 for a bad option), or none to go on.
template <class Other>
std::optional<int> read_options(int argc, char** argv, const char* program, Options& o, Other other) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (const std::optional<int> code = other(a)) return code;
    if (a == "--reps" && i + 1 < argc) {
      o.reps = std::atoi(argv[++i]);
    } else if (a == "--skip-timing") {
      o.timing = false;
    } else if (a == "--seed" && i + 1 < argc) {
      o.seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--exclude" && i + 1 < argc) {
      add_excludes(argv[++i]);
    } else {
      std::fprintf(stderr, "%s: unknown argument '%s' (options: --reps N, --skip-timing, --seed S, "
                           "--exclude a,b)\n", program, a.c_str());
      return 2;
    }
  }
  if (o.reps < o.min_reps) {
    std::fprintf(stderr, "%s: --reps %d: at least %d\n", program, o.reps, o.min_reps);
    return 2;
  }
  return std::nullopt;
}

// Prints the device, its driver and runtime (with_l2: its L2 size too); false, after a line saying so, unless it is
// of compute capability 9.0 (the programs' sm_90a code).
bool device_is_sm90(bool with_l2) {
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));
  const std::string l2 = with_l2 ? ", L2 " + std::to_string(prop.l2CacheSize >> 20) + " MB" : "";
  std::printf("device %s (sm_%d%d, %d SMs, %.0f KB shared memory per block opt-in%s), driver %d, runtime %d\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.sharedMemPerBlockOptin / 1024.0,
              l2.c_str(), driver, runtime);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("this program needs a compute capability 9.0 GPU (sm_90a code)\n");
    return false;
  }
  return true;
}

// Each program defines its unit tests.
void run_unit_tests(std::mt19937_64& rng);

// The stages after the options: the unit tests, the variants' tests, the timing (unless skipped) and the summary;
// exit status 1 when a check failed.
template <class Variant>
int run_stages(const Options& o, std::vector<Variant> (*all)(), void (*tests)(const std::vector<Variant>&),
               void (*timing)(const std::vector<Variant>&, int)) {
  print_excluded();
  std::mt19937_64 rng(o.seed);
  run_unit_tests(rng);
  const std::vector<Variant> variants = all();
  tests(variants);
  if (o.timing) timing(variants, o.reps);
  print_summary();
  return any_failed() ? 1 : 0;
}

}  // namespace hf
