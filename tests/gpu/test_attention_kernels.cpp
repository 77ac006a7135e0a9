// GPU attention kernels in-process against the CPU reference with the budget rule of docs/numerics.md:
// max|gpu - oracle| <= rtol * max|peer - oracle| + atol and the mean rule, plus the exact classes (pad rows of
// O/dQ/dK/dV exactly zero, everything finite, the set of -inf LSE rows equal to the oracle's).
// Pad and tail rows of q, k, v, dout hold NaN in every case, so a pad value reaching a valid output fails.
// Without a GPU every case prints "SKIPPED: no CUDA device" (CTest reports it as skipped).
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check/budget_rule.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "gpu/kernels/attention/host_attention.hpp"
#include "reference/attention.hpp"
#include "reference/attention_call.hpp"
#include "reference/thd_layout.hpp"
#include "tests/gpu/require_device.hpp"

using namespace cpgold;
namespace fx = cpgold::fx;

namespace {

struct Case {
  Case() = default;
  // The name, dtype, head counts and head dims; the call and the inputs are the maker's.
  Case(std::string name, DType dtype, int hq, int hkv, int d, int dv)
      : name(std::move(name)), dtype(dtype), heads_q(hq), heads_kv(hkv), dim_qk(d), dim_v(dv) {}
  std::string name;
  DType dtype = DType::bf16;
  int heads_q = 2, heads_kv = 2, dim_qk = 128, dim_v = 128;
  AttentionCall call;
  std::vector<uint8_t> q_valid, kv_valid;
  Tensor3<float> q, k, v, dout;
};

std::vector<uint8_t> rows_in_segments(const AttentionCall& call, bool q_side) {
  std::vector<uint8_t> valid(static_cast<size_t>(q_side ? call.q_rows : call.kv_rows), 0);
  for (const SequenceTile& seq : call.sequences)
    for (const RowSegment& s : (q_side ? seq.q : seq.kv))
      for (int64_t r = s.first_row; r < s.first_row + s.count; ++r) valid[static_cast<size_t>(r)] = 1;
  return valid;
}

// Valid rows uniform in [-1, 1] rounded to the dtype; pad and tail rows NaN.
Tensor3<float> random_tensor(int64_t rows, int heads, int dim, DType dtype, const std::vector<uint8_t>& valid,
                             std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  Tensor3<float> x(rows, heads, dim, std::numeric_limits<float>::quiet_NaN());
  for (int64_t r = 0; r < rows; ++r)
    if (valid[static_cast<size_t>(r)])
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < dim; ++i) x(r, h, i) = round_to(dtype, uniform(rng));
  return x;
}

void fill_inputs(Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  c.q_valid = rows_in_segments(c.call, true);
  c.kv_valid = rows_in_segments(c.call, false);
  c.q = random_tensor(c.call.q_rows, c.heads_q, c.dim_qk, c.dtype, c.q_valid, rng);
  c.k = random_tensor(c.call.kv_rows, c.heads_kv, c.dim_qk, c.dtype, c.kv_valid, rng);
  c.v = random_tensor(c.call.kv_rows, c.heads_kv, c.dim_v, c.dtype, c.kv_valid, rng);
  c.dout = random_tensor(c.call.q_rows, c.heads_q, c.dim_v, c.dtype, c.q_valid, rng);
}

// A non-CP case: each sequence padded by 0..7 rows (seeded), 5 tail rows after the last.
Case make_case(std::string name, DType dtype, int hq, int hkv, int d, int dv, Window window,
               const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_kv, uint64_t seed) {
  Case c(std::move(name), dtype, hq, hkv, d, dv);
  std::mt19937_64 rng(seed * 7919 + 17);
  std::vector<int32_t> pad_q, pad_kv;
  for (int32_t len : lens_q) pad_q.push_back(len + static_cast<int32_t>(rng() % 8));
  for (int32_t len : lens_kv) pad_kv.push_back(len + static_cast<int32_t>(rng() % 8));
  int64_t total_q = 5, total_kv = 5;
  for (int32_t p : pad_q) total_q += p;
  for (int32_t p : pad_kv) total_kv += p;
  ThdLayout layout{make_packed_sequences(lens_q, pad_q, total_q, "q"),
                   make_packed_sequences(lens_kv, pad_kv, total_kv, "kv")};
  c.call = non_cp_call(layout, window, 1.0 / std::sqrt(static_cast<double>(d)));
  fill_inputs(c, seed);
  return c;
}

std::string describe_case(const Case& c) {
  return c.name + " [" + std::string(dtype_name(c.dtype)) + " h" + std::to_string(c.heads_q) + "/" +
         std::to_string(c.heads_kv) + " d" + std::to_string(c.dim_qk) + "/" + std::to_string(c.dim_v) + " " +
         describe(c.call.window) + "]";
}

// Checks one tensor with the budget rule and the exact classes; prints one verdict line.
bool check_tensor(const std::string& label, fx::Quantity quantity, DType dtype, const fx::TensorView<double>& oracle,
                  const fx::TensorView<float>& peer, const fx::TensorView<float>& candidate,
                  const std::vector<uint8_t>& valid) {
  const fx::Budget budget = fx::compute_budget(quantity, dtype, oracle, peer, valid);
  const fx::Limits limits = fx::limits_of(budget);
  const fx::Evaluation e = fx::evaluate(quantity, oracle, candidate, valid, limits, limits);
  std::printf("VERDICT %-58s %-3s compared=%-8lld max_err=%.3e (limit %.3e, peer %.3e) mean_err=%.3e (limit %.3e) "
              "exact_violations=%lld %s\n",
              label.c_str(), std::string(fx::quantity_name(quantity)).c_str(), static_cast<long long>(e.compared),
              e.max_err, e.limits.max, budget.peer_max_err, e.mean_err, e.limits.mean,
              static_cast<long long>(e.exact_violation_count), e.pass() ? "PASS" : "FAIL");
  INFO(label, " ", fx::quantity_name(quantity));
  if (!e.exact_ok()) {
    const fx::ExactViolation& v = e.exact_violations.front();
    INFO("first exact violation: ", fx::exact_rule_name(v.rule), " at row ", v.index.row, " head ", v.index.head,
         " dim ", v.index.dim, " candidate ", v.candidate, " oracle ", v.oracle);
    CHECK(e.exact_ok());
  }
  if (e.worst) INFO("worst at row ", e.worst->row, " head ", e.worst->head, " dim ", e.worst->dim);
  CHECK(e.max_ok);
  CHECK(e.mean_ok);
  return e.pass();
}

int count_empty_rows(const LseTensor<double>& lse, const std::vector<uint8_t>& valid) {
  int n = 0;
  for (int64_t h = 0; h < lse.heads; ++h)
    for (int64_t r = 0; r < lse.rows; ++r)
      if (valid[static_cast<size_t>(r)] && lse(h, r) == -std::numeric_limits<double>::infinity()) ++n;
  return n;
}

struct CaseRun {
  ForwardResult<double> oracle_fwd;
  gpu::HostForward gpu_fwd;
};

// Forward and both backward modes of one case against oracle and peer.
CaseRun run_case(const Case& c) {
  const std::string label = describe_case(c);
  const Tensor3<double> qd = tensor_cast<double>(c.q), kd = tensor_cast<double>(c.k), vd = tensor_cast<double>(c.v),
                        dod = tensor_cast<double>(c.dout);
  CaseRun run;
  run.oracle_fwd = attention_forward(c.call, qd, kd, vd);
  const ForwardResult<float> peer_fwd = attention_forward(c.call, c.q, c.k, c.v, c.dtype);
  const gpu::Outcome fwd = gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, run.gpu_fwd);
  INFO(label, ": ", gpu::status_name(fwd.status), " ", fwd.message);
  REQUIRE(fwd.ok());
  check_tensor(label, fx::Quantity::o, c.dtype, fx::view_of(run.oracle_fwd.o), fx::view_of(peer_fwd.o),
               fx::view_of(run.gpu_fwd.o), c.q_valid);
  check_tensor(label, fx::Quantity::lse, c.dtype, fx::view_of(run.oracle_fwd.lse), fx::view_of(peer_fwd.lse),
               fx::view_of(run.gpu_fwd.lse), c.q_valid);

  // Backward: each arithmetic from its own forward (the GPU from the GPU's O and LSE, as a training step does).
  const BackwardResult<double> oracle_bwd =
      attention_backward(c.call, qd, kd, vd, run.oracle_fwd.o, run.oracle_fwd.lse, dod);
  const BackwardResult<float> peer_bwd =
      attention_backward(c.call, c.q, c.k, c.v, peer_fwd.o, peer_fwd.lse, c.dout, c.dtype);
  for (gpu::BackwardMode mode : {gpu::BackwardMode::atomic, gpu::BackwardMode::deterministic}) {
    const std::string mode_label = label + (mode == gpu::BackwardMode::atomic ? " atomic" : " determ");
    gpu::HostBackward bwd;
    const gpu::Outcome r =
        gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, run.gpu_fwd.o, run.gpu_fwd.lse, c.dout, mode, bwd);
    INFO(mode_label, ": ", gpu::status_name(r.status), " ", r.message);
    REQUIRE(r.ok());
    check_tensor(mode_label, fx::Quantity::dq, c.dtype, fx::view_of(oracle_bwd.dq), fx::view_of(peer_bwd.dq),
                 fx::view_of(bwd.dq), c.q_valid);
    check_tensor(mode_label, fx::Quantity::dk, c.dtype, fx::view_of(oracle_bwd.dk), fx::view_of(peer_bwd.dk),
                 fx::view_of(bwd.dk), c.kv_valid);
    check_tensor(mode_label, fx::Quantity::dv, c.dtype, fx::view_of(oracle_bwd.dv), fx::view_of(peer_bwd.dv),
                 fx::view_of(bwd.dv), c.kv_valid);
  }
  return run;
}

