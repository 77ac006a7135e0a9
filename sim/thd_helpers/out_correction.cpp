#include "sim/thd_helpers/out_correction.hpp"

#include <cmath>

#include "reference/input_error.hpp"

namespace cpgold::sim {

float out_correction_weight(float lse_step, float lse_full) {
  return static_cast<float>(std::exp(static_cast<double>(lse_step - lse_full)));
}

void out_correction(Tensor3<float>& out, const Tensor3<float>& out_i, const std::vector<float>& lse,
                    const LseShape& lse_shape, const std::vector<float>& lse_i, const LseShape& step_shape,
                    const StepRows& rows, DType dtype) {
  check_step_shape(row_shape(out), row_shape(out_i), rows);
  check_lse_shapes(lse_shape, step_shape, rows);
  if (lse_shape.heads != out.heads)
    fail_input("lse_heads", "value ", lse_shape.heads, " differs from the output's heads ", out.heads);
  for (int64_t x = 0; x < rows.rows(); ++x) {
    const StepRow r = rows.at(x);
    for (int k = 0; k < out.heads; ++k) {
      const float w = out_correction_weight(lse_i[static_cast<size_t>(lse_index(step_shape, r.sequence, k, x, r.column))],
                                            lse[static_cast<size_t>(lse_index(lse_shape, r.sequence, k, r.local_row, r.local_column))]);
      float* o = out.at(r.local_row, k);
      const float* v = out_i.at(x, k);
      for (int64_t e = 0; e < out.dim; ++e) {
        const float term = v[e] == 0.f ? 0.f : round_to(dtype, v[e] * w);
        o[e] = round_to(dtype, o[e] + term);
      }
    }
  }
}

}  // namespace cpgold::sim
