#pragma once
// Launch template of the sm_90a wgmma backward (gpu/kernels/sm90/attention_backward_sm90.cuh) behind
// attention_backward, shared by the per-dtype translation units attention_sm90_backward_bf16.cu / _fp16.cu, which
// are compiled for sm_90a only (gpu/CMakeLists.txt). Head dims 32/32, 64/64, 96/96, 128/128 and 128/64 with the dK/dV
// pass on the plan's 128-row KV tiles, 192/128 and 256/256 (the wide configuration) on its 64-row KV tiles
// (docs/gpu-kernels.md, "Backward kernels"); the delta kernel,
// the deterministic dQ pass and the atomic mode's dQ finish on its 128-row Q tiles. The workspace (float32 delta unless the caller gives
// BackwardBuffers::delta; the atomic mode's dQ accumulator) is allocated from the library's workspace pool and freed
// on the stream, as the mma.sync backward does.
#include <string>

#include "gpu/kernels/attention/attention_launch.hpp"
#include "gpu/kernels/sm90/attention_backward_sm90.cuh"

namespace cpgold::gpu::detail {

template <class T, int D, int DV>
Outcome backward_sm90_dims(AttentionParams p, BackwardMode mode, cudaStream_t stream,
                           const AttentionPlan::Impl& plan) {
  // The wide configuration (192/128, 256/256) on 64-row KV tiles; the rest on 128-row ones.
  constexpr bool kWideDims = wgmma_backward_wide(D, DV);
  static_assert(sm90::BackwardDqSm90Config<T, D, DV>::kBlockM == kLargeTileRows, "128-row Q tiles");
  p.q_tiles = plan.q_tiles_large;
  p.q_tile_count = plan.q_tile_large_count;
  if constexpr (kWideDims) {
    static_assert(sm90::BackwardWideSm90Config<T, D, DV, true>::kBlockN == kKvTileRows, "64-row KV tiles");
    p.kv_tiles = plan.kv_tiles;
    p.kv_tile_count = plan.kv_tile_count;
  } else {
    static_assert(sm90::BackwardSm90Config<T, D, true>::kBlockN == kLargeKvTileRows, "128-row KV tiles");
    p.kv_tiles = plan.kv_tiles_large;
    p.kv_tile_count = plan.kv_tile_large_count;
  }
  if (p.heads_q == 0 || (p.q_tile_count == 0 && p.kv_tile_count == 0)) return {};
  const bool atomic = mode == BackwardMode::atomic;
  BackwardWorkspace workspace;
  if (cudaError_t e = allocate_backward_workspace(p, atomic, D, stream, workspace); e != cudaSuccess)
    return {Status::cuda_error, std::string("attention_backward (wgmma): cudaMallocAsync of the workspace: ") +
                                    cudaGetErrorString(e)};
  const bool own_delta = workspace.own_delta;
  std::string err;
  if constexpr (kWideDims) {
    err = atomic ? sm90::launch_backward_wide_sm90<T, D, DV, true>(p, sm90::Watchdog{}, stream, own_delta)
                 : sm90::launch_backward_wide_sm90<T, D, DV, false>(p, sm90::Watchdog{}, stream, own_delta);
  } else {
    // The schedules of run B2 (docs/hopper-kernels.md, "Backward v2"): atomic mode with dQ added by TMA reduce-add;
    // d_qk 128 (96 as 128 columns) splits dQ's columns between the warpgroups and overlaps the softmax with dP's
    // product at d_v above 64; d_qk 64 (32 as 64 columns) splits the keys (each warpgroup adds its own keys' share,
    // no barrier between the two).
    constexpr bool kWide = D > 64;
    constexpr sm90::DqSplit kSplit = kWide ? sm90::DqSplit::columns : sm90::DqSplit::keys;
    err = atomic ? sm90::launch_backward_sm90<T, D, true, kSplit, (kWide && DV > 64), true, DV>(p, sm90::Watchdog{},
                                                                                              stream, own_delta)
                 : sm90::launch_backward_sm90<T, D, false, sm90::DqSplit::columns, false, false, DV>(
                       p, sm90::Watchdog{}, stream, own_delta);
  }
  Outcome out;
  if (!err.empty()) out = {Status::cuda_error, "attention_backward (wgmma): " + err};
  if (cudaError_t e = free_backward_workspace(workspace, stream); e != cudaSuccess && out.ok())
    out = {Status::cuda_error, std::string("attention_backward (wgmma): cudaFreeAsync of the workspace: ") +
                                   cudaGetErrorString(e)};
  return out;
}

template <class T>
Outcome backward_sm90_typed(const AttentionPlan::Impl& plan, const BackwardBuffers& b, BackwardMode mode,
                            cudaStream_t stream) {
  const AttentionParams p = backward_params(plan, b);
  const int d = plan.shape.dim_qk, dv = plan.shape.dim_v;
  if (d == 32 && dv == 32) return backward_sm90_dims<T, 32, 32>(p, mode, stream, plan);
  if (d == 64 && dv == 64) return backward_sm90_dims<T, 64, 64>(p, mode, stream, plan);
  if (d == 96 && dv == 96) return backward_sm90_dims<T, 96, 96>(p, mode, stream, plan);
  if (d == 128 && dv == 128) return backward_sm90_dims<T, 128, 128>(p, mode, stream, plan);
  if (d == 128 && dv == 64) return backward_sm90_dims<T, 128, 64>(p, mode, stream, plan);
  if (d == 192 && dv == 128) return backward_sm90_dims<T, 192, 128>(p, mode, stream, plan);
  if (d == 256 && dv == 256) return backward_sm90_dims<T, 256, 256>(p, mode, stream, plan);
  return {Status::unsupported, "attention_backward (wgmma): head dims d_qk=" + std::to_string(d) +
                                   ", d_v=" + std::to_string(dv) + " are not served by the wgmma backward"};
}

}  // namespace cpgold::gpu::detail