const std::vector<int32_t> kTileEdgeLengths = {1, 63, 64, 65, 113, 203, 0, 1023, 1024, 1025};

std::vector<int32_t> random_lengths(std::mt19937_64& rng, int count, int max_len) {
  std::vector<int32_t> lens;
  for (int i = 0; i < count; ++i) lens.push_back(rng() % 5 == 0 ? 0 : static_cast<int32_t>(rng() % (max_len + 1)));
  return lens;
}

}  // namespace

TEST_CASE("gpu attention: lengths around tile sizes, GQA, causal, bf16, d128") {
  CPGOLD_REQUIRE_DEVICE();
  run_case(make_case("tile-edge lengths", DType::bf16, 4, 2, 128, 128, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 1));
}

TEST_CASE("gpu attention: lengths around tile sizes, no mask, fp16, d64") {
  CPGOLD_REQUIRE_DEVICE();
  run_case(make_case("tile-edge lengths", DType::fp16, 2, 2, 64, 64, {-1, -1}, kTileEdgeLengths, kTileEdgeLengths, 2));
}

TEST_CASE("gpu attention: window crossing tile edges, MQA, fp16, d64") {
  CPGOLD_REQUIRE_DEVICE();
  std::mt19937_64 rng(3);
  const std::vector<int32_t> lens = random_lengths(rng, 12, 300);
  run_case(make_case("window(37,5) random lengths", DType::fp16, 4, 1, 64, 64, {37, 5}, lens, lens, 3));
  run_case(make_case("window(64,64) tile-edge lengths", DType::bf16, 4, 1, 64, 64, {64, 64}, kTileEdgeLengths,
                     kTileEdgeLengths, 4));
}

TEST_CASE("gpu attention: MLA 192/128 and 128/64, sliding causal window, GQA") {
  CPGOLD_REQUIRE_DEVICE();
  run_case(make_case("MLA window(100,0)", DType::bf16, 4, 2, 192, 128, {100, 0}, {65, 203, 0, 130, 1025},
                     {65, 203, 0, 130, 1025}, 5));
  run_case(make_case("MLA causal", DType::fp16, 2, 1, 192, 128, {-1, 0}, {64, 1, 500}, {64, 1, 500}, 6));
  run_case(make_case("MLA 128/64 causal", DType::bf16, 4, 2, 128, 64, {-1, 0}, {64, 1, 500, 0, 77}, {64, 1, 500, 0, 77}, 7));
}

TEST_CASE("gpu attention: head dims 96 and 256 (two column slices of dK/dV) and 32 on tile-edge lengths, GQA") {
  CPGOLD_REQUIRE_DEVICE();
  run_case(make_case("d256 causal GQA", DType::bf16, 4, 2, 256, 256, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 21));
  run_case(make_case("d256 full fp16", DType::fp16, 2, 1, 256, 256, {-1, -1}, {65, 1, 300, 0, 128}, {65, 1, 300, 0, 128},
                     22));
  run_case(make_case("d96 window(50,3)", DType::bf16, 6, 2, 96, 96, {50, 3}, kTileEdgeLengths, kTileEdgeLengths, 23));
  run_case(make_case("d96 causal fp16", DType::fp16, 3, 3, 96, 96, {-1, 0}, {64, 1, 500, 0, 77}, {64, 1, 500, 0, 77}, 24));
  run_case(make_case("d32 causal MQA", DType::bf16, 4, 1, 32, 32, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 25));
}

TEST_CASE("gpu attention: rows with no visible key give O = 0 and LSE = -inf") {
  CPGOLD_REQUIRE_DEVICE();
  // Bottom-right causal with L_q > L_kv hides the first L_q - L_kv rows; L_kv = 0 hides every row.
  const Case c = make_case("empty rows (L_q > L_kv, L_kv = 0)", DType::bf16, 2, 2, 128, 128, {-1, 0}, {113, 203, 50},
                           {50, 113, 0}, 7);
  const CaseRun run = run_case(c);
  const int empty = count_empty_rows(run.oracle_fwd.lse, c.q_valid);
  CHECK(empty == 2 * (63 + 90 + 50));
  int gpu_empty = 0, gpu_zero_rows = 0;
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t r = 0; r < c.call.q_rows; ++r)
      if (c.q_valid[static_cast<size_t>(r)] && run.gpu_fwd.lse(h, r) == -std::numeric_limits<float>::infinity()) {
        ++gpu_empty;
        bool zero = true;
        for (int x = 0; x < c.dim_v; ++x) zero = zero && run.gpu_fwd.o(r, h, x) == 0.f;
        gpu_zero_rows += zero ? 1 : 0;
      }
  CHECK(gpu_empty == empty);
  CHECK(gpu_zero_rows == empty);
  // Window (-1, 3) with L_q = 100 > L_kv = 20 (delta = -80): rows 0..76 see no key.
  run_case(make_case("window(-1,3) with L_q > L_kv", DType::fp16, 2, 2, 64, 64, {-1, 3}, {100}, {20}, 8));
}

TEST_CASE("gpu attention: every mask kind x dtype x head dims on random layouts with zero-length sequences") {
  CPGOLD_REQUIRE_DEVICE();
  const Window masks[] = {{-1, -1}, {-1, 0}, {45, 13}, {0, 0}, {-1, 70}};
  const int dims[][2] = {{32, 32}, {64, 64}, {96, 96}, {128, 128}, {128, 64}, {192, 128}, {256, 256}};
  uint64_t seed = 100;
  for (DType dtype : {DType::bf16, DType::fp16})
    for (const auto& d : dims)
      for (const Window& w : masks) {
        std::mt19937_64 rng(seed);
        const std::vector<int32_t> lens = random_lengths(rng, 6, 150);
        run_case(make_case("matrix", dtype, 3, 1, d[0], d[1], w, lens, lens, seed++));
      }
}

TEST_CASE("gpu attention: a CP-step call (two Q segments mid-sequence, two KV segments) matches the reference") {
  CPGOLD_REQUIRE_DEVICE();
  for (Window w : {Window{-1, 0}, Window{-1, -1}, Window{40, 0}}) {
    Case c("cp-step segments", DType::bf16, 4, 2, 128, 128);
    c.call.window = w;
    c.call.softmax_scale = 1.0 / std::sqrt(128.0);
    c.call.q_rows = 200;
    c.call.kv_rows = 400;
    SequenceTile a;  // rank 0 of W = 2 on a 300-token sequence: chunks 0 and 3 of 75
    a.length_q = a.length_kv = 300;
    a.q = {{0, 75, 0}, {80, 75, 225}};
    a.kv = {{0, 150, 0}, {152, 150, 150}};
    SequenceTile b;  // an all-gather-like step: Q starts mid-sequence, KV is a prefix
    b.length_q = b.length_kv = 90;
    b.q = {{160, 30, 60}};
    b.kv = {{310, 90, 0}};
    c.call.sequences = {a, b};
    fill_inputs(c, 11);
    run_case(c);
  }
}

