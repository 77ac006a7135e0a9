#pragma once
// Two float32 values rounded to the dtype (round to nearest even) and packed in one 32-bit word, the lower value in
// the low half: the register form of bf16/fp16 pairs that both kernel generations store and feed to the tensor cores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace cpgold::gpu {

// The two-element vector type of a 16-bit element type and its conversions from / to float2 (round to nearest even).
template <class T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const typename Pair<T>::type v = Pair<T>::from_floats(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

}  // namespace cpgold::gpu
