#pragma once
// Inputs given by the caller instead of drawn from the seed: the tensors of a captured run (docs/capture.md), in the
// global padded THD layout of the case. Every element is checked before any work: the shape of each tensor, every
// value representable in the case dtype (the fixture stores the inputs in it, and the oracle must see exactly what a
// candidate saw), and no NaN or infinity in a valid row unless asked for (a real run may carry them, and that is a
// finding in itself; the fixture then says so). Pad and tail rows may hold anything: the case's pad_fill becomes what
// they hold (classify_pad_rows), so that the diagnoses that reason about pad contents see the truth.
#include <cstdint>
#include <string>
#include <vector>

#include "sim/case/case_inputs.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::sim {

// "q", "k", "v", "dout".
const char* input_tensor_name(InputTensor which);
// The shape [rows, heads, dim] the case's global layout gives each tensor.
std::vector<int64_t> input_tensor_dims(const CaseSpec& spec, InputTensor which);

// One tensor as float values of the case dtype: values[] has the elements of `dims` (row-major). InputError naming
// "inputs.<name>" for a shape other than input_tensor_dims(spec, which), and for the first element (row, head,
// column: the smallest flat index, whatever the thread count) whose value is not representable in the case dtype.
// The double overload refuses a value a float cannot hold exactly with the same message.
Tensor3<float> given_tensor(const CaseSpec& spec, InputTensor which, const std::vector<int64_t>& dims,
                            const float* values);
Tensor3<float> given_tensor(const CaseSpec& spec, InputTensor which, const std::vector<int64_t>& dims,
                            const double* values);

struct GivenInputsSummary {
  int64_t nonfinite_valid = 0;  // NaN or infinite elements in valid rows (0 unless allow_nonfinite)
  std::string first_nonfinite;  // where the first of them is: "q row 17 (sequence 1, token 3), head 0, column 5: nan"
  PadFill pad_fill = PadFill::random;  // classify_pad_rows of the given tensors
};

// Checks the four tensors together against the case (shapes and values as given_tensor, and non-finite values in
// valid rows: InputError naming the tensor, row, head and column unless allow_nonfinite) and returns what the fixture
// records of them. spec.pad_fill is set to the class of the given pad and tail rows.
GivenInputsSummary check_given_inputs(CaseSpec& spec, const CaseInputs& inputs, bool allow_nonfinite);

// What the pad and tail rows of the four tensors hold: zero (every element +-0, or there are no pad rows: then the
// case's own pad_fill is kept), nan (any NaN), inf (any infinity, no NaN), random (finite values, not all zero).
PadFill classify_pad_rows(const CaseSpec& spec, const CaseInputs& inputs);

}  // namespace cpgold::sim
