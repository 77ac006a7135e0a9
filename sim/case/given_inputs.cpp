#include "sim/case/given_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "reference/input_error.hpp"

namespace cpgold::sim {

namespace {

const PackedSequences& side_of(const ThdLayout& l, InputTensor which) {
  return which == InputTensor::q || which == InputTensor::dout ? l.q : l.kv;
}

std::string value_text(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buffer[48];
  std::snprintf(buffer, sizeof buffer, "%.17g", x);
  return buffer;
}

// "row 17 (sequence 1, token 3)", "row 20 (padding of sequence 1)", "row 40 (tail row)".
std::string row_text(const PackedSequences& side, int64_t row) {
  std::ostringstream out;
  out << "row " << row;
  const auto it = std::upper_bound(side.cu_seqlens_padded.begin(), side.cu_seqlens_padded.end(), row);
  const int b = static_cast<int>(it - side.cu_seqlens_padded.begin()) - 1;
  if (b < 0 || b >= side.batch()) out << " (tail row)";
  else if (row - side.offset(b) < side.length(b)) out << " (sequence " << b << ", token " << row - side.offset(b) << ")";
  else out << " (padding of sequence " << b << ")";
  return out.str();
}

std::string element_text(const CaseSpec& spec, InputTensor which, int64_t heads, int64_t dim, int64_t index) {
  const ThdLayout l = layout(spec);
  const int64_t row = index / (heads * dim), head = index / dim % heads, column = index % dim;
  std::ostringstream out;
  out << input_tensor_name(which) << " " << row_text(side_of(l, which), row) << ", head " << head << ", column "
      << column;
  return out.str();
}

void check_dims(const CaseSpec& spec, InputTensor which, const std::vector<int64_t>& dims) {
  const std::vector<int64_t> want = input_tensor_dims(spec, which);
  if (dims != want) {
    std::ostringstream got, expected;
    for (size_t i = 0; i < dims.size(); ++i) got << (i ? ", " : "[") << dims[i];
    got << (dims.empty() ? "[]" : "]");
    expected << "[" << want[0] << ", " << want[1] << ", " << want[2] << "]";
    fail_input(std::string("inputs.") + input_tensor_name(which), "shape ", got.str(), " does not match the case: ",
               input_tensor_name(which), " is [rows, heads, dim] = ", expected.str(),
               " in the global padded THD layout (total_tokens, heads, dim of the case)");
  }
}

// The value as the float the fixture stores, or NaN-checked failure: false when `x` is not a value of the dtype.
template <class T>
bool representable(DType dtype, T x, float& out) {
  if (std::isnan(x)) {
    out = std::numeric_limits<float>::quiet_NaN();
    return true;
  }
  const float f = static_cast<float>(x);
  if (static_cast<T>(f) != x) return false;  // a double no float holds
  out = f;
  return round_to(dtype, f) == f;  // infinities round to themselves; a finite value past the dtype's range does not
}

template <class T>
Tensor3<float> convert(const CaseSpec& spec, InputTensor which, const std::vector<int64_t>& dims, const T* values) {
  check_dims(spec, which, dims);
  Tensor3<float> t(dims[0], dims[1], dims[2]);
  const int64_t n = static_cast<int64_t>(t.values.size());
  int64_t first_bad = n;
#pragma omp parallel for schedule(static) reduction(min : first_bad) if (n > (int64_t{1} << 18))
  for (int64_t i = 0; i < n; ++i) {
    float f = 0;
    if (!representable(spec.dtype, values[i], f)) first_bad = std::min(first_bad, i);
    t.values[static_cast<size_t>(i)] = f;
  }
  if (first_bad < n) {
    const double x = static_cast<double>(values[first_bad]);
    fail_input(std::string("inputs.") + input_tensor_name(which), element_text(spec, which, dims[1], dims[2], first_bad),
               ": value ", value_text(x), " is not representable in ", dtype_name(spec.dtype), " (nearest: ",
               value_text(round_to(spec.dtype, x)),
               "); give the tensors in the case's dtype, as the run under test computed with them");
  }
  return t;
}

// Smallest flat index of a non-finite element in a valid row, and how many there are.
std::pair<int64_t, int64_t> nonfinite_valid(const PackedSequences& side, const Tensor3<float>& t) {
  const int64_t row_elems = t.heads * t.dim, n = t.rows * row_elems;
  int64_t first = n, count = 0;
#pragma omp parallel for schedule(static) reduction(min : first) reduction(+ : count) if (n > (int64_t{1} << 18))
  for (int64_t row = 0; row < t.rows; ++row) {
    if (!side.is_valid_row(row)) continue;
    const float* x = t.values.data() + row * row_elems;
    for (int64_t e = 0; e < row_elems; ++e)
      if (!std::isfinite(x[e])) {
        first = std::min(first, row * row_elems + e);
        ++count;
      }
  }
  return {first, count};
}

}  // namespace

const char* input_tensor_name(InputTensor which) {
  switch (which) {
    case InputTensor::q: return "q";
    case InputTensor::k: return "k";
    case InputTensor::v: return "v";
    case InputTensor::dout: return "dout";
  }
  return "?";
}

std::vector<int64_t> input_tensor_dims(const CaseSpec& spec, InputTensor which) {
  const ThdLayout l = layout(spec);
  switch (which) {
    case InputTensor::q: return {l.q.total_rows, spec.heads_q, spec.dim_qk};
    case InputTensor::k: return {l.kv.total_rows, heads_kv(spec), spec.dim_qk};
    case InputTensor::v: return {l.kv.total_rows, heads_kv(spec), dim_v(spec)};
    case InputTensor::dout: return {l.q.total_rows, spec.heads_q, dim_v(spec)};
  }
  return {};
}

Tensor3<float> given_tensor(const CaseSpec& spec, InputTensor which, const std::vector<int64_t>& dims,
                            const float* values) {
  return convert(spec, which, dims, values);
}

Tensor3<float> given_tensor(const CaseSpec& spec, InputTensor which, const std::vector<int64_t>& dims,
                            const double* values) {
  return convert(spec, which, dims, values);
}

PadFill classify_pad_rows(const CaseSpec& spec, const CaseInputs& inputs) {
  const ThdLayout l = layout(spec);
  bool any_pad = false, any_nan = false, any_inf = false, all_zero = true;
  for (InputTensor which : {InputTensor::q, InputTensor::k, InputTensor::v, InputTensor::dout}) {
    const Tensor3<float>& t = which == InputTensor::q ? inputs.q
                              : which == InputTensor::k ? inputs.k
                              : which == InputTensor::v ? inputs.v
                                                        : inputs.dout;
    const PackedSequences& side = side_of(l, which);
    const int64_t row_elems = t.heads * t.dim;
    for (int64_t row = 0; row < t.rows; ++row) {
      if (side.is_valid_row(row)) continue;
      any_pad = any_pad || row_elems > 0;
      const float* x = t.values.data() + row * row_elems;
      for (int64_t e = 0; e < row_elems; ++e) {
        any_nan = any_nan || std::isnan(x[e]);
        any_inf = any_inf || std::isinf(x[e]);
        all_zero = all_zero && x[e] == 0.0f;
      }
    }
  }
  if (!any_pad) return spec.pad_fill;
  if (any_nan) return PadFill::nan;
  if (any_inf) return PadFill::inf;
  return all_zero ? PadFill::zero : PadFill::random;
}

GivenInputsSummary check_given_inputs(CaseSpec& spec, const CaseInputs& inputs, bool allow_nonfinite) {
  const ThdLayout l = layout(spec);
  GivenInputsSummary summary;
  for (InputTensor which : {InputTensor::q, InputTensor::k, InputTensor::v, InputTensor::dout}) {
    const Tensor3<float>& t = which == InputTensor::q ? inputs.q
                              : which == InputTensor::k ? inputs.k
                              : which == InputTensor::v ? inputs.v
                                                        : inputs.dout;
    check_dims(spec, which, {t.rows, t.heads, t.dim});
    const auto [first, count] = nonfinite_valid(side_of(l, which), t);
    if (count == 0) continue;
    const std::string where = element_text(spec, which, t.heads, t.dim, first) + ": " +
                              value_text(t.values[static_cast<size_t>(first)]);
    if (!allow_nonfinite)
      fail_input(std::string("inputs.") + input_tensor_name(which), where, " (", count, " non-finite value",
                 count == 1 ? "" : "s", " in valid rows of ", input_tensor_name(which),
                 "). A run that carries them has a finding of its own; to make a fixture of it anyway, pass "
                 "--allow-nonfinite-inputs (Python: allow_nonfinite=True): the fixture is flagged");
    if (summary.nonfinite_valid == 0) summary.first_nonfinite = where;
    summary.nonfinite_valid += count;
  }
  summary.pad_fill = classify_pad_rows(spec, inputs);
  spec.pad_fill = summary.pad_fill;
  return summary;
}

}  // namespace cpgold::sim
