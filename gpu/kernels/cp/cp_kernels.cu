// Data-movement and merge kernels of the GPU CP executors (declarations and contracts in gpu/kernels/cp/cp_kernels.hpp).
// These move the bytes of the CP bookkeeping, the attention kernels do the arithmetic: one warp per row, the widest
// vector access the row allows, no division in the inner loops, every byte read and written once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>

#include "gpu/kernels/attention/dtype_pack.cuh"  // Pair
#include "gpu/kernels/cp/cp_kernels.hpp"

namespace cpgold::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

int blocks_for(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 16 ? (b == 0 ? 1 : b) : 65535 * 16);
}
// One warp per row: blocks for n rows.
unsigned row_blocks(int64_t n) { return static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// The widest access (16, 8, 4 or 2 bytes) that divides every byte offset, stride and address in `bits` (or-ed).
int vector_bytes(uint64_t bits) {
  int v = 16;
  while (v > 2 && (bits & static_cast<uint64_t>(v - 1))) v /= 2;
  return v;
}
uint64_t address_bits(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// Scalar and 4-wide loads/stores of the element types, values as float (stores round to nearest even).
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load1(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }
__device__ __forceinline__ void store1(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store1(__half* p, float x) { *p = __float2half_rn(x); }

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <class T>
__device__ __forceinline__ float4 load4(const T* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  typename Pair<T>::type a, b;
  memcpy(&a, &u.x, 4);
  memcpy(&b, &u.y, 4);
  const float2 fa = Pair<T>::to_float2(a), fb = Pair<T>::to_float2(b);
  return make_float4(fa.x, fa.y, fb.x, fb.y);
}
__device__ __forceinline__ void store4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }
template <class T>
__device__ __forceinline__ void store4(T* p, float4 x) {
  const typename Pair<T>::type a = Pair<T>::from_floats(x.x, x.y), b = Pair<T>::from_floats(x.z, x.w);
  uint2 u;
  memcpy(&u.x, &a, 4);
  memcpy(&u.y, &b, 4);
  *reinterpret_cast<uint2*>(p) = u;
}

// Row copies of V-sized words (exact, NaN payloads kept): dst row dst_rows[i] (or i) <- src row src_rows[i] (or i),
// at byte offsets row * stride + offset; a negative source row writes zeros.
template <class V>
__global__ void copy_rows_kernel(char* dst, const char* src, const int64_t* dst_rows, const int64_t* src_rows,
                                 int64_t n, int64_t dst_stride, int64_t dst_offset, int64_t src_stride,
                                 int64_t src_offset, int row_words) {
  const int64_t i = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= n) return;
  const int lane = threadIdx.x % 32;
  const int64_t dr = dst_rows ? dst_rows[i] : i, sr = src_rows ? src_rows[i] : i;
  V* d = reinterpret_cast<V*>(dst + dr * dst_stride + dst_offset);
  if (sr < 0) {
    for (int w = lane; w < row_words; w += 32) d[w] = V{};
    return;
  }
  const V* s = reinterpret_cast<const V*>(src + sr * src_stride + src_offset);
#pragma unroll 4
  for (int w = lane; w < row_words; w += 32) d[w] = s[w];
}

cudaError_t copy_rows(void* dst, const void* src, const int64_t* dst_rows, const int64_t* src_rows, int64_t n,
                      int64_t dst_stride, int64_t dst_offset, int64_t src_stride, int64_t src_offset,
                      int64_t row_bytes, cudaStream_t stream) {
  if (n == 0 || row_bytes == 0) return cudaSuccess;
  const int v = vector_bytes(static_cast<uint64_t>(row_bytes | dst_stride | dst_offset | src_stride | src_offset) |
                             address_bits(dst) | address_bits(src));
  const int words = static_cast<int>(row_bytes / v);
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const unsigned blocks = row_blocks(n);
  if (v == 16)
    copy_rows_kernel<uint4><<<blocks, kThreads, 0, stream>>>(d, s, dst_rows, src_rows, n, dst_stride, dst_offset,
                                                             src_stride, src_offset, words);
  else if (v == 8)
    copy_rows_kernel<uint2><<<blocks, kThreads, 0, stream>>>(d, s, dst_rows, src_rows, n, dst_stride, dst_offset,
                                                             src_stride, src_offset, words);
  else if (v == 4)
    copy_rows_kernel<uint32_t><<<blocks, kThreads, 0, stream>>>(d, s, dst_rows, src_rows, n, dst_stride, dst_offset,
                                                                src_stride, src_offset, words);
  else
    copy_rows_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(d, s, dst_rows, src_rows, n, dst_stride, dst_offset,
                                                                src_stride, src_offset, words);
  return cudaGetLastError();
}

// dst[rows[i]] (+)= src[i], row_elems float32 per row, 4 (WIDE) or 1 element per access.
template <class S, bool WIDE>
__global__ void scatter_add_kernel(float* dst, const S* src, const int64_t* rows, int64_t n, int64_t row_elems,
                                   bool assign) {
  const int64_t i = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= n) return;
  const int lane = threadIdx.x % 32;
  float* d = dst + rows[i] * row_elems;
  const S* s = src + i * row_elems;
  if constexpr (WIDE) {
    const int64_t words = row_elems / 4;
#pragma unroll 4
    for (int64_t w = lane; w < words; w += 32) {
      const float4 x = load4(s + 4 * w);
      float4 y = assign ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : load4(d + 4 * w);
      y.x += x.x;
      y.y += x.y;
      y.z += x.z;
      y.w += x.w;
      store4(d + 4 * w, y);
    }
  } else {
    for (int64_t e = lane; e < row_elems; e += 32) d[e] = (assign ? 0.0f : d[e]) + load1(s + e);
  }
}
template <class S>
cudaError_t scatter_add_typed(float* dst, const S* src, const int64_t* rows, int64_t n, int64_t row_elems,
                              bool assign, cudaStream_t stream) {
  const bool wide = row_elems % 4 == 0 && address_bits(dst) % 16 == 0 && address_bits(src) % (4 * sizeof(S)) == 0;
  if (wide)
    scatter_add_kernel<S, true><<<row_blocks(n), kThreads, 0, stream>>>(dst, src, rows, n, row_elems, assign);
  else
    scatter_add_kernel<S, false><<<row_blocks(n), kThreads, 0, stream>>>(dst, src, rows, n, row_elems, assign);
  return cudaGetLastError();
}

