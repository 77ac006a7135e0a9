#pragma once
// Storage dtypes of a case and the rounding that emulates them on the CPU (round to nearest even, Eigen's types).
#include <string>
#include <string_view>

namespace cpgold {

enum class DType { bf16, fp16, fp32 };

std::string_view dtype_name(DType dtype);
// Parses "bf16", "fp16" or "fp32"; anything else is an InputError naming `field`.
DType parse_dtype(std::string_view text, const std::string& field = "dtype");
// Bytes of one stored element.
int dtype_bytes(DType dtype);
// Rounds a float to the nearest value of the dtype (identity for fp32). Inf and NaN pass through.
float round_to(DType dtype, float value);
// Rounds a double to the nearest value of the dtype (via float for fp32 as well).
float round_to(DType dtype, double value);

}  // namespace cpgold
