#pragma once
// The online softmax (exp2 domain) of a row whose scores the four lanes of a quad hold, shared by both kernel
// generations' forwards: one step per key block, then the row's end.
#include <cmath>
#include <cstdint>

#include "gpu/kernels/attention/kernel_params.hpp"

namespace cpgold::gpu {

struct SoftmaxStep {
  float alpha;  // rescales the running sum and output: exp2((old max - new max) * sl2)
  float bias;   // p = exp2(fmaf(s, sl2, bias))
};

// m: this lane's maximum of the row's new scores; sl2: softmax scale * log2(e). row_max becomes the running maximum
// over the quad; a row with no visible key yet keeps -inf and uses 0 in its place (no (-inf) - (-inf)).
__device__ __forceinline__ SoftmaxStep online_softmax_step(float& row_max, float m, float sl2) {
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  const float m_new = fmaxf(row_max, m);
  const float m_use = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = exp2f((row_max - m_use) * sl2);
  row_max = m_new;
  return {alpha, -m_use * sl2};
}

// The end of a row: the quad's sum of its p (row_sum: this lane's share), its LSE (max * scale + ln(sum), -inf for
// a row with no visible key) written to row first_row + r of head `head` where `writes`; returns 1 / sum (0 for no
// visible key), the factor of the row's output.
__device__ __forceinline__ float finish_row(const AttentionParams& p, float row_sum, float row_max, int head,
                                            int64_t first_row, int r, bool writes) {
  float l = row_sum;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  if (writes)
    p.lse[static_cast<int64_t>(head) * p.q_rows + first_row + r] =
        l > 0.f ? row_max * p.softmax_scale + logf(l) : -INFINITY;
  return inv;
}

}  // namespace cpgold::gpu