__global__ void lse_gather_kernel(float* out, const float* x, const int64_t* rows, int64_t n, int64_t heads,
                                  int64_t x_rows) {
  const int64_t total = n * heads;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e / n, i = e % n;
    out[e] = rows[i] < 0 ? -INFINITY : x[h * x_rows + rows[i]];
  }
}
__global__ void lse_scatter_kernel(float* dst, const float* src, const int64_t* rows, int64_t n, int64_t src_heads,
                                   int64_t dst_rows, int64_t h0) {
  const int64_t total = n * src_heads;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e / n, i = e % n;
    dst[(h0 + h) * dst_rows + rows[i]] = src[e];
  }
}
__global__ void fill_kernel(float* x, size_t count, float value) {
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += size_t(gridDim.x) * blockDim.x)
    x[e] = value;
}
__device__ float lse_merge_device(float a, float b) {
  const float hi = a > b ? a : b, lo = a > b ? b : a;
  if (hi == -INFINITY) return hi;
  return hi + log1pf(expf(lo - hi));
}

struct MergeSources {
  MergeSource s[kMaxMergeSources];
  int n = 0;
};
// 8 consecutive elements as float (16 bytes of a 16-bit type, 32 of float32); stores round to nearest even.
__device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
  const float4 a = load4(p), b = load4(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
template <class H, class H2>
__device__ __forceinline__ void load8_16(const H* p, float (&x)[8], float2 (*widen)(H2)) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    H2 h;
    memcpy(&h, &w[i], 4);
    const float2 f = widen(h);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&x)[8]) {
  load8_16<__nv_bfloat16, __nv_bfloat162>(p, x, [](__nv_bfloat162 h) { return __bfloat1622float2(h); });
}
__device__ __forceinline__ void load8(const __half* p, float (&x)[8]) {
  load8_16<__half, __half2>(p, x, [](__half2 h) { return __half22float2(h); });
}
__device__ __forceinline__ void store8(float* p, const float (&x)[8]) {
  store4(p, make_float4(x[0], x[1], x[2], x[3]));
  store4(p + 4, make_float4(x[4], x[5], x[6], x[7]));
}
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&x)[8]) {  // bf16 / fp16: one 16-byte store
  uint4 u;
  uint32_t* w = &u.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    T pair[2];
    store1(&pair[0], x[2 * i]);
    store1(&pair[1], x[2 * i + 1]);
    memcpy(w + i, pair, 4);
  }
  *reinterpret_cast<uint4*>(p) = u;
}

