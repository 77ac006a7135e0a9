#pragma once
// The GPU suite's skip rule: a test case without a CUDA device prints "SKIPPED: no CUDA device" and returns
// (CTest reports it as skipped through SKIP_REGULAR_EXPRESSION).
#include <cstdio>

#include "gpu/kernels/attention/attention.hpp"

namespace cpgold::gpu_test {

inline bool have_device() {
  static const int count = gpu::cuda_device_count();
  return count > 0;
}

}  // namespace cpgold::gpu_test

#define CPGOLD_REQUIRE_DEVICE()                 \
  do {                                          \
    if (!::cpgold::gpu_test::have_device()) {   \
      std::printf("SKIPPED: no CUDA device\n"); \
      return;                                   \
    }                                           \
  } while (0)
