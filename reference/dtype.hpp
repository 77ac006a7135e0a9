#pragma once
// Storage dtypes of a case and the rounding that emulates them on the CPU (round to nearest even, Eigen's types).
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace cpgold {

enum class DType { bf16, fp16, fp32 };

std::string_view dtype_name(DType dtype);
// Parses "bf16", "fp16" or "fp32"; anything else is an InputError naming `field`.
DType parse_dtype(std::string_view text, const std::string& field = "dtype");
// Bytes of one stored element.
int dtype_bytes(DType dtype);
// Rounds a float to the nearest value of the dtype (identity for fp32). Inf and NaN pass through (NaN as the quiet
// NaN of its sign, as Eigen's conversions make it).
float round_to(DType dtype, float value);
// Rounds a double to the nearest value of the dtype (via float for fp32 as well).
float round_to(DType dtype, double value);
// round_to over n values in place: the same results, in a loop the compiler vectorises (the peer rounds every
// element of its P and dS tiles).
void round_in_place(DType dtype, float* values, int64_t n);

// bf16 rounding of a float (round to nearest even on the upper 16 bits; NaN to the quiet NaN of its sign): the bits
// of Eigen::bfloat16(value), branch-free so that loops over it vectorise.
inline float round_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (bits & 0x80000000u) | 0x7fc00000u;
  const uint32_t out = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  float result;
  std::memcpy(&result, &out, 4);
  return result;
}

}  // namespace cpgold
