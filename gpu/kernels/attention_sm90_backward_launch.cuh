#pragma once
// Launch template of the sm_90a wgmma backward (gpu/kernels/sm90/attention_backward_sm90.cuh) behind
// attention_backward, shared by the per-dtype translation units attention_sm90_backward_bf16.cu / _fp16.cu, which
// are compiled for sm_90a only (gpu/CMakeLists.txt). Head dims 64/64 and 128/128 (docs/gpu-kernels.md, "Backward
// kernels"): the dK/dV pass runs on the plan's 128-row KV tiles, the delta kernel, the deterministic dQ pass and the
// atomic mode's dQ finish on its 128-row Q tiles. The workspace (float32 delta unless the caller gives
// BackwardBuffers::delta; the atomic mode's dQ accumulator) is allocated and freed on the stream, as the mma.sync
// backward does.
#include <string>

#include "gpu/kernels/attention_launch.hpp"
#include "gpu/kernels/sm90/attention_backward_sm90.cuh"

namespace cpgold::gpu::detail {

template <class T, int D>
Outcome backward_sm90_dims(AttentionParams p, BackwardMode mode, cudaStream_t stream,
                           const AttentionPlan::Impl& plan) {
  static_assert(sm90::BackwardSm90Config<T, D, true>::kBlockN == kLargeKvTileRows, "128-row KV tiles");
  static_assert(sm90::BackwardDqSm90Config<T, D>::kBlockM == kLargeTileRows, "128-row Q tiles");
  p.q_tiles = plan.q_tiles_large;
  p.q_tile_count = plan.q_tile_large_count;
  p.kv_tiles = plan.kv_tiles_large;
  p.kv_tile_count = plan.kv_tile_large_count;
  if (p.heads_q == 0 || (p.q_tile_count == 0 && p.kv_tile_count == 0)) return {};
  const bool atomic = mode == BackwardMode::atomic;
  const bool own_delta = p.delta == nullptr;  // else BackwardBuffers::delta, computed by attention_row_delta
  const size_t delta_elems = own_delta ? static_cast<size_t>(p.heads_q) * p.q_rows : 0;
  const size_t accum_elems = atomic ? static_cast<size_t>(p.q_rows) * p.heads_q * D : 0;
  const size_t bytes = (delta_elems + accum_elems) * sizeof(float);
  void* workspace = nullptr;
  if (bytes > 0) {
    if (cudaError_t e = cudaMallocAsync(&workspace, bytes, stream); e != cudaSuccess)
      return {Status::cuda_error, std::string("attention_backward (wgmma): cudaMallocAsync of the workspace: ") +
                                      cudaGetErrorString(e)};
  }
  p.dq_accum = static_cast<float*>(workspace);
  if (own_delta) p.delta = static_cast<float*>(workspace) + accum_elems;
  const std::string err =
      atomic ? sm90::launch_backward_sm90<T, D, true>(p, sm90::Watchdog{}, stream, own_delta)
             : sm90::launch_backward_sm90<T, D, false>(p, sm90::Watchdog{}, stream, own_delta);
  Outcome out;
  if (!err.empty()) out = {Status::cuda_error, "attention_backward (wgmma): " + err};
  if (workspace != nullptr) {
    if (cudaError_t e = cudaFreeAsync(workspace, stream); e != cudaSuccess && out.ok())
      out = {Status::cuda_error, std::string("attention_backward (wgmma): cudaFreeAsync of the workspace: ") +
                                     cudaGetErrorString(e)};
  }
  return out;
}

template <class T>
Outcome backward_sm90_typed(const AttentionPlan::Impl& plan, const BackwardBuffers& b, BackwardMode mode,
                            cudaStream_t stream) {
  AttentionParams p = base_params(plan);
  p.q = b.q;
  p.k = b.k;
  p.v = b.v;
  p.o = const_cast<void*>(b.o);
  p.lse = const_cast<float*>(b.lse);
  p.dout = b.dout;
  p.dq = b.dq;
  p.dk = b.dk;
  p.dv = b.dv;
  p.dq_sum = b.dq_sum.data;
  p.dk_sum = b.dk_sum.data;
  p.dv_sum = b.dv_sum.data;
  p.q_sum_rows = b.dq_sum.rows;
  p.kv_sum_rows = b.dk_sum.rows;
  p.dq_sum_assign = b.dq_sum.assign;
  p.dk_sum_assign = b.dk_sum.assign;
  p.dv_sum_assign = b.dv_sum.assign;
  p.dq_result = b.dq_sum.result;
  p.dk_result = b.dk_sum.result;
  p.dv_result = b.dv_sum.result;
  p.delta = const_cast<float*>(b.delta);
  const int d = plan.shape.dim_qk, dv = plan.shape.dim_v;
  if (d == 64 && dv == 64) return backward_sm90_dims<T, 64>(p, mode, stream, plan);
  if (d == 128 && dv == 128) return backward_sm90_dims<T, 128>(p, mode, stream, plan);
  return {Status::unsupported, "attention_backward (wgmma): head dims d_qk=" + std::to_string(d) +
                                   ", d_v=" + std::to_string(dv) + " are not served by the wgmma backward"};
}

}  // namespace cpgold::gpu::detail