TEST_CASE("gpu attention: deterministic backward is bitwise identical over 10 runs") {
  CPGOLD_REQUIRE_DEVICE();
  const Case c = make_case("determinism", DType::bf16, 4, 1, 128, 128, {-1, 0}, {1025, 333, 0, 64}, {1025, 333, 0, 64}, 9);
  gpu::HostForward fwd;
  REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd).ok());
  auto same_bits = [](const Tensor3<float>& a, const Tensor3<float>& b) {
    return a.values.size() == b.values.size() &&
           std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)) == 0;
  };
  gpu::HostBackward first;
  REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                  gpu::BackwardMode::deterministic, first)
              .ok());
  int identical = 0;
  for (int run = 1; run < 10; ++run) {
    gpu::HostBackward again;
    REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                    gpu::BackwardMode::deterministic, again)
                .ok());
    const bool same = same_bits(first.dq, again.dq) && same_bits(first.dk, again.dk) && same_bits(first.dv, again.dv);
    CHECK(same);
    identical += same ? 1 : 0;
  }
  std::printf("VERDICT deterministic backward: %d of 9 reruns bitwise identical to the first\n", identical);
  // The forward is deterministic too.
  gpu::HostForward fwd2;
  REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd2).ok());
  CHECK(same_bits(fwd.o, fwd2.o));
}

// The backward's workspace pool: after a backward (atomic mode: delta and the float32 dQ accumulator) the pool of
// the device holds at least that workspace; release_workspace_memory hands it back once nothing is in flight, and a
// backward after that allocates afresh and gives the same bits (deterministic mode).
TEST_CASE("gpu attention: the backward workspace stays reserved between calls until release_workspace_memory") {
  CPGOLD_REQUIRE_DEVICE();
  const Case c = make_case("workspace", DType::bf16, 4, 2, 128, 128, {-1, 0}, {700, 129}, {700, 129}, 21);
  gpu::HostForward fwd;
  REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd).ok());
  int device = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  gpu::HostBackward atomic;
  REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, gpu::BackwardMode::atomic,
                                  atomic)
              .ok());
  // float32 dQ accumulator [q_rows, 4, 128] and delta [4, q_rows]
  const uint64_t workspace = 4ull * static_cast<uint64_t>(c.call.q_rows) * 4 * (128 + 1);
  uint64_t held = 0;
  REQUIRE(gpu::workspace_memory_reserved(device, held).ok());
  std::printf("VERDICT workspace pool after an atomic backward: %llu bytes reserved (workspace %llu)\n",
              static_cast<unsigned long long>(held), static_cast<unsigned long long>(workspace));
  CHECK(held >= workspace);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(gpu::release_workspace_memory().ok());
  REQUIRE(gpu::workspace_memory_reserved(device, held).ok());
  CHECK(held == 0);
  gpu::HostBackward det1, det2;
  REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                  gpu::BackwardMode::deterministic, det1)
              .ok());
  REQUIRE(gpu::release_workspace_memory().ok());
  REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                  gpu::BackwardMode::deterministic, det2)
              .ok());
  auto same = [](const Tensor3<float>& a, const Tensor3<float>& b) {
    return a.values.size() == b.values.size() &&
           std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)) == 0;
  };
  CHECK(same(det1.dq, det2.dq));
  CHECK(same(det1.dk, det2.dk));
  CHECK(same(det1.dv, det2.dv));
}

// The summing backward (BackwardBuffers' RowSum) against the plain backward plus a host float32 add at the mapped rows:
// the same bits in the deterministic mode (dQ too); in the atomic mode dK and dV bit for bit, dQ within one dtype ulp
// (its float32 atomics add in a different order on every run). Sums larger than the call, rows mapped by a random
// injection (unmapped rows untouched, -0.0 and subnormals among the starting values); assign into a NaN-filled sum
// of exactly the call's rows writes every row (0 + value) and reads none.
// Run for head dims 128/64 (the mma.sync backward on every device) and 128/128 (the wgmma backward on a 9.0 device:
// its summing form in both modes, the atomic one included).
void check_summing(const Case& c) {
  std::printf("summing case d %d/%d: backward kernel %s\n", c.dim_qk, c.dim_v,
              gpu::backward_kernel_description({c.dtype, c.heads_q, c.heads_kv, c.dim_qk, c.dim_v}).c_str());
  gpu::HostForward fwd;
  REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd).ok());
  std::mt19937_64 rng(5);
  auto injection = [&](int64_t n, int64_t into) {
    std::vector<int64_t> all(static_cast<size_t>(into));
    for (int64_t i = 0; i < into; ++i) all[static_cast<size_t>(i)] = i;
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(n));
    return all;
  };
  auto start_values = [&](int64_t rows, int64_t heads, int64_t dim) {
    std::uniform_real_distribution<float> u(-2.f, 2.f);
    Tensor3<float> x(rows, heads, dim);
    // -0.0 and subnormal sums among them: a reduction that flushed subnormals or turned -0 + 0 into -0 would show
    // at the rows that add zeros (pad rows).
    for (size_t i = 0; i < x.values.size(); ++i)
      x.values[i] = i % 11 == 0 ? -0.0f : i % 13 == 0 ? std::ldexp(u(rng), -128) : u(rng);
    return x;
  };
  auto bits_of = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  };
  // sum[map[i]] + x[i] in float32 (or 0 + x[i] with assign) against `got`; tol_ulps > 0 allows that many dtype ulps.
  auto expect_sum = [&](const char* what, const Tensor3<float>& start, const Tensor3<float>& x,
                        const std::vector<int64_t>& map, bool assign, const Tensor3<float>& got, int tol_ulps) {
    Tensor3<float> want = start;
    const int64_t w = x.heads * x.dim;
    int64_t subnormal_plus_zero = 0;  // mapped subnormal sums that a zero is added to (they must stay as they are)
    for (int64_t r = 0; r < x.rows; ++r)
      for (int64_t e = 0; e < w; ++e) {
        float& d = want.values[static_cast<size_t>(map[static_cast<size_t>(r)] * w + e)];
        const float v = x.values[static_cast<size_t>(r * w + e)];
        subnormal_plus_zero += !assign && v == 0.0f && std::fpclassify(d) == FP_SUBNORMAL ? 1 : 0;
        d = (assign ? 0.0f : d) + v;
      }
    int64_t differ = 0;
    for (size_t i = 0; i < want.values.size(); ++i) {
      const float a = want.values[i], b = got.values[i];
      // ulps: of the dtype value added (at most 2^-7 of it for bf16), plus two float32 ulps of the sums' rounding.
      const bool ok = tol_ulps == 0 ? bits_of(a) == bits_of(b)
                                    : std::fabs(a - b) <= tol_ulps * std::ldexp(std::fabs(a - start.values[i]), -7) +
                                                              std::ldexp(std::fabs(a) + std::fabs(b), -23);
      differ += ok ? 0 : 1;
    }
    std::printf("VERDICT summing backward %-40s %lld of %zu values differ (%lld subnormal sums plus zero)\n", what,
                static_cast<long long>(differ), want.values.size(), static_cast<long long>(subnormal_plus_zero));
    INFO(what);
    CHECK(differ == 0);
    if (!assign) CHECK(subnormal_plus_zero > 0);
  };
  // Sums larger than the call, random starting values, rows mapped by random injections.
  auto random_sums = [&] {
    gpu::HostSums sums;
    sums.dq = start_values(c.q.rows + 9, c.q.heads, c.q.dim);
    sums.dk = start_values(c.k.rows + 5, c.k.heads, c.k.dim);
    sums.dv = start_values(c.v.rows + 5, c.v.heads, c.v.dim);
    sums.q_map = injection(c.q.rows, sums.dq.rows);
    sums.kv_map = injection(c.k.rows, sums.dk.rows);
    return sums;
  };
  gpu::HostBackward plain_det;  // the plain backward's outputs, deterministic mode (dQ reproducible)
  REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                  gpu::BackwardMode::deterministic, plain_det)
              .ok());
  for (gpu::BackwardMode mode : {gpu::BackwardMode::deterministic, gpu::BackwardMode::atomic}) {
    const bool det = mode == gpu::BackwardMode::deterministic;
    gpu::HostBackward plain_atomic;
    if (!det)
      REQUIRE(
          gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, plain_atomic).ok());
    const gpu::HostBackward& plain = det ? plain_det : plain_atomic;
    gpu::HostSums sums = random_sums();
    const gpu::HostSums start = sums;
    REQUIRE(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, sums).ok());
    expect_sum(det ? "dQ (deterministic)" : "dQ (atomic, within 1 ulp)", start.dq, plain.dq, start.q_map, false,
               sums.dq, det ? 0 : 1);
    expect_sum(det ? "dK (deterministic)" : "dK (atomic)", start.dk, plain.dk, start.kv_map, false, sums.dk, 0);
    expect_sum(det ? "dV (deterministic)" : "dV (atomic)", start.dv, plain.dv, start.kv_map, false, sums.dv, 0);
  }
  // result (the last contribution): dtype(sum[map[i]] + x[i]) at the mapped rows of a NaN-filled dtype tensor, the
  // bits of adding and then converting the sum; rows outside the map are never written (stay NaN). Deterministic
  // mode, so that dQ compares bit for bit too.
  {
    const gpu::HostBackward& plain = plain_det;
    gpu::HostSums sums = random_sums();
    sums.result_q = sums.result_kv = true;
    const gpu::HostSums start = sums;
    REQUIRE(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                        gpu::BackwardMode::deterministic, sums)
                .ok());
    auto expect_result = [&](const char* what, const Tensor3<float>& start_sum, const Tensor3<float>& x,
                             const std::vector<int64_t>& map, const Tensor3<float>& got) {
      const int64_t w = x.heads * x.dim;
      std::vector<char> mapped(static_cast<size_t>(start_sum.rows), 0);
      for (int64_t r : map) mapped[static_cast<size_t>(r)] = 1;
      int64_t differ = 0, written_outside = 0;
      for (int64_t r = 0; r < x.rows; ++r)
        for (int64_t e = 0; e < w; ++e) {
          const size_t at = static_cast<size_t>(map[static_cast<size_t>(r)] * w + e);
          const float want = round_to(c.dtype, start_sum.values[at] + x.values[static_cast<size_t>(r * w + e)]);
          differ += bits_of(want) == bits_of(got.values[at]) ? 0 : 1;
        }
      for (int64_t r = 0; r < start_sum.rows; ++r)
        if (!mapped[static_cast<size_t>(r)])
          for (int64_t e = 0; e < w; ++e)
            written_outside += std::isnan(got.values[static_cast<size_t>(r * w + e)]) ? 0 : 1;
      std::printf("VERDICT summing backward %-40s %lld values differ, %lld written outside the map\n", what,
                  static_cast<long long>(differ), static_cast<long long>(written_outside));
      INFO(what);
      CHECK(differ == 0);
      CHECK(written_outside == 0);
    };
    expect_result("dQ result (deterministic)", start.dq, plain.dq, start.q_map, sums.dq);
    expect_result("dK result", start.dk, plain.dk, start.kv_map, sums.dk);
    expect_result("dV result", start.dv, plain.dv, start.kv_map, sums.dv);
    // And through the atomic mode's dQ pass: within one dtype ulp of the deterministic result.
    gpu::HostSums atomic = start;
    REQUIRE(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                        gpu::BackwardMode::atomic, atomic)
                .ok());
    int64_t far = 0, nan_in_map = 0;
    const int64_t w = c.q.heads * c.q.dim;
    for (int64_t r : start.q_map)
      for (int64_t e = 0; e < w; ++e) {
        const size_t at = static_cast<size_t>(r * w + e);
        const float a = atomic.dq.values[at], d = sums.dq.values[at];
        nan_in_map += std::isnan(a) ? 1 : 0;
        far += std::fabs(a - d) <= std::ldexp(std::fabs(d), -6) + 1e-30f ? 0 : 1;
      }
    std::printf("VERDICT summing backward %-40s %lld values beyond one ulp, %lld NaN\n", "dQ result (atomic)",
                static_cast<long long>(far), static_cast<long long>(nan_in_map));
    CHECK(far == 0);
    CHECK(nan_in_map == 0);
  }
  // assign: NaN-filled sums of exactly the call's rows, identity maps.
  const gpu::HostBackward& plain = plain_det;
  gpu::HostSums sums;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  sums.dq = Tensor3<float>(c.q.rows, c.q.heads, c.q.dim, nan);
  sums.dk = Tensor3<float>(c.k.rows, c.k.heads, c.k.dim, nan);
  sums.dv = Tensor3<float>(c.v.rows, c.v.heads, c.v.dim, nan);
  for (int64_t r = 0; r < c.q.rows; ++r) sums.q_map.push_back(r);
  for (int64_t r = 0; r < c.k.rows; ++r) sums.kv_map.push_back(r);
  sums.assign_q = sums.assign_kv = true;
  const gpu::HostSums start = sums;
  REQUIRE(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout,
                                      gpu::BackwardMode::deterministic, sums)
              .ok());
  expect_sum("dQ assign", start.dq, plain.dq, start.q_map, true, sums.dq, 0);
  expect_sum("dK assign", start.dk, plain.dk, start.kv_map, true, sums.dk, 0);
  expect_sum("dV assign", start.dv, plain.dv, start.kv_map, true, sums.dv, 0);
  // Half the sums set is refused, naming the rule.
  gpu::AttentionPlan plan;
  REQUIRE(plan.build(c.call, gpu::shape_of(c.dtype, c.q, c.k, c.v)).ok());
  gpu::BackwardBuffers b;
  float dummy = 0;
  b.dq_sum.data = &dummy;
  const gpu::Outcome refused = gpu::attention_backward(plan, b);
  CHECK(refused.status == gpu::Status::invalid_argument);
  CHECK(refused.message.find("dq_sum, dk_sum and dv_sum") != std::string::npos);
  // A result outside the summing form, or on dK without dV, is refused too.
  gpu::BackwardBuffers r;
  r.dq_sum.result = &dummy;
  const gpu::Outcome no_sum = gpu::attention_backward(plan, r);
  CHECK(no_sum.status == gpu::Status::invalid_argument);
  CHECK(no_sum.message.find("outside the summing form") != std::string::npos);
  gpu::BackwardBuffers half;
  half.dq_sum.data = half.dk_sum.data = half.dv_sum.data = &dummy;
  half.dk_sum.result = &dummy;  // checked before the maps and buffers
  const gpu::Outcome one_side = gpu::attention_backward(plan, half);
  CHECK(one_side.status == gpu::Status::invalid_argument);
  CHECK(one_side.message.find("dk_sum.result and dv_sum.result") != std::string::npos);
}

