#pragma once
// Visible ranges under the position masks (docs/numerics.md): key position kp is visible to query position qp iff
// qp + delta - wl <= kp <= qp + delta + wr (a -1 side unbounded); keys past a segment's count are never visible.
// One definition for the mma.sync kernels (attention_kernels.cuh) and the wgmma ones (sm90/).
#include <cstdint>

namespace cpgold::gpu {

// Key indices [lo, hi] (within a KV segment at position kv_pos with kv_count rows) that some query position in
// [qp_lo, qp_hi] may see.
__device__ __forceinline__ void visible_key_range(int wl, int wr, int64_t delta, int64_t qp_lo, int64_t qp_hi,
                                                  int kv_pos, int kv_count, int& lo, int& hi) {
  int64_t l = 0, h = kv_count - 1;
  if (wl >= 0) l = max(l, qp_lo + delta - wl - kv_pos);
  if (wr >= 0) h = min(h, qp_hi + delta + wr - kv_pos);
  lo = static_cast<int>(l);
  hi = static_cast<int>(max(h, l - 1));
}

// Query indices [lo, hi] (within a Q segment) that may see some key position in [kp_lo, kp_hi].
__device__ __forceinline__ void visible_query_range(int wl, int wr, int64_t delta, int64_t kp_lo, int64_t kp_hi,
                                                    int q_pos, int q_count, int& lo, int& hi) {
  int64_t l = 0, h = q_count - 1;
  if (wr >= 0) l = max(l, kp_lo - delta - wr - q_pos);
  if (wl >= 0) h = min(h, kp_hi - delta + wl - q_pos);
  lo = static_cast<int>(l);
  hi = static_cast<int>(max(h, l - 1));
}

// True if every (query in [qp_lo, qp_hi], key in [kp_lo, kp_hi]) pair is visible.
__device__ __forceinline__ bool tile_fully_visible(int wl, int wr, int64_t delta, int64_t qp_lo, int64_t qp_hi,
                                                   int64_t kp_lo, int64_t kp_hi) {
  return (wr < 0 || kp_hi <= qp_lo + delta + wr) && (wl < 0 || kp_lo >= qp_hi + delta - wl);
}

}  // namespace cpgold::gpu
