#include "sim/case/case_inputs.hpp"

#include <limits>

#include "reference/splitmix64.hpp"

namespace cpgold::sim {

namespace {

// t: [rows, heads, dim]; fills every element from its own counter, then overwrites pad and tail rows per `fill`.
Tensor3<float> make_tensor(const CaseSpec& spec, InputTensor which, const PackedSequences& side, int heads, int dim) {
  Tensor3<float> t(side.total_rows, heads, dim);
  const int64_t row_elems = static_cast<int64_t>(heads) * dim;
  // Every element is a pure function of its index: rows on every thread give the same values.
#pragma omp parallel for schedule(static) if (t.rows * row_elems > (int64_t{1} << 18))
  for (int64_t row = 0; row < t.rows; ++row) {
    const bool valid = side.is_valid_row(row);
    float* out = t.values.data() + row * row_elems;
    for (int64_t e = 0; e < row_elems; ++e) {
      float x;
      if (valid || spec.pad_fill == PadFill::random) {
        x = round_to(spec.dtype, uniform_value(spec.seed, which, static_cast<uint64_t>(row * row_elems + e)));
      } else if (spec.pad_fill == PadFill::zero) {
        x = 0.0f;
      } else if (spec.pad_fill == PadFill::nan) {
        x = std::numeric_limits<float>::quiet_NaN();
      } else {
        x = (e % 2 == 0) ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
      }
      out[e] = x;
    }
  }
  return t;
}

}  // namespace

float uniform_value(uint64_t seed, InputTensor tensor, uint64_t element_index) {
  const uint64_t stream = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(tensor) * 0xD1B54A32D192ED03ull));
  const uint64_t bits = splitmix64(stream + element_index);
  // 25 random bits -> integer in [0, 2^25) -> [-1, 1] in steps of 2^-24 (exact in float).
  const int64_t n = static_cast<int64_t>(bits >> 39);
  return static_cast<float>(static_cast<double>(n - (int64_t{1} << 24)) / static_cast<double>(int64_t{1} << 24));
}

CaseInputs make_case_inputs(const CaseSpec& spec) {
  const ThdLayout l = layout(spec);
  CaseInputs in;
  in.q = make_tensor(spec, InputTensor::q, l.q, spec.heads_q, spec.dim_qk);
  in.k = make_tensor(spec, InputTensor::k, l.kv, heads_kv(spec), spec.dim_qk);
  in.v = make_tensor(spec, InputTensor::v, l.kv, heads_kv(spec), dim_v(spec));
  in.dout = make_tensor(spec, InputTensor::dout, l.q, spec.heads_q, dim_v(spec));
  return in;
}

}  // namespace cpgold::sim
