#pragma once
// The arithmetic of the single-GPU communicator's reduce-scatter (gpu/comm/local_communicator.cpp): the W blocks
// that the ranks sent to one rank, summed in rank order so that the result is bitwise reproducible.
#include <cstddef>

#include <cuda_runtime_api.h>

namespace cpgold::gpu {

// out: [count]; out = in[0] + in[1] + ... + in[blocks-1] in this order (in: [blocks, count]). Enqueues on `stream`
// and returns the launch error (cudaSuccess when count is 0).
cudaError_t launch_sum_blocks(float* out, const float* in, int blocks, size_t count, cudaStream_t stream);

}  // namespace cpgold::gpu