// One warp per merged row. Per head, the LSE merge over the sources in order; each output element sums its
// sources in order in float32 (acc += o_i * exp(lse_i - lse)) and is rounded once.
// WIDE: the row's (head, 8 dims) pieces are spread over the lanes, 16-byte accesses, each lane merging the LSE of the
// head it works on (the same value in every lane of that head); otherwise one element per lane and access.
template <class S, class T, bool WIDE>
__global__ void merge_forward_kernel(T* o, float* lse, MergeSources src, int64_t rows, int heads, int dim) {
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  auto merged_lse = [&](int h) {
    float l = -INFINITY;
    for (int p = 0; p < src.n; ++p) {
      const int64_t pr = src.s[p].source_row[r];
      if (pr >= 0) l = lse_merge_device(l, src.s[p].lse[h * src.s[p].part_rows + pr]);
    }
    return l;
  };
  if constexpr (WIDE) {
    const int pieces_per_head = dim / 8, pieces = heads * pieces_per_head;
#pragma unroll 2
    for (int c = lane; c < pieces; c += 32) {
      const int h = c / pieces_per_head, d = (c - h * pieces_per_head) * 8;
      const float l = merged_lse(h);
      if (d == 0) lse[h * rows + r] = l;
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int p = 0; p < src.n; ++p) {
        const int64_t pr = src.s[p].source_row[r];
        if (pr < 0) continue;
        const float lp = src.s[p].lse[h * src.s[p].part_rows + pr];
        if (lp == -INFINITY) continue;
        const float w = expf(lp - l);
        float x[8];
        load8(static_cast<const S*>(src.s[p].o) + (pr * heads + h) * dim + d, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += x[i] * w;
      }
      store8(o + (r * heads + h) * dim + d, acc);
    }
  } else {
    for (int h = 0; h < heads; ++h) {
      const float l = merged_lse(h);
      if (lane == 0) lse[h * rows + r] = l;
      T* out = o + (r * heads + h) * dim;
      for (int d = lane; d < dim; d += 32) {
        float acc = 0.0f;
        for (int p = 0; p < src.n; ++p) {
          const int64_t pr = src.s[p].source_row[r];
          if (pr < 0) continue;
          const float lp = src.s[p].lse[h * src.s[p].part_rows + pr];
          if (lp == -INFINITY) continue;
          acc += load1(static_cast<const S*>(src.s[p].o) + (pr * heads + h) * dim + d) * expf(lp - l);
        }
        store1(out + d, acc);
      }
    }
  }
}
template <class S, class T>
cudaError_t merge_forward_typed(T* o, float* lse, const MergeSources& src, int64_t rows, int64_t heads, int64_t dim,
                                cudaStream_t stream) {
  uint64_t bits = address_bits(o);
  for (int p = 0; p < src.n; ++p) bits |= address_bits(src.s[p].o);
  const bool wide = dim % 8 == 0 && bits % (8 * sizeof(T) > 8 * sizeof(S) ? 8 * sizeof(T) : 8 * sizeof(S)) == 0;
  if (wide)
    merge_forward_kernel<S, T, true><<<row_blocks(rows), kThreads, 0, stream>>>(o, lse, src, rows, static_cast<int>(heads),
                                                                             static_cast<int>(dim));
  else
    merge_forward_kernel<S, T, false><<<row_blocks(rows), kThreads, 0, stream>>>(o, lse, src, rows,
                                                                              static_cast<int>(heads),
                                                                              static_cast<int>(dim));
  return cudaGetLastError();
}
template <class T>
cudaError_t merge_forward_to(T* o, float* lse, const MergeSources& src, Elem part_elem, int64_t rows, int64_t heads,
                             int64_t dim, cudaStream_t stream) {
  if (part_elem == Elem::bf16)
    return merge_forward_typed<__nv_bfloat16>(o, lse, src, rows, heads, dim, stream);
  if (part_elem == Elem::fp16) return merge_forward_typed<__half>(o, lse, src, rows, heads, dim, stream);
  return merge_forward_typed<float>(o, lse, src, rows, heads, dim, stream);
}