TEST_CASE("gpu attention: the summing backward adds the rounded outputs at the mapped rows, bit for bit") {
  CPGOLD_REQUIRE_DEVICE();
  check_summing(make_case("summing", DType::bf16, 4, 2, 128, 64, {-1, 0}, {300, 0, 129, 64}, {300, 0, 129, 64}, 21));
  check_summing(make_case("summing d128", DType::fp16, 4, 2, 128, 128, {40, 0}, {300, 0, 129, 64}, {300, 0, 129, 64}, 22));
  check_summing(make_case("summing d96", DType::bf16, 2, 1, 96, 96, {-1, 0}, {300, 0, 129, 64}, {300, 0, 129, 64}, 23));
  check_summing(make_case("summing d256", DType::bf16, 2, 1, 256, 256, {-1, 0}, {300, 0, 129, 64}, {300, 0, 129, 64}, 24));
  check_summing(make_case("summing 192/128", DType::fp16, 4, 2, 192, 128, {40, 0}, {300, 0, 129, 64}, {300, 0, 129, 64}, 25));
}

// Small enough for compute-sanitizer (memcheck, racecheck): both forward kernels (the automatic choice, the wgmma
// forward on a 9.0 device for every dim here, d 96 with its zero-filled columns included, and the mma.sync forward
// forced), both backward kernels (the automatic choice: the wgmma backward on a 9.0 device for d 64, 96 and 128, d 96
// in 128-column tiles; the mma.sync backward forced, with a caller's delta) and both backward modes,
// with pad rows, a zero-length sequence, a partial tile and GQA, head dim 256 (dK/dV in two column slices), and the
// summing backward (both modes, added into zero sums at reversed rows) on the same shapes, whose dK and dV must be
// the plain backward's values bit for bit (0 + x = x; dK/dV do not depend on the mode or the run).
TEST_CASE("gpu attention: small case for the sanitizers") {
  CPGOLD_REQUIRE_DEVICE();
  const Case a = make_case("sanitizer case", DType::bf16, 2, 1, 64, 64, {-1, 0}, {1, 70, 0, 130}, {1, 70, 0, 130}, 12);
  const Case b = make_case("sanitizer case", DType::fp16, 2, 2, 192, 128, {30, 0}, {65, 3}, {65, 3}, 13);
  const Case d = make_case("sanitizer case", DType::bf16, 2, 1, 256, 256, {-1, 0}, {65, 0, 3}, {65, 0, 3}, 14);
  const Case e = make_case("sanitizer case", DType::bf16, 2, 2, 96, 96, {-1, -1}, {130, 0, 7}, {130, 0, 7}, 15);
  const Case f = make_case("sanitizer case", DType::fp16, 2, 1, 128, 128, {50, 0}, {129, 0, 5}, {129, 0, 5}, 16);
  for (const Case* cp : {&a, &b, &d, &e, &f}) {
    const Case& c = *cp;
    const gpu::AttentionShape shape{c.dtype, c.heads_q, c.heads_kv, c.dim_qk, c.dim_v};
    std::printf("sanitizer case d %d/%d: forward kernel %s; backward kernel %s\n", c.dim_qk, c.dim_v,
                gpu::forward_kernel_description(shape).c_str(), gpu::backward_kernel_description(shape).c_str());
    run_case(c);
    // The mma.sync backward forced as well (on a 9.0 device d 64, 96 and 128 run the wgmma one in run_case).
    for (gpu::BackwardMode mode : {gpu::BackwardMode::atomic, gpu::BackwardMode::deterministic}) {
      gpu::HostForward fwd_once;
      REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd_once).ok());
      gpu::HostBackward forced;
      REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd_once.o, fwd_once.lse, c.dout, mode, forced,
                                      {gpu::BackwardKernel::mma_sync, true})
                  .ok());
    }
    gpu::HostForward fallback;
    REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fallback, gpu::ForwardKernel::mma_sync).ok());
    gpu::HostForward fwd;
    REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd).ok());
    for (gpu::BackwardMode mode : {gpu::BackwardMode::atomic, gpu::BackwardMode::deterministic}) {
      gpu::HostSums sums;
      sums.dq = Tensor3<float>(c.q.rows, c.q.heads, c.q.dim, 0.f);
      sums.dk = Tensor3<float>(c.k.rows, c.k.heads, c.k.dim, 0.f);
      sums.dv = Tensor3<float>(c.v.rows, c.v.heads, c.v.dim, 0.f);
      for (int64_t r = c.q.rows - 1; r >= 0; --r) sums.q_map.push_back(r);
      for (int64_t r = c.k.rows - 1; r >= 0; --r) sums.kv_map.push_back(r);
      CHECK(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, sums).ok());
      bool finite = true;
      for (const Tensor3<float>* x : {&sums.dq, &sums.dk, &sums.dv})
        for (float v : x->values) finite = finite && std::isfinite(v);
      CHECK(finite);
      gpu::HostBackward plain;
      REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, plain).ok());
      int64_t differ = 0;
      for (int64_t r = 0; r < c.k.rows; ++r)
        for (int64_t h = 0; h < c.k.heads; ++h) {
          for (int64_t x = 0; x < c.k.dim; ++x)
            differ += sums.dk(sums.kv_map[static_cast<size_t>(r)], h, x) != plain.dk(r, h, x) ? 1 : 0;
          for (int64_t x = 0; x < c.v.dim; ++x)
            differ += sums.dv(sums.kv_map[static_cast<size_t>(r)], h, x) != plain.dv(r, h, x) ? 1 : 0;
        }
      INFO(c.dim_qk, "/", c.dim_v, " summing vs plain dK/dV elements that differ");
      CHECK(differ == 0);
    }
  }
}

