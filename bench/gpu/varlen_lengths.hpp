#pragma once
// The varlen batch of the GPU benchmarks (bench/gpu/varlen_batches.md): sequence lengths cycling
// 512, 1536, 2560, 3584, 1024, 3072, 2048, 4096, the last one cut so that the lengths sum to `total` tokens.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace cpgold::bench {

inline std::vector<int32_t> varlen_lengths(int64_t total) {
  static const int32_t cycle[] = {512, 1536, 2560, 3584, 1024, 3072, 2048, 4096};
  std::vector<int32_t> lens;
  int64_t sum = 0;
  for (int i = 0; sum < total; ++i) {
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(cycle[i % 8], total - sum));
    lens.push_back(len);
    sum += len;
  }
  return lens;
}

}  // namespace cpgold::bench