// 4 elements per access where count and addresses allow, the tail (or everything) one by one.
template <class S, class T>
__global__ void convert_kernel(T* dst, const S* src, size_t count, bool wide) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t start = 0;
  if (wide) {
    const size_t words = count / 4;
    for (size_t w = blockIdx.x * size_t(blockDim.x) + threadIdx.x; w < words; w += stride)
      store4(dst + 4 * w, load4(src + 4 * w));
    start = words * 4;
  }
  for (size_t e = start + blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += stride)
    store1(dst + e, load1(src + e));
}
template <class S, class T>
cudaError_t convert_typed(T* dst, const S* src, size_t count, cudaStream_t stream) {
  const bool wide = address_bits(dst) % (4 * sizeof(T)) == 0 && address_bits(src) % (4 * sizeof(S)) == 0;
  convert_kernel<S, T><<<blocks_for(wide ? (count + 3) / 4 : count), kThreads, 0, stream>>>(dst, src, count, wide);
  return cudaGetLastError();
}
template <class T>
cudaError_t convert_to(T* dst, const void* src, Elem src_elem, size_t count, cudaStream_t stream) {
  if (src_elem == Elem::bf16) return convert_typed(dst, static_cast<const __nv_bfloat16*>(src), count, stream);
  if (src_elem == Elem::fp16) return convert_typed(dst, static_cast<const __half*>(src), count, stream);
  return convert_typed(dst, static_cast<const float*>(src), count, stream);
}