// OutsideRows leaves rows unwritten, which only the summing form into sums that hold every row may allow: any other use
// is refused before a launch, naming the rule.
TEST_CASE("gpu attention: a plan that leaves rows outside its segments is refused outside the summing form") {
  CPGOLD_REQUIRE_DEVICE();
  ThdLayout layout{make_packed_sequences({5, 9}, {8, 16}, -1, "q"), make_packed_sequences({5, 9}, {8, 16}, -1, "kv")};
  const AttentionCall call = non_cp_call(layout, {-1, 0}, 0.125);
  gpu::AttentionPlan plan;
  REQUIRE(plan.build(call, {DType::bf16, 2, 2, 64, 64}, {.leave_q = false, .leave_kv = true}).ok());
  // Never dereferenced: the argument check fails first.
  void* p = reinterpret_cast<void*>(uintptr_t{4096});
  float* f = static_cast<float*>(p);
  const int64_t* rows = static_cast<const int64_t*>(p);
  auto refused_naming = [](const gpu::Outcome& o, const char* rule) {
    CHECK(o.status == gpu::Status::invalid_argument);
    CHECK(o.message.find(rule) != std::string::npos);
  };
  gpu::BackwardBuffers plain{p, p, p, p, p, f, p, p, p, {}, {}, {}, nullptr};
  refused_naming(gpu::attention_backward(plan, plain), "leave_kv");
  gpu::BackwardBuffers fresh{p, p, p, p, p, f, nullptr, nullptr, nullptr, {f, rows, false}, {f, rows, true},
                             {f, rows, true}, nullptr};
  CHECK(gpu::attention_backward(plan, fresh).status == gpu::Status::invalid_argument);
  gpu::AttentionPlan plan_q;
  REQUIRE(plan_q.build(call, {DType::bf16, 2, 2, 64, 64}, {.leave_q = true, .leave_kv = false}).ok());
  refused_naming(gpu::attention_backward(plan_q, plain), "leave_q");
  gpu::BackwardBuffers fresh_q{p, p, p, p, p, f, nullptr, nullptr, nullptr, {f, rows, true}, {f, rows, false},
                               {f, rows, false}, nullptr};
  CHECK(gpu::attention_backward(plan_q, fresh_q).status == gpu::Status::invalid_argument);
  refused_naming(gpu::attention_forward(plan_q, {p, p, p, p, f}), "leave_q");
  // A last contribution (RowSum::result) would leave the result rows outside the segments unwritten.
  gpu::BackwardBuffers last_q{p, p, p, p, p, f, nullptr, nullptr, nullptr, {f, rows, false, p}, {f, rows, false},
                              {f, rows, false}, nullptr};
  refused_naming(gpu::attention_backward(plan_q, last_q), "result");
  gpu::BackwardBuffers last_kv{p, p, p, p, p, f, nullptr, nullptr, nullptr, {f, rows, false}, {f, rows, false, p},
                               {f, rows, false, p}, nullptr};
  refused_naming(gpu::attention_backward(plan, last_kv), "result");
}

namespace {

const int kTableDims[][2] = {{32, 32}, {64, 64}, {96, 96}, {128, 128}, {128, 64}, {192, 128}, {256, 256}};

// Compute capability of device 0 (major * 10 + minor).
int device_cc() {
  int major = 0, minor = 0;
  gpu::cuda_device_count();
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess)
    return 0;
  return major * 10 + minor;
}

}  // namespace

// docs/gpu-kernels.md, "Forward kernels": the wgmma forward serves every head-dim pair of the table on compute
// capability 9.0 and nowhere else; the mma.sync forward serves the rest; an explicit wgmma request where it cannot
// run is refused, never replaced.
TEST_CASE("gpu attention: the forward kernel chosen per head dims and device is the documented one") {
  for (DType dtype : {DType::bf16, DType::fp16})
    for (const auto& d : kTableDims) {
      const gpu::AttentionShape shape{dtype, 4, 2, d[0], d[1]};
      INFO(dtype_name(dtype), " d", d[0], "/", d[1]);
      CHECK(gpu::wgmma_forward_serves(shape));
      gpu::ForwardKernel chosen{};
      REQUIRE(gpu::choose_forward_kernel(shape, 90, gpu::ForwardKernel::automatic, chosen).ok());
      CHECK(chosen == gpu::ForwardKernel::wgmma);
      REQUIRE(gpu::choose_forward_kernel(shape, 90, gpu::ForwardKernel::mma_sync, chosen).ok());
      CHECK(chosen == gpu::ForwardKernel::mma_sync);
      for (int cc : {0, 80, 86, 89, 100, 120}) {
        REQUIRE(gpu::choose_forward_kernel(shape, cc, gpu::ForwardKernel::automatic, chosen).ok());
        CHECK(chosen == gpu::ForwardKernel::mma_sync);
        const gpu::Outcome refused = gpu::choose_forward_kernel(shape, cc, gpu::ForwardKernel::wgmma, chosen);
        CHECK(refused.status == gpu::Status::unsupported);
        CHECK(refused.message.find("compute capability 9.0") != std::string::npos);
      }
    }
  const gpu::AttentionShape outside{DType::bf16, 2, 2, 16, 16};
  CHECK_FALSE(gpu::wgmma_forward_serves(outside));
  gpu::ForwardKernel chosen{};
  CHECK(gpu::choose_forward_kernel(outside, 90, gpu::ForwardKernel::wgmma, chosen).status == gpu::Status::unsupported);
  CHECK(gpu::parse_forward_kernel("mma") == gpu::ForwardKernel::mma_sync);
  CHECK(gpu::parse_forward_kernel("wgmma") == gpu::ForwardKernel::wgmma);
  CHECK(gpu::parse_forward_kernel("auto") == gpu::ForwardKernel::automatic);
  CHECK_FALSE(gpu::parse_forward_kernel("sm90").has_value());
}

namespace {

// Relative Frobenius difference of two tensors over the valid rows; counts pad-row elements that are not +0.
double rel_diff(const Tensor3<float>& a, const Tensor3<float>& b, const std::vector<uint8_t>& valid,
                int64_t& pad_nonzero) {
  double diff2 = 0, norm2 = 0;
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t h = 0; h < a.heads; ++h)
      for (int64_t x = 0; x < a.dim; ++x) {
        const double m = a(r, h, x), w = b(r, h, x);
        if (!valid[static_cast<size_t>(r)]) {
          pad_nonzero += (m != 0.0 || std::signbit(m)) + (w != 0.0 || std::signbit(w));
          continue;
        }
        diff2 += (m - w) * (m - w);
        norm2 += m * m;
      }
  return norm2 > 0 ? std::sqrt(diff2 / norm2) : std::sqrt(diff2);
}

