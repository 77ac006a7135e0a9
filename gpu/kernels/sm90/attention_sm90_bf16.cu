// bf16 instantiations of the sm_90a wgmma forward (compiled for sm_90a only; one translation unit per dtype).
#include "gpu/kernels/sm90/attention_sm90_launch.cuh"

namespace cpgold::gpu::detail {

Outcome launch_forward_sm90_bf16(const AttentionPlan::Impl& plan, const ForwardBuffers& buffers,
                                 ForwardScheduleChoice schedule, cudaStream_t stream) {
  return forward_sm90_typed<__nv_bfloat16>(plan, buffers, schedule, stream);
}

}  // namespace cpgold::gpu::detail
