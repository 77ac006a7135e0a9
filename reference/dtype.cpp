#include "reference/dtype.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "reference/input_error.hpp"

namespace cpgold {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::fp32: return "fp32";
  }
  return "?";
}

DType parse_dtype(std::string_view text, const std::string& field) {
  if (text == "bf16") return DType::bf16;
  if (text == "fp16") return DType::fp16;
  if (text == "fp32") return DType::fp32;
  fail_input(field, "unknown dtype '", text, "' (expected bf16, fp16 or fp32)");
}

int dtype_bytes(DType dtype) { return dtype == DType::fp32 ? 4 : 2; }

float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::bf16: return static_cast<float>(Eigen::bfloat16(value));
    case DType::fp16: return static_cast<float>(Eigen::half(value));
    case DType::fp32: return value;
  }
  return value;
}

namespace {
// Rounds x to a binary format with `precision` significand bits (implicit bit included), minimum normal
// exponent `min_exponent` (value 2^min_exponent) and largest finite `max_finite`; round to nearest even.
// Going double -> float -> bf16 would round twice and can be off by one unit in the last place.
double round_to_format(double x, int precision, int min_exponent, double max_finite) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int exponent = 0;
  std::frexp(x, &exponent);  // x = m * 2^exponent with 0.5 <= |m| < 1
  const int unit_exponent = std::max(exponent - 1, min_exponent) - (precision - 1);
  const double rounded = std::ldexp(std::nearbyint(std::ldexp(x, -unit_exponent)), unit_exponent);
  if (std::fabs(rounded) > max_finite) return std::copysign(INFINITY, x);
  return rounded;
}
}  // namespace

float round_to(DType dtype, double value) {
  switch (dtype) {
    case DType::bf16: return static_cast<float>(round_to_format(value, 8, -126, 0x1.FEp127));
    case DType::fp16: return static_cast<float>(round_to_format(value, 11, -14, 65504.0));
    case DType::fp32: return static_cast<float>(value);
  }
  return static_cast<float>(value);
}

}  // namespace cpgold
