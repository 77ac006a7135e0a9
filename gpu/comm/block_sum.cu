// launch_sum_blocks (gpu/comm/block_sum.hpp): one thread per element, grid-stride, the blocks added in order.
#include "gpu/comm/block_sum.hpp"

namespace cpgold::gpu {
namespace {

constexpr int kThreads = 256;

int blocks_for(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 16 ? (b == 0 ? 1 : b) : 65535 * 16);
}

__global__ void sum_blocks_kernel(float* out, const float* in, int blocks, size_t count) {
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count; e += size_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int b = 0; b < blocks; ++b) s += in[static_cast<size_t>(b) * count + e];
    out[e] = s;
  }
}

}  // namespace

cudaError_t launch_sum_blocks(float* out, const float* in, int blocks, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  sum_blocks_kernel<<<blocks_for(count), kThreads, 0, stream>>>(out, in, blocks, count);
  return cudaGetLastError();
}

}  // namespace cpgold::gpu
