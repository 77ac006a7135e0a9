#pragma once
// Random THD layouts and tensors for the reference tests (own generator: identical on every platform).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "reference/attention_call.hpp"
#include "reference/splitmix64.hpp"
#include "reference/tensor.hpp"

namespace cpgold::test {

using cpgold::SplitMix64;  // reference/splitmix64.hpp

// Lengths include 0 and 1; padding between sequences and tail rows are random.
inline ThdLayout random_layout(SplitMix64& rng, int batch, int max_len, bool same_q_kv, int tail_rows) {
  std::vector<int32_t> lq, pq, lk, pk;
  for (int b = 0; b < batch; ++b) {
    const int pick = rng.below(6);
    const int32_t len_q = pick == 0 ? 0 : pick == 1 ? 1 : rng.below(max_len + 1);
    const int32_t len_k = same_q_kv ? len_q : (rng.below(5) == 0 ? 0 : rng.below(max_len + 1));
    lq.push_back(len_q);
    pq.push_back(len_q + rng.below(4));
    lk.push_back(len_k);
    pk.push_back(len_k + rng.below(4));
  }
  ThdLayout layout;
  layout.q = make_packed_sequences(lq, pq, -1, "q");
  layout.kv = make_packed_sequences(lk, pk, -1, "kv");
  layout.q.total_rows += tail_rows;
  layout.kv.total_rows += tail_rows;
  layout.validate();
  return layout;
}

// Values in [-1, 1]; rows outside the valid tokens get `pad` (e.g. NaN).
inline Tensor3<double> random_tensor(SplitMix64& rng, const PackedSequences& seqs, int64_t heads, int64_t dim,
                                     double pad = 0.0) {
  Tensor3<double> x(seqs.total_rows, heads, dim);
  for (int64_t r = 0; r < x.rows; ++r) {
    const bool valid = seqs.is_valid_row(r);
    for (int64_t i = 0; i < heads * dim; ++i) x.values[r * heads * dim + i] = valid ? 2.0 * rng.uniform() - 1.0 : pad;
  }
  return x;
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

// max |a - b| / max |b| over entries where b is finite; infinite entries must agree exactly.
inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(b[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    err = std::max(err, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return scale == 0 ? err : err / scale;
}

}  // namespace cpgold::test
