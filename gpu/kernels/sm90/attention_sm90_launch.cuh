#pragma once
// Launch template of the sm_90a wgmma forward (gpu/kernels/sm90/attention_forward_sm90.cuh) behind
// attention_forward, shared by the per-dtype translation units attention_sm90_bf16.cu / attention_sm90_fp16.cu,
// which are compiled for sm_90a only (gpu/CMakeLists.txt). The configuration of every head-dim pair of the
// capability table (docs/gpu-kernels.md, "Forward kernels"): TMA loads, two consumer warpgroups of 64 query rows
// (128-row Q tiles: the plan's large tile list) in ping-pong, key tiles of 128 rows (64 for d 256, whose O
// accumulators take 128 registers per thread and whose shared tiles fill 193 KB at that size); and for short
// segments (ForwardSchedule, docs/gpu-kernels.md "Forward schedules") 64-row Q tiles (the small list), in a grid of
// one CTA per (tile, head) or a persistent grid over the plan's tile order (sequences heaviest first, each
// sequence's tiles together).
#include <string>

#include "gpu/kernels/attention/attention_launch.hpp"
#include "gpu/kernels/sm90/attention_forward_sm90.cuh"

namespace cpgold::gpu::detail {

template <class T, int D, int DV>
using WgmmaForwardConfig =
    sm90::ForwardSm90Config<T, D, DV, 2, (D > 192 ? 64 : 128), sm90::Loader::tma, /*PINGPONG=*/true>;
// 64-row Q tiles (ForwardSchedule tile64, persistent64): one consumer warpgroup and two CTAs per SM, key tiles of
// 64 rows (the shared tiles of two CTAs fit an SM up to d_qk 192; wgmma_short_schedules_serve).
template <class T, int D, int DV>
using WgmmaForwardSmallConfig = sm90::ForwardSm90Config<T, D, DV, 1, 64, sm90::Loader::tma, /*PINGPONG=*/false>;

template <class Cfg, bool PERSISTENT_OK>
Outcome forward_sm90_run(AttentionParams p, cudaStream_t stream, const AttentionPlan::Impl& plan, bool persistent) {
  const bool small = Cfg::kBlockM == kSmallTileRows;
  static_assert(Cfg::kBlockM == kSmallTileRows || Cfg::kBlockM == kLargeTileRows, "the plan's Q tile heights");
  p.q_tiles = small ? plan.q_tiles_small : plan.q_tiles_large;
  p.q_tile_count = small ? plan.q_tile_small_count : plan.q_tile_large_count;
  if (p.q_tile_count == 0 || p.heads_q == 0) return {};
  // Tensor maps over this call's buffers: three host-side encodes (no device work, no driver round trip), passed
  // to the kernel as a __grid_constant__ parameter.
  sm90::ForwardTensorMaps maps{};
  if (std::string err = sm90::encode_forward_maps<Cfg>(p, maps); !err.empty())
    return {Status::cuda_error, "attention_forward (wgmma): " + err};
  // Persistent: as many CTAs as the SMs hold at once, over the plan's tile order.
  std::string err;
  if constexpr (PERSISTENT_OK) {
    if (persistent)
      err = sm90::launch_forward_sm90<Cfg, true>(p, maps, sm90::Watchdog{}, stream,
                                                 small ? plan.q_order_small : plan.q_order_large,
                                                 current_device_sm_count() * Cfg::kCtasPerSm);
    else
      err = sm90::launch_forward_sm90<Cfg>(p, maps, sm90::Watchdog{}, stream);
  } else {
    (void)persistent;
    err = sm90::launch_forward_sm90<Cfg>(p, maps, sm90::Watchdog{}, stream);
  }
  if (!err.empty()) return {Status::cuda_error, "attention_forward (wgmma): " + err};
  return {};
}

template <class T, int D, int DV>
Outcome forward_sm90_dims(AttentionParams p, cudaStream_t stream, const AttentionPlan::Impl& plan,
                          ForwardScheduleChoice schedule) {
  static_assert(WgmmaForwardConfig<T, D, DV>::kBlockM == kLargeTileRows, "128-row tiles: the plan's large list");
  // The short-chunk schedules (64-row tiles, the persistent grid) up to d_qk 192 (wgmma_short_schedules_serve): two
  // CTAs of d_qk 256 do not fit an SM, and the loop state of a persistent CTA makes its consumers spill there.
  if constexpr (D <= 192) {
    static_assert(WgmmaForwardSmallConfig<T, D, DV>::kBlockM == kSmallTileRows, "64-row tiles: the small list");
    if (schedule.tile_rows == kSmallTileRows)
      return forward_sm90_run<WgmmaForwardSmallConfig<T, D, DV>, true>(p, stream, plan, schedule.persistent);
    return forward_sm90_run<WgmmaForwardConfig<T, D, DV>, true>(p, stream, plan, schedule.persistent);
  } else {
    return forward_sm90_run<WgmmaForwardConfig<T, D, DV>, false>(p, stream, plan, false);
  }
}

template <class T>
Outcome forward_sm90_typed(const AttentionPlan::Impl& plan, const ForwardBuffers& b, ForwardScheduleChoice schedule,
                           cudaStream_t stream) {
  const AttentionParams p = forward_params(plan, b);
  const int d = plan.shape.dim_qk, dv = plan.shape.dim_v;
  Outcome out;
  if (run_for_head_dims(d, dv, [&]<int D, int DV>() { return forward_sm90_dims<T, D, DV>(p, stream, plan, schedule); },
                        out))
    return out;
  return {Status::unsupported, "attention_forward (wgmma): head dims d_qk=" + std::to_string(d) +
                                   ", d_v=" + std::to_string(dv) + " are not served by the wgmma forward"};
}

}  // namespace cpgold::gpu::detail
