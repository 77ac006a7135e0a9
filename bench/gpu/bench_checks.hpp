#pragma once
// Error exits of the GPU benchmark programs: a CUDA error or a failed kernel call ends the program with exit 2 and
// the operation's name.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gpu/kernels/attention/attention.hpp"

namespace cpgold::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}
inline void check(const gpu::Outcome& o, const char* what) {
  if (!o.ok()) {
    std::fprintf(stderr, "%s: %s %s\n", what, std::string(gpu::status_name(o.status)).c_str(), o.message.c_str());
    std::exit(2);
  }
}

}  // namespace cpgold::bench
