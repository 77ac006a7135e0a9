// CPU twins of the THD CP helper kernels (docs/cp-layout.md, "Helper kernels") on the vectors of its "Worked example"
// and "TE test configurations", with coded values: element (row, head, x) holds a number that names the row it came
// from, so every check says where a value landed.
#include <doctest/doctest.h>

#include <cmath>
#include <algorithm>
#include <limits>
#include <random>

#include "reference/input_error.hpp"
#include "reference/lse_merge.hpp"
#include "sim/thd_helpers/grad_correction.hpp"
#include "sim/thd_helpers/lse_halves.hpp"
#include "sim/thd_helpers/out_correction.hpp"
#include "sim/thd_helpers/reorder.hpp"
#include "sim/plan/step_rows.hpp"

using namespace cpgold;
using namespace cpgold::sim;

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// [rows, heads, dim] with element (r, h, x) = base + 100 * r + 10 * h + x (exact in float32).
Tensor3<float> coded(int64_t rows, int heads, int dim, float base = 0) {
  Tensor3<float> t(rows, heads, dim);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int x = 0; x < dim; ++x) t(r, h, x) = base + 100.f * r + 10.f * h + x;
  return t;
}

// §2.4: W = 2, cuP = [0, 8, 16] -> rank-local offsets cuPl = [0, 4, 8], half offsets [0, 2, 4].
const std::vector<int32_t> kCuLocal = {0, 4, 8};
}  // namespace

TEST_CASE("sequence_of_row is TransformerEngine's binary search, zero-length sequences included") {
  const std::vector<int32_t> cu = {0, 0, 4, 4, 8};
  CHECK(sequence_of_row(cu, 0) == 1);
  CHECK(sequence_of_row(cu, 3) == 1);
  CHECK(sequence_of_row(cu, 4) == 3);
  CHECK(sequence_of_row(cu, 7) == 3);
  CHECK(sequence_of_row(cu, 1, 2) == 1);  // cu_s = cu / 2 = [0, 0, 2, 2, 4]
  CHECK(sequence_of_row(cu, 2, 2) == 3);
}

TEST_CASE("step rows of §2.4: half 0 is chunk r, half 1 is chunk 2W-1-r of every sequence") {
  const StepRows first(kCuLocal, HalfSelect::first), second(kCuLocal, HalfSelect::second), full(kCuLocal, HalfSelect::full);
  CHECK(first.rows() == 4);
  CHECK(full.rows() == 8);
  const int64_t expect_first[] = {0, 1, 4, 5}, expect_second[] = {2, 3, 6, 7};
  for (int x = 0; x < 4; ++x) {
    CHECK(first.at(x).local_row == expect_first[x]);
    CHECK(second.at(x).local_row == expect_second[x]);
    CHECK(second.at(x).column == x % 2);
    CHECK(second.at(x).local_column == x % 2 + 2);
  }
  CHECK(full.at(5).sequence == 1);
  CHECK(full.at(5).column == 1);
  // Partition view of the same layout: read_half agrees with the StepRows map.
  const SidePartition p(make_packed_sequences({5, 8}, {8, 8}, -1, "q"), 2, "q");
  for (int x = 0; x < 4; ++x) CHECK(p.read_half_rows(1)[static_cast<size_t>(x)] == expect_second[x]);
}

TEST_CASE("offset facts: ordered exactly when check_offsets passes, gcd of the lengths") {
  const OffsetFacts f = offset_facts({0, 8, 8, 24, 48});
  CHECK(f.ordered);
  CHECK(f.length_gcd == 8);
  CHECK(offset_facts({0, 0, 0}).ordered);
  CHECK(offset_facts({0, 0, 0}).length_gcd == 0);
  CHECK(offset_facts({0, 6, 16}).length_gcd == 2);
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{0}, {1, 4}, {0, 4, 2}, {-2, 4}}) {
    CHECK_FALSE(offset_facts(bad).ordered);
    CHECK_THROWS_AS(check_offsets(bad, "cu"), InputError);
  }
}

