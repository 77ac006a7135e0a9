#pragma once
// Per-dtype launchers (gpu/kernels/attention_bf16.cu, attention_fp16.cu) behind attention_forward/backward/row_delta.
#include <cuda_runtime_api.h>

#include "gpu/kernels/attention_plan_impl.hpp"

namespace cpgold::gpu::detail {

AttentionParams base_params(const AttentionPlan::Impl& plan);

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
