// bf16 instantiations of the attention kernels (one translation unit per dtype keeps nvcc runs parallel).
#include "gpu/kernels/mma_sync/attention_launch.cuh"

namespace cpgold::gpu::detail {

Outcome launch_forward_bf16(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers, cudaStream_t stream) {
  return forward_typed<__nv_bfloat16>(plan, buffers, stream);
}

Outcome launch_backward_bf16(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers, BackwardMode mode,
                             cudaStream_t stream) {
  return backward_typed<__nv_bfloat16>(plan, buffers, mode, stream);
}

Outcome launch_row_delta_bf16(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                              cudaStream_t stream) {
  return row_delta_typed<__nv_bfloat16>(shape, o, dout, rows, delta, stream);
}

}  // namespace cpgold::gpu::detail