TEST_CASE("step rows reject odd local lengths and decreasing offsets, naming the entry") {
  try {
    StepRows bad({0, 4, 7}, HalfSelect::second);
    FAIL("expected InputError");
  } catch (const InputError& e) {
    CHECK(e.field() == "cu_seqlens_padded[2]");
  }
  CHECK_THROWS_AS(StepRows({0, 4, 2}, HalfSelect::full), InputError);
  CHECK_THROWS_AS(StepRows({1, 4}, HalfSelect::full), InputError);
}

TEST_CASE("copy of valid tokens: cuP_step = [2, 6, 12], cu = [0, 3, 7] (cp-semantics §8)") {
  Tensor3<float> out(14, 2, 3, -1.f);
  const Tensor3<float> in = coded(14, 2, 3);
  copy_valid_rows(out, in, {2, 6, 12}, {0, 3, 7});
  // Sequence 0 valid rows 2, 3, 4; sequence 1 valid rows 6..9; rows 0-1 (before cuP_step[0]), 5, 10-13 untouched.
  const std::vector<int> copied = {2, 3, 4, 6, 7, 8, 9};
  for (int64_t r = 0; r < 14; ++r) {
    const bool expect = std::find(copied.begin(), copied.end(), r) != copied.end();
    CHECK(out(r, 1, 2) == (expect ? 100.f * r + 12.f : -1.f));
  }
}

TEST_CASE("read_second_half_lse, packed [h, S2] zero-initialised (§2.4 layout)") {
  const StepRows rows(kCuLocal, HalfSelect::second);
  const LseShape full{true, 2, 2, 8}, half{true, 2, 2, 5};
  std::vector<float> lse(16);
  for (int k = 0; k < 2; ++k)
    for (int r = 0; r < 8; ++r) lse[static_cast<size_t>(k * 8 + r)] = 100.f * k + r;
  const std::vector<float> got = read_second_half_lse(lse, full, half, rows);
  // Second-half rows of the rank-local tensor are 2, 3 (sequence 0) and 6, 7 (sequence 1); column 4 stays 0.
  CHECK(got == std::vector<float>{2, 3, 6, 7, 0, 102, 103, 106, 107, 0});
}

TEST_CASE("read_second_half_lse, unpacked [B, h, S] -> [B, h, S/2]") {
  const StepRows rows(kCuLocal, HalfSelect::second);
  const LseShape full{false, 2, 2, 4}, half{false, 2, 2, 2};
  std::vector<float> lse(16);
  for (int s = 0; s < 2; ++s)
    for (int k = 0; k < 2; ++k)
      for (int c = 0; c < 4; ++c) lse[static_cast<size_t>((s * 2 + k) * 4 + c)] = 1000.f * s + 100.f * k + c;
  const std::vector<float> got = read_second_half_lse(lse, full, half, rows);
  CHECK(got == std::vector<float>{2, 3, 102, 103, 1002, 1003, 1102, 1103});
}

TEST_CASE("second-half LSE correction merges by logaddexp only on the second-half rows") {
  const StepRows rows(kCuLocal, HalfSelect::second);
  const LseShape full{true, 1, 2, 8}, half{true, 1, 2, 4};
  std::vector<float> lse = {0, 0, std::log(2.f), kNegInf, 0, 0, 1.f, 5.f};
  const std::vector<float> lse_half = {std::log(3.f), 7.f, kNegInf, 2.f};
  second_half_lse_correction(lse, full, lse_half, half, rows);
  CHECK(lse[0] == 0.f);
  CHECK(lse[1] == 0.f);
  CHECK(lse[4] == 0.f);
  CHECK(lse[2] == doctest::Approx(std::log(5.0)).epsilon(1e-6));  // log(2) (+) log(3) = log(5)
  CHECK(lse[3] == 7.f);                                           // -inf (+) 7 = 7 exactly
  CHECK(lse[6] == 1.f);                                           // 1 (+) -inf = 1 exactly
  CHECK(lse[7] == doctest::Approx(5.0 + std::log1p(std::exp(-3.0))).epsilon(1e-6));
  std::vector<float> short_lse(7);
  CHECK_THROWS_AS(second_half_lse_correction(short_lse, {true, 1, 2, 7}, lse_half, half, rows), InputError);
}

