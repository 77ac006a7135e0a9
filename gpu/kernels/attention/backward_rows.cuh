#pragma once
// Row passes of the backward that both kernel generations share (the mma.sync backward of attention_kernels.cuh and
// the sm_90a one of sm90/attention_backward_sm90.cuh): delta = rowsum(dO * O) in its one summation order, the
// summing form's add into float32 sums (BackwardBuffers' RowSum), and the atomic mode's dQ finish. Plain CUDA, no
// architecture-specific instruction, so that both backwards give the same bits for these steps.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gpu/kernels/attention/dtype_pack.cuh"
#include "gpu/kernels/attention/kernel_params.hpp"

namespace cpgold::gpu {

// sum_x dO[x] * O[x] over the DV values at `base` by one warp (every lane gets the sum): lane l sums x = l, l + 32, ...
// in order, then a butterfly over the lanes. The one summation order of the backward's delta.
template <class T, int DV>
__device__ __forceinline__ float warp_row_delta(const T* o, const T* dout, int64_t base, int lane) {
  float sum = 0.f;
  for (int x = lane; x < DV; x += 32) sum += static_cast<float>(o[base + x]) * static_cast<float>(dout[base + x]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  return sum;
}

// delta[h, row] = sum_x dO[row, h, x] * O[row, h, x] over the valid rows of a Q tile of p.q_tiles (one warp per
// row); grid (q_tile_count, heads_q), 128 threads.
template <class T, int DV>
__global__ void __launch_bounds__(128) attention_backward_delta_kernel(AttentionParams p) {
  const RowTile tile = p.q_tiles[blockIdx.x];
  if (tile.sequence < 0) return;
  const int head = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t stride = static_cast<int64_t>(p.heads_q) * DV;
  for (int r = warp; r < tile.rows; r += 4) {
    const int64_t base = (tile.first_row + r) * stride + static_cast<int64_t>(head) * DV;
    const float sum = warp_row_delta<T, DV>(static_cast<const T*>(p.o), static_cast<const T*>(p.dout), base, lane);
    if (lane == 0) p.delta[static_cast<int64_t>(head) * p.q_rows + tile.first_row + r] = sum;
  }
}

// The same delta for every row of [rows, heads, DV] tensors (attention_row_delta): block (x, h) takes rows 4x..4x+3.
template <class T, int DV>
__global__ void __launch_bounds__(128) attention_row_delta_kernel(const T* o, const T* dout, float* delta,
                                                                  int64_t rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  if (r >= rows) return;
  const int head = blockIdx.y, lane = threadIdx.x & 31;
  const float sum = warp_row_delta<T, DV>(o, dout, (r * gridDim.y + head) * DV, lane);
  if (lane == 0) delta[static_cast<int64_t>(head) * rows + r] = sum;
}

// The summing form's add (BackwardBuffers' RowSum): for piece i of `pieces` per row (four columns each, rows of
// `rows`), sum[map[r] * stride + col0 + 4 x] = (assign ? 0 : sum[..]) + float(four dtype values of source(r, 4 x)),
// or the dtype of that into result at the same offset: the bits of storing the output and adding it in float32
// afterwards. Threads `thread` of `threads` take pieces thread, thread + threads, ...; each issues the map loads of
// BATCH pieces, then their sum and source loads, before its first store (one piece at a time waited for two memory
// round trips per piece, which made this the longest part of a short tile's work). source(r, col) returns the four
// dtype values as a uint2 (from shared memory, zeros for pad rows, or rounded from the float32 dQ workspace).
template <class T, int BATCH, class Source>
__device__ __forceinline__ void add_rows_to_sum(int rows, int pieces, const int64_t* map, int64_t stride, int64_t col0,
                                                float* sum, bool assign, T* result, const Source& source, int thread,
                                                int threads) {
  const int total = rows * pieces;
  for (int i0 = thread; i0 < total; i0 += threads * BATCH) {
    int64_t off[BATCH];
    uint2 raw[BATCH];
    float4 y[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = i0 + b * threads;
      off[b] = i < total ? map[i / pieces] * stride + col0 + (i % pieces) * 4 : 0;
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = i0 + b * threads;
      if (i >= total) continue;
      raw[b] = source(i / pieces, (i % pieces) * 4);
      y[b] = assign ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(sum + off[b]);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      if (i0 + b * threads >= total) continue;
      T e[4];
      memcpy(e, &raw[b], 8);
      y[b].x += static_cast<float>(e[0]);
      y[b].y += static_cast<float>(e[1]);
      y[b].z += static_cast<float>(e[2]);
      y[b].w += static_cast<float>(e[3]);
      if (result == nullptr)
        *reinterpret_cast<float4*>(sum + off[b]) = y[b];
      else
        *reinterpret_cast<uint2*>(result + off[b]) = make_uint2(pack2<T>(y[b].x, y[b].y), pack2<T>(y[b].z, y[b].w));
    }
  }
}

// Pieces in flight per thread in the summing epilogues (map, sum and source loads of this many pieces before the
// first store).
constexpr int kSumBatch = 8;

// Atomic mode's dQ finish: dQ = dtype(dq_accum * scale) for every row of the tiles of p.q_tiles (pad rows hold 0 in
// dq_accum), or the summing form: dq_sum[q_sum_rows[r]] = (assign ? 0 : dq_sum[..]) + float(dtype(dq_accum[r] *
// scale)) (or dtype of that to dq_result). Rows outside the tiles (OutsideRows::leave_q) are not touched. Block (x, y):
// tile x, 4-element pieces y * 128 + thread stepping gridDim.y * 128 (finish_dq_grid_y blocks per tile, so that a
// call over a few short tiles still keeps enough loads in flight).
template <class T>
__global__ void __launch_bounds__(128) attention_backward_finish_dq_kernel(AttentionParams p, int64_t row_elems) {
  const RowTile tile = p.q_tiles[blockIdx.x];
  const int pieces = static_cast<int>(row_elems / 4);
  const float s = p.softmax_scale;
  const float* accum = p.dq_accum + tile.first_row * row_elems;
  const auto rounded = [&](int r, int col) {
    const float4 a = *reinterpret_cast<const float4*>(accum + r * row_elems + col);
    return make_uint2(pack2<T>(a.x * s, a.y * s), pack2<T>(a.z * s, a.w * s));
  };
  const int thread = blockIdx.y * blockDim.x + threadIdx.x, threads = gridDim.y * blockDim.x;
  if (p.dq_sum == nullptr) {
    T* dq = static_cast<T*>(p.dq) + tile.first_row * row_elems;
    for (int i = thread; i < tile.rows * pieces; i += threads)
      *reinterpret_cast<uint2*>(dq + (i / pieces) * row_elems + (i % pieces) * 4) =
          rounded(i / pieces, (i % pieces) * 4);
    return;
  }
  add_rows_to_sum<T, 4>(tile.rows, pieces, p.q_sum_rows + tile.first_row, row_elems, 0, p.dq_sum,
                        p.dq_sum_assign != 0, static_cast<T*>(p.dq_result), rounded, thread, threads);
}

// Blocks per Q tile of the dQ finish: two rounds of 4 pieces per thread over a tile of `tile_rows` rows.
inline int finish_dq_grid_y(int64_t row_elems, int tile_rows) {
  const int64_t pieces = tile_rows * (row_elems / 4);
  return static_cast<int>(std::max<int64_t>(1, (pieces + 128 * 8 - 1) / (128 * 8)));
}

}  // namespace cpgold::gpu