bool same_values(const Tensor3<float>& a, const Tensor3<float>& b) {
  return a.values.size() == b.values.size() &&
         std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)) == 0;
}

}  // namespace

// The two forwards on the same inputs: both within the budget against the oracle (run_case's rule), and against each
// other: pad rows exactly 0 in both, the same set of -inf LSE rows, O within a relative Frobenius difference of 1e-2
// and LSE within 2e-3 (P is rounded to the dtype at different points of the sum). On a device that is not 9.0 the
// wgmma request must be refused.
TEST_CASE("gpu attention: the wgmma forward against the mma.sync forward") {
  CPGOLD_REQUIRE_DEVICE();
  const bool hopper = device_cc() == 90;
  std::printf("forward kernel on this device (d 128/128 bf16): %s\n",
              gpu::forward_kernel_description({DType::bf16, 2, 2, 128, 128}).c_str());
  std::vector<Case> cases;
  cases.push_back(make_case("A/B causal GQA", DType::bf16, 4, 2, 128, 128, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 41));
  cases.push_back(make_case("A/B window fp16", DType::fp16, 2, 1, 96, 96, {40, 24}, {129, 1, 300, 0, 257}, {100, 1, 300, 0, 260}, 42));
  cases.push_back(make_case("A/B MLA", DType::bf16, 2, 2, 192, 128, {-1, -1}, {65, 200, 0}, {65, 200, 0}, 43));
  cases.push_back(make_case("A/B d256 causal", DType::bf16, 2, 1, 256, 256, {-1, 0}, {129, 64, 3}, {129, 64, 3}, 44));
  cases.push_back(make_case("A/B d32 full", DType::fp16, 2, 2, 32, 32, {-1, -1}, {1, 127, 128, 129}, {1, 127, 128, 129}, 45));
  for (const Case& c : cases) {
    const std::string label = describe_case(c);
    INFO(label);
    gpu::HostForward mma, wg;
    const gpu::Outcome a = gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, mma, gpu::ForwardKernel::mma_sync);
    REQUIRE(a.ok());
    const gpu::Outcome b = gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, wg, gpu::ForwardKernel::wgmma);
    if (!hopper) {
      CHECK(b.status == gpu::Status::unsupported);
      continue;
    }
    INFO(b.message);
    REQUIRE(b.ok());
    const ForwardResult<double> oracle =
        attention_forward(c.call, tensor_cast<double>(c.q), tensor_cast<double>(c.k), tensor_cast<double>(c.v));
    const ForwardResult<float> peer = attention_forward(c.call, c.q, c.k, c.v, c.dtype);
    check_tensor(label + " wgmma", fx::Quantity::o, c.dtype, fx::view_of(oracle.o), fx::view_of(peer.o),
                 fx::view_of(wg.o), c.q_valid);
    check_tensor(label + " wgmma", fx::Quantity::lse, c.dtype, fx::view_of(oracle.lse), fx::view_of(peer.lse),
                 fx::view_of(wg.lse), c.q_valid);
    int64_t pad_nonzero = 0, inf_mismatch = 0;
    const double rel = rel_diff(mma.o, wg.o, c.q_valid, pad_nonzero);
    double lse_diff = 0;
    for (int64_t r = 0; r < c.call.q_rows; ++r) {
      if (!c.q_valid[static_cast<size_t>(r)]) continue;
      for (int h = 0; h < c.heads_q; ++h) {
        const float lm = mma.lse(h, r), lw = wg.lse(h, r);
        if (std::isinf(lm) || std::isinf(lw)) inf_mismatch += lm != lw;
        else lse_diff = std::max(lse_diff, static_cast<double>(std::fabs(lm - lw)));
      }
    }
    std::printf("A/B %-50s O rel diff %.3e, LSE max diff %.3e, pad elements not +0: %lld, -inf mismatches: %lld\n",
                label.c_str(), rel, lse_diff, static_cast<long long>(pad_nonzero), static_cast<long long>(inf_mismatch));
    CHECK(pad_nonzero == 0);
    CHECK(inf_mismatch == 0);
    CHECK(rel <= 1e-2);
    CHECK(lse_diff <= 2e-3);
  }
}

// docs/gpu-kernels.md, "Backward kernels": the wgmma backward serves head dims 64/64 and 128/128 (bf16, fp16) on
// compute capability 9.0 and nothing else; the mma.sync backward serves the rest; an explicit wgmma request where it
// cannot run is refused, never replaced.
TEST_CASE("gpu attention: the backward kernel chosen per head dims and device is the documented one") {
  for (DType dtype : {DType::bf16, DType::fp16})
    for (const auto& d : kTableDims) {
      const gpu::AttentionShape shape{dtype, 4, 2, d[0], d[1]};
      const bool served = true;  // every pair of the table, 192/128 and 256/256 in the wide configuration
      INFO(dtype_name(dtype), " d", d[0], "/", d[1]);
      CHECK(gpu::wgmma_backward_serves(shape) == served);
      gpu::BackwardKernel chosen{};
      REQUIRE(gpu::choose_backward_kernel(shape, 90, gpu::BackwardKernel::automatic, chosen).ok());
      // d_qk 32: served on request, but the automatic choice stays mma.sync (faster there, docs/gpu-kernels.md).
      CHECK(chosen == (served && d[0] > 32 ? gpu::BackwardKernel::wgmma : gpu::BackwardKernel::mma_sync));
      REQUIRE(gpu::choose_backward_kernel(shape, 90, gpu::BackwardKernel::mma_sync, chosen).ok());
      CHECK(chosen == gpu::BackwardKernel::mma_sync);
      const gpu::Outcome on_hopper = gpu::choose_backward_kernel(shape, 90, gpu::BackwardKernel::wgmma, chosen);
      CHECK(on_hopper.ok() == served);
      if (!served) {
        CHECK(on_hopper.status == gpu::Status::unsupported);
        CHECK(on_hopper.message.find("does not serve") != std::string::npos);
      }
      for (int cc : {0, 80, 86, 89, 100, 120}) {
        REQUIRE(gpu::choose_backward_kernel(shape, cc, gpu::BackwardKernel::automatic, chosen).ok());
        CHECK(chosen == gpu::BackwardKernel::mma_sync);
        const gpu::Outcome refused = gpu::choose_backward_kernel(shape, cc, gpu::BackwardKernel::wgmma, chosen);
        CHECK(refused.status == gpu::Status::unsupported);
      }
    }
  // A pair outside the table, and float32, are not the wgmma backward's.
  for (const gpu::AttentionShape& shape :
       {gpu::AttentionShape{DType::bf16, 4, 2, 160, 160}, gpu::AttentionShape{DType::fp32, 4, 2, 128, 128}}) {
    INFO(dtype_name(shape.dtype), " d", shape.dim_qk, "/", shape.dim_v);
    CHECK_FALSE(gpu::wgmma_backward_serves(shape));
    gpu::BackwardKernel chosen{};
    const gpu::Outcome refused = gpu::choose_backward_kernel(shape, 90, gpu::BackwardKernel::wgmma, chosen);
    CHECK(refused.status == gpu::Status::unsupported);
    CHECK(refused.message.find("does not serve") != std::string::npos);
  }
  CHECK(gpu::parse_backward_kernel("mma") == gpu::BackwardKernel::mma_sync);
  CHECK(gpu::parse_backward_kernel("mma.sync") == gpu::BackwardKernel::mma_sync);
  CHECK(gpu::parse_backward_kernel("wgmma") == gpu::BackwardKernel::wgmma);
  CHECK(gpu::parse_backward_kernel("auto") == gpu::BackwardKernel::automatic);
  CHECK_FALSE(gpu::parse_backward_kernel("sm90").has_value());
  CHECK(gpu::backward_kernel_name(gpu::BackwardKernel::wgmma) == "wgmma");
  CHECK(gpu::backward_kernel_name(gpu::BackwardKernel::mma_sync) == "mma.sync");
}

