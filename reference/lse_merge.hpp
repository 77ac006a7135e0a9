#pragma once
// Merging partial attention results (O_i, LSE_i) over disjoint key sets, as CP steps and split-KV kernels do.
// Stable form: max + log1p(exp(min - max)); two empty partials (-inf, -inf) merge to -inf, never NaN.
#include <cmath>
#include <limits>

namespace cpgold {

template <class T>
T lse_merge(T a, T b) {
  const T hi = a > b ? a : b;
  const T lo = a > b ? b : a;
  if (hi == -std::numeric_limits<T>::infinity()) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// Weight of a partial in the merged output: exp(lse_i - lse), 0 for an empty partial.
template <class T>
T lse_weight(T lse_partial, T lse_merged) {
  if (lse_partial == -std::numeric_limits<T>::infinity()) return T(0);
  return std::exp(lse_partial - lse_merged);
}

// Running merge of one row: (o, lse) <- merge((o, lse), (o_i, lse_i)); o, o_i: [dim].
template <class T>
void merge_partial_row(T* o, T& lse, const T* o_i, T lse_i, long dim) {
  const T merged = lse_merge(lse, lse_i);
  const T w_old = lse_weight(lse, merged);
  const T w_new = lse_weight(lse_i, merged);
  for (long x = 0; x < dim; ++x) o[x] = o[x] * w_old + o_i[x] * w_new;
  lse = merged;
}

}  // namespace cpgold
