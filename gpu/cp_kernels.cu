// Data-movement and merge kernels of the GPU CP executors (declarations and contracts in gpu/cp_kernels.hpp).
// Simple grid-stride kernels: these move the bytes of the CP bookkeeping, the attention kernels do the arithmetic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "gpu/cp_kernels.hpp"

namespace cpgold::gpu {
namespace {

constexpr int kThreads = 256;

int blocks_for(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 16 ? (b == 0 ? 1 : b) : 65535 * 16);
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

// Element copies by width (2 or 4 bytes): exact, NaN payloads kept.
template <class U>
__global__ void gather_rows_kernel(U* out, const U* x, const int64_t* rows, int64_t n, int64_t x_heads, int64_t h0,
                                   int64_t heads, int64_t dim) {
  const int64_t total = n * heads * dim;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / (heads * dim), rem = e % (heads * dim), h = rem / dim, d = rem % dim;
    const int64_t r = rows[i];
    out[e] = r < 0 ? U(0) : x[(r * x_heads + h0 + h) * dim + d];
  }
}
template <class U>
__global__ void scatter_rows_kernel(U* dst, const U* src, const int64_t* rows, int64_t n, int64_t dst_heads,
                                    int64_t h0, int64_t src_heads, int64_t dim) {
  const int64_t total = n * src_heads * dim;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / (src_heads * dim), rem = e % (src_heads * dim), h = rem / dim, d = rem % dim;
    dst[(rows[i] * dst_heads + h0 + h) * dim + d] = src[e];
  }
}
__global__ void scatter_add_kernel(float* dst, const void* src, Elem src_elem, const int64_t* rows, int64_t n,
                                   int64_t row_elems) {
  const int64_t total = n * row_elems;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / row_elems, x = e % row_elems;
    dst[rows[i] * row_elems + x] += load(src, src_elem, static_cast<size_t>(e));
  }
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
__global__ void lse_merge_kernel(float* lse, const float* part, const int64_t* rows, int64_t n, int64_t heads,
                                 int64_t lse_rows) {
  const int64_t total = n * heads;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e / n, i = e % n;
    float& l = lse[h * lse_rows + rows[i]];
    l = lse_merge_device(l, part[e]);
  }
}
__global__ void o_accumulate_kernel(float* o, const void* part_o, Elem part_elem, const float* part_lse,
                                    const float* lse, const int64_t* rows, int64_t n, int64_t heads, int64_t dim,
                                    int64_t lse_rows) {
  const int64_t total = n * heads * dim;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / (heads * dim), rem = e % (heads * dim), h = rem / dim, d = rem % dim;
    const float lp = part_lse[h * n + i];
    if (lp == -INFINITY) continue;
    const float w = expf(lp - lse[h * lse_rows + rows[i]]);
    o[(rows[i] * heads + h) * dim + d] += load(part_o, part_elem, static_cast<size_t>(e)) * w;
  }
}
__global__ void convert_kernel(void* dst, Elem dst_elem, const void* src, Elem src_elem, size_t count) {
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += size_t(gridDim.x) * blockDim.x)
    store(dst, dst_elem, e, load(src, src_elem, e));
}
__global__ void add_one_kernel(void* x, Elem elem, size_t offset, size_t count) {
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += size_t(gridDim.x) * blockDim.x)
    store(x, elem, offset + e, load(x, elem, offset + e) + 1.0f);
}
__global__ void sum_blocks_kernel(float* out, const float* in, int blocks, size_t count) {
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += size_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int b = 0; b < blocks; ++b) s += in[static_cast<size_t>(b) * count + e];
    out[e] = s;
  }
}

}  // namespace

cudaError_t launch_gather_rows(void* out, const void* x, const int64_t* rows, int64_t n, int64_t x_heads, int64_t h0,
                               int64_t heads, int64_t dim, Elem elem, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * heads * dim);
  if (total == 0) return cudaSuccess;
  if (elem == Elem::f32)
    gather_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(static_cast<float*>(out), static_cast<const float*>(x),
                                                                 rows, n, x_heads, h0, heads, dim);
  else
    gather_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(static_cast<uint16_t*>(out),
                                                                 static_cast<const uint16_t*>(x), rows, n, x_heads, h0,
                                                                 heads, dim);
  return cudaGetLastError();
}
cudaError_t launch_scatter_rows(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t dst_heads,
                                int64_t h0, int64_t src_heads, int64_t dim, Elem elem, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * src_heads * dim);
  if (total == 0) return cudaSuccess;
  if (elem == Elem::f32)
    scatter_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(static_cast<float*>(dst),
                                                                  static_cast<const float*>(src), rows, n, dst_heads,
                                                                  h0, src_heads, dim);
  else
    scatter_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(static_cast<uint16_t*>(dst),
                                                                  static_cast<const uint16_t*>(src), rows, n,
                                                                  dst_heads, h0, src_heads, dim);
  return cudaGetLastError();
}
cudaError_t launch_scatter_add(float* dst, const void* src, Elem src_elem, const int64_t* rows, int64_t n,
                               int64_t row_elems, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * row_elems);
  if (total == 0) return cudaSuccess;
  scatter_add_kernel<<<blocks_for(total), kThreads, 0, stream>>>(dst, src, src_elem, rows, n, row_elems);
  return cudaGetLastError();
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
cudaError_t launch_lse_merge_into(float* lse, const float* part, const int64_t* rows, int64_t n, int64_t heads,
                                  int64_t lse_rows, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * heads);
  if (total == 0) return cudaSuccess;
  lse_merge_kernel<<<blocks_for(total), kThreads, 0, stream>>>(lse, part, rows, n, heads, lse_rows);
  return cudaGetLastError();
}
cudaError_t launch_o_accumulate(float* o, const void* part_o, Elem part_elem, const float* part_lse,
                                const float* lse, const int64_t* rows, int64_t n, int64_t heads, int64_t dim,
                                int64_t lse_rows, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n * heads * dim);
  if (total == 0) return cudaSuccess;
  o_accumulate_kernel<<<blocks_for(total), kThreads, 0, stream>>>(o, part_o, part_elem, part_lse, lse, rows, n, heads,
                                                                  dim, lse_rows);
  return cudaGetLastError();
}
cudaError_t launch_convert(void* dst, Elem dst_elem, const void* src, Elem src_elem, size_t count,
                           cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  convert_kernel<<<blocks_for(count), kThreads, 0, stream>>>(dst, dst_elem, src, src_elem, count);
  return cudaGetLastError();
}
cudaError_t launch_add_one(void* x, Elem elem, size_t offset, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  add_one_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, elem, offset, count);
  return cudaGetLastError();
}
cudaError_t launch_sum_blocks(float* out, const float* in, int blocks, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  sum_blocks_kernel<<<blocks_for(count), kThreads, 0, stream>>>(out, in, blocks, count);
  return cudaGetLastError();
}

}  // namespace cpgold::gpu
