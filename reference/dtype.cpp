#include "reference/dtype.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>

#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"

namespace cpgold {

constexpr std::pair<DType, std::string_view> kDTypeNames[] = {
    {DType::bf16, "bf16"}, {DType::fp16, "fp16"}, {DType::fp32, "fp32"}};

std::string_view dtype_name(DType dtype) { return name_in(kDTypeNames, dtype); }

DType parse_dtype(std::string_view text, const std::string& field) {
  if (auto dtype = parse_in(kDTypeNames, text)) return *dtype;
  fail_input(field, "unknown dtype '", text, "' (expected bf16, fp16 or fp32)");
}

int dtype_bytes(DType dtype) { return dtype == DType::fp32 ? 4 : 2; }

float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::bf16: return round_to_bf16(value);
    case DType::fp16: return static_cast<float>(Eigen::half(value));
    case DType::fp32: return value;
  }
  return value;
}

namespace {
// Rounds x to a binary format with `precision` significand bits (implicit bit included), minimum normal
// exponent `min_exponent` (value 2^min_exponent) and largest finite `max_finite`; round to nearest even.
// Going double -> float -> bf16 would round twice and can be off by one unit in the last place.
// Integer arithmetic on the double's bits: x = m * 2^(e - 52) with the 53-bit significand m; the result is m rounded
// to a multiple of 2^d, d the bits below the format's unit 2^u at x's exponent (or its subnormal unit).
double round_to_format(double x, int precision, int min_exponent, double max_finite) {
  uint64_t bits;
  std::memcpy(&bits, &x, 8);
  const uint64_t sign = bits & 0x8000000000000000ull, magnitude = bits & ~0x8000000000000000ull;
  const int biased = static_cast<int>(magnitude >> 52);
  if (biased == 0x7ff || magnitude == 0) return x;  // inf, NaN, +-0
  // A double subnormal (|x| < 2^-1022) lies far below every format's smallest subnormal: it rounds to zero.
  if (biased == 0) return sign ? -0.0 : 0.0;
  const int exponent = biased - 1023;
  const uint64_t m = (magnitude & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52);
  const int unit = std::max(exponent, min_exponent) - (precision - 1);
  const int d = unit - (exponent - 52);  // >= 53 - precision > 0
  uint64_t q;
  if (d > 60) {
    q = 0;  // x < 2^(unit - 7): below half a unit
  } else {
    q = m >> d;
    const uint64_t rest = m & ((uint64_t{1} << d) - 1), half = uint64_t{1} << (d - 1);
    q += static_cast<uint64_t>((rest > half) | ((rest == half) & static_cast<bool>(q & 1)));  // no branch to mispredict
  }
  // q * 2^unit, exactly (q < 2^(precision + 1), 2^unit a normal double).
  const uint64_t scale_bits = static_cast<uint64_t>(unit + 1023) << 52;
  double scale;
  std::memcpy(&scale, &scale_bits, 8);
  double rounded = static_cast<double>(q) * scale;
  if (rounded > max_finite) rounded = INFINITY;
  return sign ? -rounded : rounded;
}
}  // namespace

void round_in_place(DType dtype, float* values, int64_t n) {
  switch (dtype) {
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) values[i] = round_to_bf16(values[i]);
      return;
    case DType::fp16:
      for (int64_t i = 0; i < n; ++i) values[i] = static_cast<float>(Eigen::half(values[i]));
      return;
    case DType::fp32: return;
  }
}

float round_to(DType dtype, double value) {
  switch (dtype) {
    case DType::bf16: return static_cast<float>(round_to_format(value, 8, -126, 0x1.FEp127));
    case DType::fp16: return static_cast<float>(round_to_format(value, 11, -14, 65504.0));
    case DType::fp32: return static_cast<float>(value);
  }
  return static_cast<float>(value);
}

}  // namespace cpgold
