#pragma once
// Deterministic inputs of a case from its seed: q, k, v, dout as float tensors holding values of the case dtype.
// Valid rows are uniform in [-1, 1] (as TransformerEngine's tests clamp randn to [-1, 1]) rounded to the dtype;
// pad and tail rows hold what pad_fill says. The values depend only on (seed, tensor, row, head, x), never on the
// thread count or the standard library: counter-based splitmix64 with cpgold's own mapping to floats.
#include <cstddef>  // size_t, used by reference/tensor.hpp
#include <cstdint>

#include "reference/tensor.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::sim {

struct CaseInputs {
  Tensor3<float> q;     // [total_tokens_q, heads_q, dim_qk]
  Tensor3<float> k;     // [total_tokens_kv, heads_kv, dim_qk]
  Tensor3<float> v;     // [total_tokens_kv, heads_kv, dim_v]
  Tensor3<float> dout;  // [total_tokens_q, heads_q, dim_v]
};

// Which tensor a stream of values belongs to (part of the counter, so tensors are independent).
enum class InputTensor : uint64_t { q = 1, k = 2, v = 3, dout = 4 };

CaseInputs make_case_inputs(const CaseSpec& spec);

// The value at one element before rounding: uniform in [-1, 1], 2^-24 steps; a pure function of its arguments.
float uniform_value(uint64_t seed, InputTensor tensor, uint64_t element_index);

}  // namespace cpgold::sim