__device__ float load(const void* p, Elem e, size_t i) {
  if (e == Elem::bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (e == Elem::fp16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ void store(void* p, Elem e, size_t i, float x) {
  if (e == Elem::bf16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else if (e == Elem::fp16) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<float*>(p)[i] = x;
}
__global__ void add_one_kernel(void* x, Elem elem, size_t offset, size_t count) {
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += size_t(gridDim.x) * blockDim.x)
    store(x, elem, offset + e, load(x, elem, offset + e) + 1.0f);
}

}  // namespace

cudaError_t launch_gather_rows(void* out, const void* x, const int64_t* rows, int64_t n, int64_t x_heads, int64_t h0,
                               int64_t heads, int64_t dim, Elem elem, cudaStream_t stream) {
  const int64_t e = static_cast<int64_t>(elem_bytes(elem));
  return copy_rows(out, x, nullptr, rows, n, heads * dim * e, 0, x_heads * dim * e, h0 * dim * e, heads * dim * e,
                   stream);
}
cudaError_t launch_scatter_rows(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t dst_heads,
                                int64_t h0, int64_t src_heads, int64_t dim, Elem elem, cudaStream_t stream) {
  const int64_t e = static_cast<int64_t>(elem_bytes(elem));
  return copy_rows(dst, src, rows, nullptr, n, dst_heads * dim * e, h0 * dim * e, src_heads * dim * e, 0,
                   src_heads * dim * e, stream);
}
cudaError_t launch_scatter_add(float* dst, const void* src, Elem src_elem, const int64_t* rows, int64_t n,
                               int64_t row_elems, bool assign, cudaStream_t stream) {
  if (n == 0 || row_elems == 0) return cudaSuccess;
  if (src_elem == Elem::bf16)
    return scatter_add_typed(dst, static_cast<const __nv_bfloat16*>(src), rows, n, row_elems, assign, stream);
  if (src_elem == Elem::fp16)
    return scatter_add_typed(dst, static_cast<const __half*>(src), rows, n, row_elems, assign, stream);
  return scatter_add_typed(dst, static_cast<const float*>(src), rows, n, row_elems, assign, stream);
}
cudaError_t launch_lse_gather(float* out, const float* x, const int64_t* rows, int64_t n, int64_t heads,
                              int64_t x_rows, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * heads);
  if (total == 0) return cudaSuccess;
  lse_gather_kernel<<<blocks_for(total), kThreads, 0, stream>>>(out, x, rows, n, heads, x_rows);
  return cudaGetLastError();
}
cudaError_t launch_lse_scatter(float* dst, const float* src, const int64_t* rows, int64_t n, int64_t src_heads,
                               int64_t dst_rows, int64_t h0, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * src_heads);
  if (total == 0) return cudaSuccess;
  lse_scatter_kernel<<<blocks_for(total), kThreads, 0, stream>>>(dst, src, rows, n, src_heads, dst_rows, h0);
  return cudaGetLastError();
}
cudaError_t launch_fill(float* x, size_t count, float value, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fill_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, count, value);
  return cudaGetLastError();
}
cudaError_t launch_merge_forward(void* o, Elem o_elem, float* lse, const MergeSource* sources, int n_sources,
                                 int64_t rows, int64_t heads, int64_t dim, cudaStream_t stream) {
  if (n_sources < 0 || n_sources > kMaxMergeSources) return cudaErrorInvalidValue;
  if (rows == 0 || heads == 0) return cudaSuccess;
  MergeSources src;
  src.n = n_sources;
  for (int p = 0; p < n_sources; ++p) {
    src.s[p] = sources[p];
    if (sources[p].elem != sources[0].elem) return cudaErrorInvalidValue;
  }
  const Elem part_elem = n_sources > 0 ? sources[0].elem : o_elem;
  if (o_elem == Elem::bf16)
    return merge_forward_to(static_cast<__nv_bfloat16*>(o), lse, src, part_elem, rows, heads, dim, stream);
  if (o_elem == Elem::fp16) return merge_forward_to(static_cast<__half*>(o), lse, src, part_elem, rows, heads, dim, stream);
  return merge_forward_to(static_cast<float*>(o), lse, src, part_elem, rows, heads, dim, stream);
}
cudaError_t launch_convert(void* dst, Elem dst_elem, const void* src, Elem src_elem, size_t count,
                           cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (dst_elem == Elem::bf16) return convert_to(static_cast<__nv_bfloat16*>(dst), src, src_elem, count, stream);
  if (dst_elem == Elem::fp16) return convert_to(static_cast<__half*>(dst), src, src_elem, count, stream);
  return convert_to(static_cast<float*>(dst), src, src_elem, count, stream);
}
cudaError_t launch_add_one(void* x, Elem elem, size_t offset, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  add_one_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, elem, offset, count);
  return cudaGetLastError();
}

}  // namespace cpgold::gpu