TEST_CASE("the float logaddexp of the LSE correction is within 2 ulp of the double formula") {
  // Error in ulp of max(|max(a, b)|, |result|, ln 2): the float sum max + log1p(...) rounds both terms, so near a zero
  // result (a = -0.52, b = -0.90) only an absolute bound holds, as for TransformerEngine's float expf / log1pf.
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> level(-30.f, 30.f), diff(-110.f, 110.f);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float a = i % 5 == 0 ? 0.f : level(rng), b = a + diff(rng);
    const float got = lse_logaddexp(a, b), want = static_cast<float>(lse_merge<double>(a, b));
    const float scale = std::max({std::fabs(std::max(a, b)), std::fabs(want), 0.6931472f});
    const double ulp = std::ldexp(1.0, std::ilogb(scale) - 23);
    worst = std::max(worst, std::fabs(static_cast<double>(got) - want) / ulp);
  }
  CHECK(worst <= 2.0);
  CHECK(lse_logaddexp(0.f, 0.f) == doctest::Approx(std::log(2.0)).epsilon(2e-7));
  CHECK(lse_logaddexp(kNegInf, kNegInf) == kNegInf);
  CHECK(lse_logaddexp(3.f, kNegInf) == 3.f);
  CHECK(lse_logaddexp(0.f, -100.f) > 0.f);  // exp(-100) = 3.7e-44: a subnormal, kept, not flushed
  CHECK(lse_logaddexp(0.f, -105.f) == 0.f);
}

TEST_CASE("out correction: second-half rows, weight exp(lse_i - lse), zero guard, addition in the output dtype") {
  const StepRows rows(kCuLocal, HalfSelect::second);
  const LseShape full{true, 2, 2, 8}, step{true, 2, 2, 4};
  Tensor3<float> out(8, 2, 3, 0.f);
  const Tensor3<float> out_i = coded(4, 2, 3, 1);
  const std::vector<float> lse(16, 0.5f), lse_i(8, 0.5f);  // weight exactly 1
  out_correction(out, out_i, lse, full, lse_i, step, rows, DType::fp32);
  const int64_t dest[] = {2, 3, 6, 7};
  for (int x = 0; x < 4; ++x)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 3; ++e) CHECK(out(dest[x], h, e) == 1.f + 100.f * x + 10.f * h + e);
  for (int64_t r : {0, 1, 4, 5}) CHECK(out(r, 1, 2) == 0.f);

  // Weight 1/2 from lse_i - lse = -log 2 (exactly representable difference chosen: exp(-0.6931472f) rounds to 0.5).
  Tensor3<float> half_out(8, 1, 1, 0.f);
  Tensor3<float> v(4, 1, 1, 3.f);
  std::vector<float> l(8, 1.f), li(4, 1.f - 0.6931472f);
  out_correction(half_out, v, l, {true, 1, 2, 8}, li, {true, 1, 2, 4}, rows, DType::fp32);
  CHECK(half_out(2, 0, 0) == doctest::Approx(1.5f).epsilon(1e-6));

  // Zero guard: v == 0 adds nothing even with a NaN weight (garbage LSE of pad rows).
  Tensor3<float> guarded(8, 1, 1, 2.f);
  const Tensor3<float> zeros(4, 1, 1, 0.f);
  std::vector<float> nan_lse(8, std::numeric_limits<float>::quiet_NaN());
  out_correction(guarded, zeros, nan_lse, {true, 1, 2, 8}, nan_lse, {true, 1, 2, 4}, rows, DType::fp32);
  CHECK(guarded(2, 0, 0) == 2.f);

  // bf16: 1 + 2^-9 rounds back to 1 (8 significand bits); fp32 keeps it.
  Tensor3<float> ones(8, 1, 1, 1.f), ones32(8, 1, 1, 1.f);
  const Tensor3<float> tiny(4, 1, 1, std::ldexp(1.f, -9));
  const std::vector<float> l0(8, 0.f), li0(4, 0.f);
  out_correction(ones, tiny, l0, {true, 1, 2, 8}, li0, {true, 1, 2, 4}, rows, DType::bf16);
  out_correction(ones32, tiny, l0, {true, 1, 2, 8}, li0, {true, 1, 2, 4}, rows, DType::fp32);
  CHECK(ones(2, 0, 0) == 1.f);
  CHECK(ones32(2, 0, 0) == 1.f + std::ldexp(1.f, -9));
}

