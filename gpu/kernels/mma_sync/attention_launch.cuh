#pragma once
// Launch templates shared by the per-dtype translation units.
#include <algorithm>
#include <string>

#include "gpu/kernels/mma_sync/attention_kernels.cuh"
#include "gpu/kernels/attention/attention_launch.hpp"

namespace cpgold::gpu::detail {

inline Outcome cuda_failure(const char* what, cudaError_t e) {
  return {Status::cuda_error, std::string(what) + ": " + cudaGetErrorString(e)};
}

template <class Kernel, class... Extra>
Outcome launch(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, const AttentionParams& p,
               const char* name, Extra... extra) {
  if (grid.x == 0 || grid.y == 0) return {};
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        e != cudaSuccess)
      return cuda_failure(name, e);
  }
  kernel<<<grid, threads, smem, stream>>>(p, extra...);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_failure(name, e);
  return {};
}

// Forward Q tiles are 16 rows per warp; 4 warps use the small tile list.
inline constexpr int kForwardWarps = 4;

template <class T, int D, int DV>
Outcome forward_dims(AttentionParams p, cudaStream_t stream, const AttentionPlan::Impl& plan) {
  using Cfg = ForwardConfig<T, D, DV, kForwardWarps>;
  static_assert(Cfg::kBlockM == kSmallTileRows || Cfg::kBlockM == kLargeTileRows, "tile list");
  p.q_tiles = Cfg::kBlockM == kSmallTileRows ? plan.q_tiles_small : plan.q_tiles_large;
  p.q_tile_count = Cfg::kBlockM == kSmallTileRows ? plan.q_tile_small_count : plan.q_tile_large_count;
  return launch(attention_forward_kernel<T, D, DV, kForwardWarps>, dim3(p.q_tile_count, p.heads_q), Cfg::kThreads,
                Cfg::kSmemBytes, stream, p, "attention_forward_kernel");
}

template <class T>
Outcome forward_typed(const AttentionPlan::Impl& plan, const ForwardBuffers& b, cudaStream_t stream) {
  const AttentionParams p = forward_params(plan, b);
  Outcome out;
  if (run_for_head_dims(plan.shape.dim_qk, plan.shape.dim_v,
                        [&]<int D, int DV>() { return forward_dims<T, D, DV>(p, stream, plan); }, out))
    return out;
  return {Status::unsupported, "head dims outside the capability table"};
}

template <class T, int D, int DV>
Outcome backward_dims(AttentionParams p, BackwardMode mode, cudaStream_t stream, const AttentionPlan::Impl& plan) {
  p.q_tiles = plan.q_tiles_small;
  p.q_tile_count = plan.q_tile_small_count;
  p.kv_tiles = plan.kv_tiles;
  p.kv_tile_count = plan.kv_tile_count;
  const bool atomic = mode == BackwardMode::atomic;
  BackwardWorkspace workspace;
  if (cudaError_t e = allocate_backward_workspace(p, atomic, D, stream, workspace); e != cudaSuccess)
    return cuda_failure("cudaMallocAsync of the backward workspace", e);
  const bool own_delta = workspace.own_delta;
  const size_t accum_elems = workspace.accum_elems;
  Outcome out;
  auto step = [&](Outcome o) {
    if (out.ok() && !o.ok()) out = std::move(o);
  };
  if (own_delta)
    step(launch(attention_backward_delta_kernel<T, DV>, dim3(p.q_tile_count, p.heads_q), 128, 0, stream, p,
                "attention_backward_delta_kernel"));
  using Cfg = BackwardConfig<T, D, DV>;
  // Column slices of the dK/dV kernel: two for head dim 256 (see attention_backward_dkdv_kernel).
  constexpr int kSlices = D > 192 ? 2 : 1;
  const dim3 dkdv_grid(p.kv_tile_count, p.heads_kv, kSlices);
  if (atomic) {
    if (accum_elems > 0 && out.ok())
      if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, accum_elems * sizeof(float), stream); e != cudaSuccess)
        step(cuda_failure("cudaMemsetAsync of dq_accum", e));
    if (out.ok())
      step(launch(attention_backward_dkdv_kernel<T, D, DV, true, kSlices>, dkdv_grid, Cfg::kThreads,
                  Cfg::kSmemBytes, stream, p, "attention_backward_dkdv_kernel"));
    // dQ = dtype(dq_accum * scale) over the call's Q tiles, or its summing form (backward_rows.cuh).
    const int64_t row_elems = static_cast<int64_t>(p.heads_q) * D;
    if (out.ok() && accum_elems > 0 && p.q_tile_count > 0)
      step(launch(attention_backward_finish_dq_kernel<T>,
                  dim3(p.q_tile_count, finish_dq_grid_y(row_elems, kSmallTileRows)), 128, 0, stream, p,
                  "attention_backward_finish_dq_kernel", row_elems));
  } else {
    if (out.ok())
      step(launch(attention_backward_dkdv_kernel<T, D, DV, false, kSlices>, dkdv_grid, Cfg::kThreads,
                  Cfg::kSmemBytes, stream, p, "attention_backward_dkdv_kernel"));
    using Dq = DqConfig<T, D, DV>;
    if (out.ok())
      step(launch(attention_backward_dq_kernel<T, D, DV>, dim3(p.q_tile_count, p.heads_q), Dq::kThreads,
                  Dq::kSmemBytes, stream, p, "attention_backward_dq_kernel"));
  }
  if (cudaError_t e = free_backward_workspace(workspace, stream); e != cudaSuccess)
    step(cuda_failure("cudaFreeAsync of the backward workspace", e));
  return out;
}

