#pragma once
// Dense row-major tensors of the reference: THD tensors [t, h, d] and LSE [h, t].
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace cpgold {

// x: [rows, heads, dim], row-major; rows are packed by cu_seqlens_padded.
template <class T>
struct Tensor3 {
  int64_t rows = 0, heads = 0, dim = 0;
  std::vector<T> values;

  Tensor3() = default;
  Tensor3(int64_t rows_, int64_t heads_, int64_t dim_, T fill = T(0))
      : rows(rows_), heads(heads_), dim(dim_), values(static_cast<std::size_t>(rows_ * heads_ * dim_), fill) {}

  int64_t row_stride() const { return heads * dim; }
  T* at(int64_t row, int64_t head) { return values.data() + (row * heads + head) * dim; }
  const T* at(int64_t row, int64_t head) const { return values.data() + (row * heads + head) * dim; }
  T& operator()(int64_t row, int64_t head, int64_t x) { return at(row, head)[x]; }
  const T& operator()(int64_t row, int64_t head, int64_t x) const { return at(row, head)[x]; }
  bool same_shape(const Tensor3& other) const {
    return rows == other.rows && heads == other.heads && dim == other.dim;
  }
};

// lse: [heads, rows], natural log; rows are the rows of the Q tensor of the call.
template <class T>
struct LseTensor {
  int64_t heads = 0, rows = 0;
  std::vector<T> values;

  LseTensor() = default;
  LseTensor(int64_t heads_, int64_t rows_, T fill) : heads(heads_), rows(rows_), values(static_cast<std::size_t>(heads_ * rows_), fill) {}
  T& operator()(int64_t head, int64_t row) { return values[static_cast<std::size_t>(head * rows + row)]; }
  const T& operator()(int64_t head, int64_t row) const { return values[static_cast<std::size_t>(head * rows + row)]; }
};

template <class To, class From>
Tensor3<To> tensor_cast(const Tensor3<From>& x) {
  Tensor3<To> y(x.rows, x.heads, x.dim);
  const std::int64_t n = static_cast<std::int64_t>(x.values.size());
#pragma omp parallel for schedule(static) if (n > (std::int64_t{1} << 18))
  for (std::int64_t i = 0; i < n; ++i) y.values[static_cast<std::size_t>(i)] = static_cast<To>(x.values[static_cast<std::size_t>(i)]);
  return y;
}

// Rows of x gathered as To: out[i] = x[rows[i]] ([rows.size(), h, d]; a row index < 0 gives a zero row).
template <class To, class From>
Tensor3<To> gather_rows_as(const Tensor3<From>& x, const std::vector<std::int64_t>& rows) {
  Tensor3<To> out(static_cast<std::int64_t>(rows.size()), x.heads, x.dim);
  const std::int64_t s = x.row_stride(), n = static_cast<std::int64_t>(rows.size());
#pragma omp parallel for schedule(static) if (n * s > (std::int64_t{1} << 18))
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t from = rows[static_cast<std::size_t>(i)];
    if (from >= 0) std::copy_n(x.values.begin() + from * s, s, out.values.begin() + i * s);
  }
  return out;
}
template <class T>
Tensor3<T> gather_rows(const Tensor3<T>& x, const std::vector<std::int64_t>& rows) {
  return gather_rows_as<T>(x, rows);
}

template <class To, class From>
LseTensor<To> lse_cast(const LseTensor<From>& x) {
  LseTensor<To> y(x.heads, x.rows, To(0));
  for (std::size_t i = 0; i < x.values.size(); ++i) y.values[i] = static_cast<To>(x.values[i]);
  return y;
}

}  // namespace cpgold
