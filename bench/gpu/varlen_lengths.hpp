#pragma once
// The varlen batch of the GPU benchmarks (bench/gpu/varlen_batches.md): sequence lengths cycling
// 512, 1536, 2560, 3584, 1024, 3072, 2048, 4096 (each times `scale`: long-context batches for the CP benchmarks;
// each divided by `divide`: batches of CP-chunk-length sequences, 64..512 at 8), the last one cut so that the
// lengths sum to `total` tokens. `divide` must divide 512 (the callers check).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "sim/case/case_spec.hpp"

namespace cpgold::bench {

inline std::vector<int32_t> varlen_lengths(int64_t total, int scale = 1, int divide = 1) {
  static const int32_t cycle[] = {512, 1536, 2560, 3584, 1024, 3072, 2048, 4096};
  std::vector<int32_t> lens;
  int64_t sum = 0;
  for (int i = 0; sum < total; ++i) {
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(int64_t{cycle[i % 8]} * scale / divide, total - sum));
    lens.push_back(len);
    sum += len;
  }
  return lens;
}

// The benchmarks' CP case: causal, bf16, `heads` query and KV heads of dimension `dim`, sequences `lens`, W ranks of
// comm type `comm` (a2a groups of 2 for a2a+p2p).
inline sim::CaseSpec causal_varlen_case(const std::vector<int32_t>& lens, int W, sim::CommType comm, int heads,
                                        int dim) {
  sim::CaseSpec s;
  s.seqlens_q = lens;
  s.cp_size = W;
  s.comm = comm;
  s.causal = true;
  s.window = normalize_window(true, {});
  s.heads_q = heads;
  s.heads_kv = heads;
  s.dim_qk = dim;
  s.dim_v = dim;
  s.dtype = DType::bf16;
  s.a2a_size = 2;
  return s;
}

}  // namespace cpgold::bench