TEST_CASE("out correction, unpacked LSE and a full step") {
  const StepRows rows(kCuLocal, HalfSelect::full);
  Tensor3<float> out(8, 1, 1, 0.f);
  const Tensor3<float> out_i = coded(8, 1, 1, 1);
  // lse_i = lse + log(2) at (sequence 1, column 1) only: local row 5 gets twice its value.
  std::vector<float> lse(8, 0.f), lse_i(8, 0.f);
  lse_i[1 * 4 + 1] = 0.6931472f;
  out_correction(out, out_i, lse, {false, 1, 2, 4}, lse_i, {false, 1, 2, 4}, rows, DType::fp32);
  for (int r = 0; r < 8; ++r)
    CHECK(out(r, 0, 0) == doctest::Approx((1.f + 100.f * r) * (r == 5 ? 2.f : 1.f)).epsilon(1e-6));
}

TEST_CASE("grad correction, all six modes of TransformerEngine on the §2.4 layout") {
  struct Mode {
    GradOp first, second;
    int64_t step_rows;
  };
  const Mode modes[] = {{GradOp::copy, GradOp::none, 4}, {GradOp::add, GradOp::none, 4},
                        {GradOp::none, GradOp::copy, 4}, {GradOp::none, GradOp::add, 4},
                        {GradOp::add, GradOp::copy, 8},  {GradOp::copy, GradOp::add, 8}};
  for (const Mode& m : modes) {
    const StepRows rows(kCuLocal, grad_step_rows(m.first, m.second));
    Tensor3<float> grad = coded(8, 1, 2, 0.5f);
    const Tensor3<float> before = grad;
    const Tensor3<float> gi = coded(m.step_rows, 1, 2, 10000.f);
    grad_correction(grad, gi, rows, m.first, m.second, DType::fp32);
    for (int64_t r = 0; r < 8; ++r) {
      // Expected by hand: local rows 0,1 / 4,5 are the first half (chunk r), 2,3 / 6,7 the second (chunk 2W-1-r).
      const bool first_half = (r % 4) < 2;
      const GradOp op = first_half ? m.first : m.second;
      const int64_t x = m.step_rows == 8 ? r : (r / 4) * 2 + (r % 2);  // step row feeding local row r
      const float g = before(r, 0, 1), add = gi.values.empty() ? 0.f : gi(x, 0, 1);
      const float expect = op == GradOp::none ? g : (op == GradOp::copy ? add : g + add);
      CHECK(grad(r, 0, 1) == expect);
    }
  }
  CHECK_THROWS_AS(grad_step_rows(GradOp::none, GradOp::none), InputError);
  CHECK_THROWS_AS(grad_step_rows(GradOp::add, GradOp::add), InputError);
  // Addition in the gradient dtype: bf16 1 + 2^-9 stays 1.
  const StepRows rows(kCuLocal, HalfSelect::full);
  Tensor3<float> g(8, 1, 1, 1.f);
  grad_correction(g, Tensor3<float>(8, 1, 1, std::ldexp(1.f, -9)), rows, GradOp::add, GradOp::copy, DType::bf16);
  CHECK(g(0, 0, 0) == 1.f);
  CHECK(g(2, 0, 0) == std::ldexp(1.f, -9));
  try {
    Tensor3<float> wrong(8, 1, 1);
    grad_correction(wrong, Tensor3<float>(5, 1, 1), StepRows(kCuLocal, HalfSelect::first), GradOp::copy,
                    GradOp::none, DType::fp32);
    FAIL("expected InputError");
  } catch (const InputError& e) {
    CHECK(e.field() == "step_rows");
  }
}