// The two backwards on the same inputs (the forward's O and LSE), both modes: both within the budget against the
// oracle (run_case's rule), and against each other: pad rows exactly +0 in both, dK and dV within a relative
// Frobenius difference of 1e-2 (P and dS rounded to the dtype at the same points, summed in different orders), dQ
// within 2e-2 (atomic: float32 atomics in another order too). A caller's delta (attention_row_delta, the CP
// executor's way) gives the same bits as the backward's own in the deterministic mode, on both kernels. On a device
// that is not 9.0 the wgmma request must be refused.
TEST_CASE("gpu attention: the wgmma backward against the mma.sync backward") {
  CPGOLD_REQUIRE_DEVICE();
  const bool hopper = device_cc() == 90;
  std::printf("backward kernel on this device (d 128/128 bf16): %s\n",
              gpu::backward_kernel_description({DType::bf16, 2, 2, 128, 128}).c_str());
  std::vector<Case> cases;
  cases.push_back(make_case("bwd A/B causal GQA", DType::bf16, 4, 2, 128, 128, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 51));
  cases.push_back(make_case("bwd A/B window fp16", DType::fp16, 2, 1, 64, 64, {40, 24}, {129, 1, 300, 0, 257}, {100, 1, 300, 0, 260}, 52));
  cases.push_back(make_case("bwd A/B full d64 bf16", DType::bf16, 3, 3, 64, 64, {-1, -1}, {1, 127, 128, 129}, {1, 127, 128, 129}, 53));
  cases.push_back(make_case("bwd A/B causal fp16 L_q > L_kv", DType::fp16, 2, 2, 128, 128, {-1, 0}, {200, 70}, {90, 70}, 54));
  // The head dims carried in padded tiles (32 as 64 columns, 96 as 128) and d_v < d_qk.
  cases.push_back(make_case("bwd A/B causal d96 GQA", DType::bf16, 4, 2, 96, 96, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 55));
  cases.push_back(make_case("bwd A/B window d32 fp16", DType::fp16, 2, 1, 32, 32, {40, 24}, {129, 1, 300, 0, 257}, {100, 1, 300, 0, 260}, 56));
  cases.push_back(make_case("bwd A/B causal 128/64", DType::bf16, 4, 2, 128, 64, {-1, 0}, {1, 127, 128, 129, 300}, {1, 127, 128, 129, 300}, 57));
  // The wide configuration (64 keys per CTA, head-dim columns split between the warpgroups).
  cases.push_back(make_case("bwd A/B causal 256 GQA", DType::bf16, 4, 2, 256, 256, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 58));
  cases.push_back(make_case("bwd A/B window 256 fp16", DType::fp16, 2, 1, 256, 256, {40, 24}, {129, 1, 300, 0, 257}, {100, 1, 300, 0, 260}, 59));
  cases.push_back(make_case("bwd A/B causal 192/128 GQA", DType::bf16, 4, 2, 192, 128, {-1, 0}, kTileEdgeLengths, kTileEdgeLengths, 60));
  cases.push_back(make_case("bwd A/B full 192/128 fp16 L_q > L_kv", DType::fp16, 2, 2, 192, 128, {-1, -1}, {200, 70, 1}, {90, 70, 64}, 61));
  for (const Case& c : cases) {
    const std::string label = describe_case(c);
    INFO(label);
    gpu::HostForward fwd;
    REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd).ok());
    for (gpu::BackwardMode mode : {gpu::BackwardMode::atomic, gpu::BackwardMode::deterministic}) {
      const bool det = mode == gpu::BackwardMode::deterministic;
      const std::string mode_label = label + (det ? " determ" : " atomic");
      INFO(mode_label);
      gpu::HostBackward mma, wg;
      REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, mma,
                                      {gpu::BackwardKernel::mma_sync, false})
                  .ok());
      const gpu::Outcome b = gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, wg,
                                                     {gpu::BackwardKernel::wgmma, false});
      if (!hopper) {
        CHECK(b.status == gpu::Status::unsupported);
        continue;
      }
      INFO(b.message);
      REQUIRE(b.ok());
      const Tensor3<double> qd = tensor_cast<double>(c.q), kd = tensor_cast<double>(c.k),
                            vd = tensor_cast<double>(c.v), dod = tensor_cast<double>(c.dout);
      const ForwardResult<double> oracle_fwd = attention_forward(c.call, qd, kd, vd);
      const BackwardResult<double> oracle = attention_backward(c.call, qd, kd, vd, oracle_fwd.o, oracle_fwd.lse, dod);
      const ForwardResult<float> peer_fwd = attention_forward(c.call, c.q, c.k, c.v, c.dtype);
      const BackwardResult<float> peer =
          attention_backward(c.call, c.q, c.k, c.v, peer_fwd.o, peer_fwd.lse, c.dout, c.dtype);
      check_tensor(mode_label + " wgmma", fx::Quantity::dq, c.dtype, fx::view_of(oracle.dq), fx::view_of(peer.dq),
                   fx::view_of(wg.dq), c.q_valid);
      check_tensor(mode_label + " wgmma", fx::Quantity::dk, c.dtype, fx::view_of(oracle.dk), fx::view_of(peer.dk),
                   fx::view_of(wg.dk), c.kv_valid);
      check_tensor(mode_label + " wgmma", fx::Quantity::dv, c.dtype, fx::view_of(oracle.dv), fx::view_of(peer.dv),
                   fx::view_of(wg.dv), c.kv_valid);
      int64_t pad_nonzero = 0;
      const double rq = rel_diff(mma.dq, wg.dq, c.q_valid, pad_nonzero);
      const double rk = rel_diff(mma.dk, wg.dk, c.kv_valid, pad_nonzero);
      const double rv = rel_diff(mma.dv, wg.dv, c.kv_valid, pad_nonzero);
      std::printf("A/B %-58s dQ rel diff %.3e, dK %.3e, dV %.3e, pad elements not +0: %lld\n", mode_label.c_str(), rq,
                  rk, rv, static_cast<long long>(pad_nonzero));
      CHECK(pad_nonzero == 0);
      CHECK(rk <= 1e-2);
      CHECK(rv <= 1e-2);
      CHECK(rq <= 2e-2);
      if (det) {
        for (gpu::BackwardKernel kernel : {gpu::BackwardKernel::mma_sync, gpu::BackwardKernel::wgmma}) {
          const gpu::HostBackward& own = kernel == gpu::BackwardKernel::wgmma ? wg : mma;
          gpu::HostBackward given;
          REQUIRE(gpu::backward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, given,
                                          {kernel, true})
                      .ok());
          INFO("caller's delta, ", gpu::backward_kernel_name(kernel));
          CHECK(same_values(given.dq, own.dq));
          CHECK(same_values(given.dk, own.dk));
          CHECK(same_values(given.dv, own.dv));
        }
      }
    }
  }
}

