#include "sim/thd_helpers/grad_correction.hpp"

#include <algorithm>
#include <string>

#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"
#include "sim/thd_helpers/out_correction.hpp"

namespace cpgold::sim {

constexpr std::pair<GradOp, std::string_view> kGradOpNames[] = {
    {GradOp::none, "none"}, {GradOp::copy, "copy"}, {GradOp::add, "add"}};

std::string_view grad_op_name(GradOp op) { return name_in(kGradOpNames, op); }

GradOp parse_grad_op(std::string_view text, const char* field) {
  if (auto op = parse_in(kGradOpNames, text)) return *op;
  fail_input(field, "unknown gradient op '", text, "' (expected none, copy or add)");
}

HalfSelect grad_step_rows(GradOp first, GradOp second) {
  if (first != GradOp::none && second == GradOp::none) return HalfSelect::first;
  if (first == GradOp::none && second != GradOp::none) return HalfSelect::second;
  if (first != GradOp::none && second != GradOp::none && first != second) return HalfSelect::full;
  fail_input("grad_correction_mode", "value (", static_cast<int>(first), ", ", static_cast<int>(second),
             ") is not one of (add|copy, none), (none, add|copy), (add, copy), (copy, add)");
}

void grad_correction(Tensor3<float>& grad, const Tensor3<float>& grad_i, const StepRows& rows, GradOp first,
                     GradOp second, DType dtype) {
  if (rows.select() != grad_step_rows(first, second))
    fail_input("grad_correction_mode", "the step rows do not match the mode's half selection");
  check_step_shape(row_shape(grad), row_shape(grad_i), rows);
  const int64_t stride = grad.row_stride();
  for (int64_t x = 0; x < rows.rows(); ++x) {
    const StepRow r = rows.at(x);
    const GradOp op = grad_op_of(r, first, second, rows.select());
    float* g = grad.values.data() + r.local_row * stride;
    const float* gi = grad_i.values.data() + x * stride;
    if (op == GradOp::copy) std::copy_n(gi, stride, g);
    else if (op == GradOp::add)
      for (int64_t e = 0; e < stride; ++e) g[e] = round_to(dtype, g[e] + gi[e]);
  }
}

}  // namespace cpgold::sim
