#pragma once
// thd_out_correction (docs/cp-layout.md, "Helper kernels" item 4): adds a step's partial output, weighted by exp(lse_i
// - lse), into the rank's output, in the output dtype as TransformerEngine does: per element out = dtype(out + (v == 0
// ? 0 : dtype(v * w))) with w = float(exp(double(lse_i - lse))) per (row, head). The zero guard keeps pad rows exactly
// 0 and ignores garbage LSE there.
#include <vector>

#include "reference/dtype.hpp"
#include "reference/tensor.hpp"
#include "sim/thd_helpers/lse_halves.hpp"

namespace cpgold::sim {

// out [t, h, d] (values of dtype), out_i [rows.rows(), h, d]; lse [lse_shape.size()] of the rank-local rows,
// lse_i [step_shape.size()] of the step rows; rows: full step or second half (only_second_half).
void out_correction(Tensor3<float>& out, const Tensor3<float>& out_i, const std::vector<float>& lse,
                    const LseShape& lse_shape, const std::vector<float>& lse_i, const LseShape& step_shape,
                    const StepRows& rows, DType dtype);

// The weight of one (row, head): exp of the float difference, in double, rounded once to float.
float out_correction_weight(float lse_step, float lse_full);

template <class T>
RowShape row_shape(const Tensor3<T>& x) {
  return {x.rows, x.heads, x.dim};
}

}  // namespace cpgold::sim