template <class T>
Outcome backward_typed(const AttentionPlan::Impl& plan, const BackwardBuffers& b, BackwardMode mode,
                       cudaStream_t stream) {
  const AttentionParams p = backward_params(plan, b);
  Outcome out;
  if (run_for_head_dims(plan.shape.dim_qk, plan.shape.dim_v,
                        [&]<int D, int DV>() { return backward_dims<T, D, DV>(p, mode, stream, plan); }, out))
    return out;
  return {Status::unsupported, "head dims outside the capability table"};
}

template <class T, int DV>
Outcome row_delta_dims(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                       cudaStream_t stream) {
  if (rows == 0) return {};
  if ((rows + 3) / 4 > 0x7fffffff) return {Status::invalid_argument, "attention_row_delta: too many rows"};
  attention_row_delta_kernel<T, DV><<<dim3(static_cast<unsigned>((rows + 3) / 4), shape.heads_q), 128, 0, stream>>>(
      static_cast<const T*>(o), static_cast<const T*>(dout), delta, rows);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_failure("attention_row_delta_kernel", e);
  return {};
}

template <class T>
Outcome row_delta_typed(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                        cudaStream_t stream) {
  switch (shape.dim_v) {
    case 32: return row_delta_dims<T, 32>(shape, o, dout, rows, delta, stream);
    case 64: return row_delta_dims<T, 64>(shape, o, dout, rows, delta, stream);
    case 96: return row_delta_dims<T, 96>(shape, o, dout, rows, delta, stream);
    case 128: return row_delta_dims<T, 128>(shape, o, dout, rows, delta, stream);
    case 256: return row_delta_dims<T, 256>(shape, o, dout, rows, delta, stream);
    default: break;
  }
  return {Status::unsupported, "head dims outside the capability table"};
}

}  // namespace cpgold::gpu::detail

// The dtype's entry points (declared in gpu/kernels/attention/attention_launch.hpp), one translation unit per dtype:
// CPGOLD_MMA_SYNC_ENTRY_POINTS(bf16, __nv_bfloat16) defines launch_forward_bf16, launch_backward_bf16 and
// launch_row_delta_bf16.
#define CPGOLD_MMA_SYNC_ENTRY_POINTS(SUFFIX, T)                                                                        \
  namespace cpgold::gpu::detail {                                                                                      \
  Outcome launch_forward_##SUFFIX(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers,                      \
                                  cudaStream_t stream) {                                                               \
    return forward_typed<T>(plan, buffers, stream);                                                                    \
  }                                                                                                                    \
  Outcome launch_backward_##SUFFIX(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers,                    \
                                   BackwardMode mode, cudaStream_t stream) {                                           \
    return backward_typed<T>(plan, buffers, mode, stream);                                                             \
  }                                                                                                                    \
  Outcome launch_row_delta_##SUFFIX(const AttentionShape& shape, const void* o, const void* dout, int64_t rows,        \
                                    float* delta, cudaStream_t stream) {                                               \
    return row_delta_typed<T>(shape, o, dout, rows, delta, stream);                                                    \
  }                                                                                                                    \
  }  // namespace cpgold::gpu::detail
