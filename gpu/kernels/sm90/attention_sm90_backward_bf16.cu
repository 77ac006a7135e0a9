// bf16 instantiations of the sm_90a wgmma backward (compiled for sm_90a only; one translation unit per dtype).
#include "gpu/kernels/sm90/attention_sm90_backward_launch.cuh"

namespace cpgold::gpu::detail {

Outcome launch_backward_sm90_bf16(const AttentionPlan::Impl& plan, const BackwardBuffers& buffers, BackwardMode mode,
                                  cudaStream_t stream) {
  return backward_sm90_typed<__nv_bfloat16>(plan, buffers, mode, stream);
}

}  // namespace cpgold::gpu::detail
