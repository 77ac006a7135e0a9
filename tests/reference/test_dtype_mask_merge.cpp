// Rounding to bf16/fp16, window normalisation and visibility, LSE merge.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

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
