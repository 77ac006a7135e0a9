#pragma once
// The head dimensions of the GPU layer's capability table, in one place: gpu::check_capability enforces them and the
// suites mark the cases outside them as CPU-only (fx::inside_gpu_table), in builds with and without CUDA.

namespace cpgold::sim {

// (d_qk, d_v) pairs the GPU attention kernels are built for.
inline constexpr int kGpuHeadDims[][2] = {{32, 32}, {64, 64}, {96, 96}, {128, 128}, {128, 64}, {192, 128}, {256, 256}};
// The same list as text, for messages.
inline constexpr const char* kGpuHeadDimText = "32/32, 64/64, 96/96, 128/128, 128/64, 192/128, 256/256";

constexpr bool head_dims_in_gpu_table(int dim_qk, int dim_v) {
  for (const auto& pair : kGpuHeadDims)
    if (pair[0] == dim_qk && pair[1] == dim_v) return true;
  return false;
}

}  // namespace cpgold::sim
