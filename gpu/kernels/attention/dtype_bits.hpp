#pragma once
// The 16-bit storage of bf16 and fp16 values on the host (round to nearest even, as Eigen's types do): what the GPU
// paths upload and download, and what the GPU tests build their expected tensors from.
#include <Eigen/Core>
#include <cstdint>

#include "reference/dtype.hpp"

namespace cpgold::gpu {

inline uint16_t to_bits(DType dtype, float x) {
  if (dtype == DType::bf16) return Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(x));
  return Eigen::numext::bit_cast<uint16_t>(Eigen::half(x));
}
inline float from_bits(DType dtype, uint16_t bits) {
  if (dtype == DType::bf16) return static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits));
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
}

}  // namespace cpgold::gpu
