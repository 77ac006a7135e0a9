#pragma once
// Data-movement and merge kernels of the GPU CP executors (gpu/cp/cp_executor.*): row gathers and scatters between
// step, group and rank tensors, float32 accumulation of partials, the fused forward merge of per-step (O_i, LSE_i),
// and dtype conversion. Row index arrays live on the device; a row index < 0 reads as zero.
// Every launcher enqueues on `stream` and returns the launch error (cudaSuccess when there is nothing to do).
// The row kernels give each row to one warp and move it in the widest of 16/8/4/2-byte vectors that the row width,
// the offsets and the pointers allow: no per-element index arithmetic beyond the row's base address.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace cpgold::gpu {

enum class Elem { bf16, fp16, f32 };
inline size_t elem_bytes(Elem e) { return e == Elem::f32 ? 4 : 2; }

// out: [n, heads, dim]; out[i, h] = x[rows[i], h0 + h] (x: [*, x_heads, dim]); zero where rows[i] < 0.
cudaError_t launch_gather_rows(void* out, const void* x, const int64_t* rows, int64_t n, int64_t x_heads, int64_t h0,
                               int64_t heads, int64_t dim, Elem elem, cudaStream_t stream);
// dst: [*, dst_heads, dim]; dst[rows[i], h0 + h] = src[i, h] for i < n, h < src_heads (same element type).
cudaError_t launch_scatter_rows(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t dst_heads,
                                int64_t h0, int64_t src_heads, int64_t dim, Elem elem, cudaStream_t stream);
// dst: float32 [*, row_elems]; dst[rows[i]] += src[i] (src: [n, row_elems] of src_elem). With assign, dst[rows[i]] =
// 0 + src[i] (the same bits as adding into a zero row: -0 becomes +0), for a first contribution into a fresh buffer.
cudaError_t launch_scatter_add(float* dst, const void* src, Elem src_elem, const int64_t* rows, int64_t n,
                               int64_t row_elems, bool assign, cudaStream_t stream);
// out: [heads, n]; out(h, i) = x(h, rows[i]) (x: [heads, x_rows]); -inf where rows[i] < 0.
cudaError_t launch_lse_gather(float* out, const float* x, const int64_t* rows, int64_t n, int64_t heads,
                              int64_t x_rows, cudaStream_t stream);
// dst: [*, dst_rows]; dst(h0 + h, rows[i]) = src(h, i) (src: [src_heads, n]).
cudaError_t launch_lse_scatter(float* dst, const float* src, const int64_t* rows, int64_t n, int64_t src_heads,
                               int64_t dst_rows, int64_t h0, cudaStream_t stream);
cudaError_t launch_fill(float* x, size_t count, float value, cudaStream_t stream);

// One per-step partial of the forward merge: o [part_rows, heads, dim] of elem, lse [heads, part_rows] float32, and
// for every row r of the merged tensor the partial's row holding it (source_row[r], -1: the step did not compute r).
struct MergeSource {
  const void* o = nullptr;
  const float* lse = nullptr;
  const int64_t* source_row = nullptr;  // [rows]
  int64_t part_rows = 0;
  Elem elem = Elem::bf16;
};
constexpr int kMaxMergeSources = 32;
// The forward merge in one pass. o: [rows, heads, dim] of o_elem, lse: [heads, rows] float32, both overwritten:
// lse(h, r) = LSE merge of the sources' lse in source order (from -inf); o[r, h] = sum over sources in order of
// o_i[r, h] * exp(lse_i - lse) accumulated in float32 (sources with lse_i = -inf skipped), rounded once to o_elem.
// A row no source computes gets o = 0, lse = -inf. n_sources <= kMaxMergeSources.
cudaError_t launch_merge_forward(void* o, Elem o_elem, float* lse, const MergeSource* sources, int n_sources,
                                 int64_t rows, int64_t heads, int64_t dim, cudaStream_t stream);

// dst[i] = src[i] converted (round to nearest even into 16-bit types).
cudaError_t launch_convert(void* dst, Elem dst_elem, const void* src, Elem src_elem, size_t count,
                           cudaStream_t stream);
// x[offset + i] += 1 for i < count (the checker's self-test corrupts one partial row this way).
cudaError_t launch_add_one(void* x, Elem elem, size_t offset, size_t count, cudaStream_t stream);

}  // namespace cpgold::gpu
