#pragma once
// Per-dtype launchers (gpu/kernels/mma_sync/attention_bf16.cu, attention_fp16.cu) behind attention_forward/backward/row_delta.
#include <cuda_runtime_api.h>

#include "gpu/kernels/attention/attention_plan_impl.hpp"

namespace cpgold::gpu::detail {

AttentionParams base_params(const AttentionPlan::Impl& plan);
// base_params with the call's buffers (attention_launch.cpp).
AttentionParams forward_params(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers);
AttentionParams backward_params(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers);

// Calls run.template operator()<D, DV>() for the capability table's head-dim pair (d, dv) and stores its outcome in
// `out`; false (nothing run) for a pair outside the table.
template <class Run>
bool run_for_head_dims(int d, int dv, Run&& run, Outcome& out) {
  if (d == 32 && dv == 32) out = run.template operator()<32, 32>();
  else if (d == 64 && dv == 64) out = run.template operator()<64, 64>();
  else if (d == 96 && dv == 96) out = run.template operator()<96, 96>();
  else if (d == 128 && dv == 128) out = run.template operator()<128, 128>();
  else if (d == 128 && dv == 64) out = run.template operator()<128, 64>();
  else if (d == 192 && dv == 128) out = run.template operator()<192, 128>();
  else if (d == 256 && dv == 256) out = run.template operator()<256, 256>();
  else return false;
  return true;
}

// The wgmma backward's wide configuration (64 keys per CTA, dK/dV head-dim columns split between the consumer
// warpgroups) serves the pairs whose dK and dV accumulators do not fit one consumer thread: d_qk + d_v >= 320
// (192/128, 256/256); the others run 128 keys per CTA.
constexpr bool wgmma_backward_wide(int d_qk, int d_v) { return d_qk + d_v >= 320; }

// The backward's float32 workspace, allocated and freed on the call's stream: the atomic mode's dQ accumulator
// ([q_rows, h_q, d_qk]) first, then delta ([h_q, q_rows]) unless the caller gave BackwardBuffers::delta.
struct BackwardWorkspace {
  bool own_delta = false;  // else BackwardBuffers::delta, computed by attention_row_delta
  size_t accum_elems = 0;
  void* data = nullptr;
};
// The current device's workspace pool (gpu/kernels/attention/workspace_pool.cpp): created on first use, memory kept between
// calls until release_workspace_memory().
cudaError_t workspace_pool(cudaMemPool_t& pool);
// Allocates it (from workspace_pool) for head dim `dim_qk` and points p.dq_accum (and p.delta when owned) into it; on an error nothing is
// allocated and `p` is left as it was.
cudaError_t allocate_backward_workspace(AttentionParams& p, bool atomic, int dim_qk, cudaStream_t stream,
                                        BackwardWorkspace& workspace);
// Frees it (cudaSuccess when nothing was allocated).
cudaError_t free_backward_workspace(const BackwardWorkspace& workspace, cudaStream_t stream);

Outcome launch_forward_bf16(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers, cudaStream_t stream);
Outcome launch_forward_fp16(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers, cudaStream_t stream);
// The sm_90a wgmma forward (attention_sm90_*.cu; only in builds with CPGOLD_HAVE_SM90_FORWARD).
Outcome launch_forward_sm90_bf16(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers,
                                 ForwardScheduleChoice schedule, cudaStream_t stream);
Outcome launch_forward_sm90_fp16(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers,
                                 ForwardScheduleChoice schedule, cudaStream_t stream);
// The sm_90a wgmma backward (attention_sm90_backward_*.cu; only in builds with CPGOLD_HAVE_SM90_BACKWARD).
Outcome launch_backward_sm90_bf16(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers, BackwardMode mode,
                                  cudaStream_t stream);
Outcome launch_backward_sm90_fp16(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers, BackwardMode mode,
                                  cudaStream_t stream);
// Compute capability (major * 10 + minor) of the calling thread's current device, read once per device; 0 without
// one (forward_kernel.cpp).
int current_device_cc();
// Streaming multiprocessors of the calling thread's current device (read once per device; 1 without one).
int current_device_sm_count();
Outcome launch_backward_bf16(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers, BackwardMode mode,
                             cudaStream_t stream);
Outcome launch_backward_fp16(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers, BackwardMode mode,
                             cudaStream_t stream);
Outcome launch_row_delta_bf16(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                              cudaStream_t stream);
Outcome launch_row_delta_fp16(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                              cudaStream_t stream);

}  // namespace cpgold::gpu::detail