// OutsideRows on both backward kernels (the CP executor's steps): with leave_q and leave_kv, the summing form adds
// nothing at the sums' rows that map rows outside the segments (their starting bits stay), and at the rows inside
// adds the same values as a plan without OutsideRows (deterministic mode: dQ, dK, dV bit for bit; atomic mode: dK,
// dV bit for bit, dQ within one dtype ulp).
TEST_CASE("gpu attention: both backward kernels leave rows outside the segments alone with OutsideRows") {
  CPGOLD_REQUIRE_DEVICE();
  const bool hopper = device_cc() == 90;
  for (const auto& d : {std::pair{128, 128}, std::pair{64, 64}, std::pair{128, 64}}) {
    // Pad rows between the sequences and at the tail (make_case's layouts hold them).
    const Case c = make_case("outside rows", d.first == 64 ? DType::fp16 : DType::bf16, 4, 2, d.first, d.second,
                             {-1, 0}, {129, 0, 70}, {129, 0, 70}, 61);
    gpu::HostForward fwd;
    REQUIRE(gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd).ok());
    std::vector<gpu::BackwardKernel> kernels = {gpu::BackwardKernel::mma_sync};
    if (hopper && gpu::wgmma_backward_serves(gpu::shape_of(c.dtype, c.q, c.k, c.v)))
      kernels.push_back(gpu::BackwardKernel::wgmma);
    for (gpu::BackwardKernel kernel : kernels)
      for (gpu::BackwardMode mode : {gpu::BackwardMode::atomic, gpu::BackwardMode::deterministic}) {
        const bool det = mode == gpu::BackwardMode::deterministic;
        const std::string label = describe_case(c) + " " + std::string(gpu::backward_kernel_name(kernel)) +
                                  (det ? " determ" : " atomic");
        INFO(label);
        std::mt19937_64 rng(7);
        std::uniform_real_distribution<float> u(-2.f, 2.f);
        gpu::HostSums start;
        start.dq = Tensor3<float>(c.q.rows, c.q.heads, c.q.dim);
        start.dk = Tensor3<float>(c.k.rows, c.k.heads, c.k.dim);
        start.dv = Tensor3<float>(c.v.rows, c.v.heads, c.v.dim);
        for (Tensor3<float>* x : {&start.dq, &start.dk, &start.dv})
          for (float& v : x->values) v = u(rng);
        for (int64_t r = 0; r < c.q.rows; ++r) start.q_map.push_back(c.q.rows - 1 - r);
        for (int64_t r = 0; r < c.k.rows; ++r) start.kv_map.push_back(c.k.rows - 1 - r);
        gpu::HostSums all = start, leave = start;
        leave.outside = {.leave_q = true, .leave_kv = true};
        REQUIRE(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, all,
                                            {kernel, true})
                    .ok());
        REQUIRE(gpu::backward_sum_on_device(c.call, c.dtype, c.q, c.k, c.v, fwd.o, fwd.lse, c.dout, mode, leave,
                                            {kernel, true})
                    .ok());
        int64_t touched_outside = 0, differ_inside = 0;
        auto compare = [&](const Tensor3<float>& s0, const Tensor3<float>& a, const Tensor3<float>& l,
                           const std::vector<int64_t>& map, const std::vector<uint8_t>& valid, bool exact) {
          const int64_t w = s0.heads * s0.dim;
          for (int64_t r = 0; r < static_cast<int64_t>(map.size()); ++r)
            for (int64_t e = 0; e < w; ++e) {
              const size_t at = static_cast<size_t>(map[static_cast<size_t>(r)] * w + e);
              if (!valid[static_cast<size_t>(r)]) {
                touched_outside += std::memcmp(&l.values[at], &s0.values[at], 4) != 0 ? 1 : 0;
                continue;
              }
              const bool ok = exact ? std::memcmp(&l.values[at], &a.values[at], 4) == 0
                                    : std::fabs(l.values[at] - a.values[at]) <=
                                          std::ldexp(std::fabs(a.values[at] - s0.values[at]), -6) +
                                              std::ldexp(std::fabs(a.values[at]), -22);
              differ_inside += ok ? 0 : 1;
            }
        };
        compare(start.dq, all.dq, leave.dq, start.q_map, c.q_valid, det);
        compare(start.dk, all.dk, leave.dk, start.kv_map, c.kv_valid, true);
        compare(start.dv, all.dv, leave.dv, start.kv_map, c.kv_valid, true);
        std::printf("VERDICT outside rows %-60s %lld outside values touched, %lld inside values differ\n",
                    label.c_str(), static_cast<long long>(touched_outside), static_cast<long long>(differ_inside));
        CHECK(touched_outside == 0);
        CHECK(differ_inside == 0);
      }
  }
}

namespace {

// A CP-step-like call: `lengths.size()` sequences, each split as for rank r of a CP group of size 4 into 8 chunks of
// L rows (L from `lengths`); Q holds rank r's chunks r and 7 - r, KV the chunks j and 7 - j of a rank j <= r (j == r:
// the diagonal step), at their global positions; segments separated by 0..3 NaN pad rows.
Case make_chunk_case(std::string name, DType dtype, int hq, int hkv, int d, int dv, Window window,
                     const std::vector<int32_t>& lengths, uint64_t seed) {
  Case c(std::move(name), dtype, hq, hkv, d, dv);
  c.call.window = window;
  c.call.softmax_scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::mt19937_64 rng(seed);
  int64_t q_row = 0, kv_row = 0;
  for (int32_t len : lengths) {
    const int r = static_cast<int>(rng() % 4), j = static_cast<int>(rng() % (r + 1));
    SequenceTile s;
    s.length_q = s.length_kv = 8 * len;
    for (int chunk : {r, 7 - r}) {
      q_row += static_cast<int64_t>(rng() % 4);
      s.q.push_back({q_row, len, chunk * len});
      q_row += len;
    }
    for (int chunk : {j, 7 - j}) {
      kv_row += static_cast<int64_t>(rng() % 4);
      s.kv.push_back({kv_row, len, chunk * len});
      kv_row += len;
    }
    c.call.sequences.push_back(s);
  }
  c.call.q_rows = q_row + 2;
  c.call.kv_rows = kv_row + 2;
  fill_inputs(c, seed + 1);
  return c;
}

bool same_forward_bits(const gpu::HostForward& a, const gpu::HostForward& b) {
  return a.o.values.size() == b.o.values.size() && a.lse.values.size() == b.lse.values.size() &&
         std::memcmp(a.o.values.data(), b.o.values.data(), a.o.values.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.values.data(), b.lse.values.data(), a.lse.values.size() * sizeof(float)) == 0;
}

}  // namespace

// docs/gpu-kernels.md, "Forward schedules": every schedule of the wgmma forward on short-chunk CP-step calls (two Q
// and two KV segments per sequence mid-sequence, chunks of 1..300 rows, GQA, causal, full and windows) within the
// budget against the oracle with the exact classes; the persistent grid bit for bit equal to one CTA per tile at the
// same tile height (each work item is computed the same way). Enough items that every persistent CTA loops.
TEST_CASE("gpu attention: wgmma forward schedules on short CP-step chunks") {
  CPGOLD_REQUIRE_DEVICE();
  if (device_cc() != 90) {
    std::printf("SKIPPED: the wgmma forward schedules need a device of compute capability 9.0\n");
    return;
  }
  const std::vector<int32_t> lengths = {1, 7, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 300,
                                        3, 48, 96, 150, 17, 80, 40, 120};
  std::vector<Case> cases;
  cases.push_back(make_chunk_case("chunks causal GQA", DType::bf16, 8, 2, 128, 128, {-1, 0}, lengths, 51));
  cases.push_back(make_chunk_case("chunks full MQA", DType::fp16, 8, 1, 64, 64, {-1, -1}, lengths, 52));
  cases.push_back(make_chunk_case("chunks window", DType::bf16, 8, 4, 128, 128, {70, 0}, lengths, 53));
  cases.push_back(make_chunk_case("chunks window both sides MLA", DType::bf16, 8, 2, 192, 128, {90, 30}, lengths, 54));
  const std::vector<gpu::ForwardSchedule> schedules = {
      gpu::ForwardSchedule::tile128, gpu::ForwardSchedule::persistent128, gpu::ForwardSchedule::tile64,
      gpu::ForwardSchedule::persistent64, gpu::ForwardSchedule::automatic, gpu::ForwardSchedule::persistent};
  for (const Case& c : cases) {
    const std::string label = describe_case(c);
    INFO(label);
    const ForwardResult<double> oracle =
        attention_forward(c.call, tensor_cast<double>(c.q), tensor_cast<double>(c.k), tensor_cast<double>(c.v));
    const ForwardResult<float> peer = attention_forward(c.call, c.q, c.k, c.v, c.dtype);
    std::vector<gpu::HostForward> out(schedules.size());
    for (size_t i = 0; i < schedules.size(); ++i) {
      const std::string sl = label + " " + std::string(gpu::forward_schedule_name(schedules[i]));
      INFO(sl);
      const gpu::Outcome r =
          gpu::forward_on_device(c.call, c.dtype, c.q, c.k, c.v, out[i], gpu::ForwardKernel::wgmma, schedules[i]);
      INFO(r.message);
      REQUIRE(r.ok());
      check_tensor(sl, fx::Quantity::o, c.dtype, fx::view_of(oracle.o), fx::view_of(peer.o), fx::view_of(out[i].o),
                   c.q_valid);
      check_tensor(sl, fx::Quantity::lse, c.dtype, fx::view_of(oracle.lse), fx::view_of(peer.lse),
                   fx::view_of(out[i].lse), c.q_valid);
    }
    const bool eq128 = same_forward_bits(out[0], out[1]), eq64 = same_forward_bits(out[2], out[3]);
    std::printf("SCHEDULES %-60s tile128 == persistent128: %s, tile64 == persistent64: %s\n", label.c_str(),
                eq128 ? "bitwise" : "DIFFER", eq64 ? "bitwise" : "DIFFER");
    CHECK(eq128);
    CHECK(eq64);
    // Automatic and persistent resolve to one of the four; they equal it bit for bit.
    AttentionCall call = c.call;
    gpu::AttentionPlan plan;
    REQUIRE(plan.build(call, {c.dtype, c.heads_q, c.heads_kv, c.dim_qk, c.dim_v}).ok());
    for (size_t i = 4; i < schedules.size(); ++i) {
      gpu::ForwardScheduleChoice ch;
      REQUIRE(gpu::forward_schedule_for(plan, schedules[i], ch).ok());
      const size_t same = (ch.tile_rows == 128 ? 0 : 2) + (ch.persistent ? 1 : 0);
      std::printf("SCHEDULES %-60s %s -> tile %d, %s\n", label.c_str(),
                  std::string(gpu::forward_schedule_name(schedules[i])).c_str(), ch.tile_rows,
                  ch.persistent ? "persistent" : "one CTA per tile");
      CHECK(same_forward_bits(out[i], out[same]));
    }
  }
}
