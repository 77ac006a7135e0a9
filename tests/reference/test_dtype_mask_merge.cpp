// Rounding to bf16/fp16, window normalisation and visibility, LSE merge.
#include <doctest/doctest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "reference/dtype.hpp"
#include "reference/input_error.hpp"
#include "reference/lse_merge.hpp"
#include "reference/mask.hpp"

using namespace cpgold;

TEST_CASE("bf16 rounding is round-to-nearest-even, from float and from double") {
  CHECK(round_to(DType::bf16, 1.0f + 0x1p-8f) == 1.0f);                // tie -> even
  CHECK(round_to(DType::bf16, 1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);  // tie -> even (up)
  CHECK(round_to(DType::bf16, 1.0f + 0x1p-9f) == 1.0f);
  // Just above the tie: a double that rounds to the tie in float must still round up in bf16.
  CHECK(round_to(DType::bf16, 1.0 + 0x1p-8 + 0x1p-30) == 1.0f + 0x1p-7f);
  CHECK(round_to(DType::bf16, -(1.0 + 0x1p-8 + 0x1p-30)) == -(1.0f + 0x1p-7f));
  CHECK(std::isinf(round_to(DType::bf16, 0x1p128)));
  CHECK(std::isnan(round_to(DType::bf16, std::nan(""))));
  CHECK(round_to(DType::fp32, 1.0 + 0x1p-30) == 1.0f);
}

TEST_CASE("fp16 rounding covers subnormals and overflow") {
  CHECK(round_to(DType::fp16, 65504.0) == 65504.0f);
  CHECK(std::isinf(round_to(DType::fp16, 65520.0)));   // rounds past the largest finite
  CHECK(round_to(DType::fp16, 65519.0) == 65504.0f);
  CHECK(round_to(DType::fp16, 0x1p-24) == 0x1p-24f);  // smallest subnormal
  CHECK(round_to(DType::fp16, 0x1p-25) == 0.0f);      // tie -> even (0)
  CHECK(round_to(DType::fp16, 3 * 0x1p-26) == 0x1p-24f);
  CHECK(round_to(DType::fp16, 1.0 + 0x1p-11 + 0x1p-40) == 1.0f + 0x1p-10f);
  CHECK(round_to(DType::fp16, 1.0f + 0x1p-11f) == 1.0f);
  // The float path and the exact double path agree wherever the float input is exact.
  for (float x : {0.1f, -3.7f, 1234.5f, 1e-6f, 7.25e-5f}) {
    CHECK(round_to(DType::fp16, static_cast<double>(x)) == round_to(DType::fp16, x));
    CHECK(round_to(DType::bf16, static_cast<double>(x)) == round_to(DType::bf16, x));
  }
}

namespace {
// The textbook formulation the bit-level rounding must equal: frexp, scale, nearbyint (ties to even), scale back.
double round_to_format_reference(double x, int precision, int min_exponent, double max_finite) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int exponent = 0;
  std::frexp(x, &exponent);
  const int unit_exponent = std::max(exponent - 1, min_exponent) - (precision - 1);
  const double rounded = std::ldexp(std::nearbyint(std::ldexp(x, -unit_exponent)), unit_exponent);
  if (std::fabs(rounded) > max_finite) return std::copysign(INFINITY, x);
  return rounded;
}
bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }
}  // namespace

TEST_CASE("bit-level rounding equals the reference formulation and Eigen's conversions, value for value") {
  uint64_t state = 2026;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state;
  };
  std::vector<double> doubles = {0x1p-1074, -0x1p-1074, 0x1p-1022, 0x1p-149, 0x1p-150, 0x1.8p-150, 0x1p-133,
                                 0x1p-134, 0x1.8p-134, 0x1p-25, 0x1.0000001p-25, 65519.99, 65520.0, 0x1.FFp127,
                                 0x1.FF8p127, 1e300, -1e300, 1.0 + 0x1p-8, 1.0 + 3 * 0x1p-8, 0.3, -0.3, 1.3};
  for (int i = 0; i < 200000; ++i) {
    const uint64_t bits = next();
    double x;
    if (i % 3 == 0) {  // any double
      std::memcpy(&x, &bits, 8);
    } else {  // around the formats' ranges, ties included (few low bits)
      const int exponent = static_cast<int>(bits % 330) - 170;
      const double m = 1.0 + static_cast<double>((bits >> 20) & 0xffff) * 0x1p-16;
      x = std::ldexp((bits >> 63) ? -m : m, exponent);
    }
    doubles.push_back(x);
  }
  for (double x : doubles) {
    CAPTURE(x);
    const float bf = round_to(DType::bf16, x), hf = round_to(DType::fp16, x);
    const float bf_ref = static_cast<float>(round_to_format_reference(x, 8, -126, 0x1.FEp127));
    const float hf_ref = static_cast<float>(round_to_format_reference(x, 11, -14, 65504.0));
    if (std::isnan(x)) {
      CHECK((std::isnan(bf) && std::isnan(hf)));
      continue;
    }
    CHECK(same_bits(bf, bf_ref));
    CHECK(same_bits(hf, hf_ref));
  }
  // Float rounding: Eigen's conversions, NaN payloads included; and round_in_place gives the same values.
  std::vector<float> floats = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity(), 0x1.FFFFFEp127f, 0x1p-149f, -0.0f};
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(next() >> 32);
    float x;
    std::memcpy(&x, &bits, 4);
    floats.push_back(x);
  }
  std::vector<float> bf_in_place = floats, hf_in_place = floats;
  round_in_place(DType::bf16, bf_in_place.data(), static_cast<int64_t>(floats.size()));
  round_in_place(DType::fp16, hf_in_place.data(), static_cast<int64_t>(floats.size()));
  for (size_t i = 0; i < floats.size(); ++i) {
    const float x = floats[i];
    CAPTURE(x);
    CHECK(same_bits(round_to(DType::bf16, x), static_cast<float>(Eigen::bfloat16(x))));
    CHECK(same_bits(bf_in_place[i], round_to(DType::bf16, x)));
    CHECK(same_bits(hf_in_place[i], round_to(DType::fp16, x)));
  }
}

TEST_CASE("dtype names parse and unknown ones name the field") {
  CHECK(parse_dtype("bf16") == DType::bf16);
  CHECK(dtype_name(DType::fp16) == "fp16");
  try {
    parse_dtype("fp8", "dtype");
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find("dtype") != std::string::npos);
    CHECK(std::string(e.what()).find("fp8") != std::string::npos);
  }
}

TEST_CASE("windows normalise as FlashAttention-3 and masks use bottom-right alignment") {
  CHECK(normalize_window(true, {-1, -1}) == Window{-1, 0});
  CHECK(normalize_window(true, {128, 512}) == Window{128, 0});
  CHECK(normalize_window(false, {128, 512}) == Window{128, 512});
  CHECK(is_causal(Window{-1, 0}));
  CHECK_FALSE(is_causal(Window{5, 0}));
  CHECK(describe(Window{-1, -1}) == "none");
  CHECK(describe(Window{-1, 0}) == "causal");
  CHECK(describe(Window{3, 0}) == "window(3,0)");
  CHECK(drop_unbounded_sides(Window{99, 99}, 50, 100) == Window{-1, -1});
  CHECK(drop_unbounded_sides(Window{98, 10}, 50, 100) == Window{98, 10});
  CHECK(drop_unbounded_sides(Window{5, 60}, 50, 100) == Window{5, -1});
  CHECK(drop_unbounded_sides(Window{98, 0}, 50, 100) == Window{98, 0});
  // sq = 2, sk = 5, causal: row 0 sees keys 0..3, row 1 sees 0..4 (delta = 3).
  const Window causal{-1, 0};
  CHECK(visible(causal, 0, 3, 3));
  CHECK_FALSE(visible(causal, 0, 4, 3));
  CHECK(visible(causal, 1, 4, 3));
  // sq = 5, sk = 2 (delta = -3): rows 0..2 see nothing, row 3 sees key 0.
  CHECK_FALSE(visible(causal, 2, 0, -3));
  CHECK(visible(causal, 3, 0, -3));
  CHECK_FALSE(visible(causal, 3, 1, -3));
  const Window local{2, 1};
  CHECK_FALSE(visible(local, 10, 7, 0));
  CHECK(visible(local, 10, 8, 0));
  CHECK(visible(local, 10, 11, 0));
  CHECK_FALSE(visible(local, 10, 12, 0));
}

TEST_CASE("LSE merge is stable and guards empty partials") {
  const double ninf = -std::numeric_limits<double>::infinity();
  CHECK(lse_merge(ninf, ninf) == ninf);
  CHECK(lse_merge(0.5, ninf) == 0.5);
  CHECK(lse_merge(ninf, 0.5) == 0.5);
  CHECK(lse_merge(1000.0, 1000.0) == doctest::Approx(1000.0 + std::log(2.0)).epsilon(1e-15));
  CHECK(lse_merge(-1000.0f, -1000.0f) == doctest::Approx(-1000.0 + std::log(2.0)).epsilon(1e-6));
  CHECK(lse_merge(3.0, 1.0) == lse_merge(1.0, 3.0));
  CHECK(lse_weight(ninf, 0.0) == 0.0);
  double o[2] = {0.0, 0.0}, lse = ninf;
  const double a[2] = {1.0, 2.0}, b[2] = {3.0, 4.0};
  merge_partial_row(o, lse, a, std::log(1.0), 2);
  merge_partial_row(o, lse, b, std::log(3.0), 2);
  CHECK(lse == doctest::Approx(std::log(4.0)));
  CHECK(o[0] == doctest::Approx(0.25 * 1.0 + 0.75 * 3.0));
  CHECK(o[1] == doctest::Approx(0.25 * 2.0 + 0.75 * 4.0));
  double e[1] = {0.0}, le = ninf;
  const double z[1] = {0.0};
  merge_partial_row(e, le, z, ninf, 1);
  CHECK(le == ninf);
  CHECK(e[0] == 0.0);
  CHECK_FALSE(std::isnan(e[0]));
}
