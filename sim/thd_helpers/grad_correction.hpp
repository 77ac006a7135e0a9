#pragma once
// thd_grad_correction (docs/cp-layout.md, "Helper kernels" item 5): accumulates a step's partial gradient into the
// rank's gradient, per half: "none" leaves it, "copy" overwrites it, "add" adds in the gradient dtype (dtype(g + g_i)).
// (first, second) = (op, none) and (none, op) take a half-size grad_i (half 0 resp. half 1 of every sequence); (add,
// copy) and (copy, add) a full-size grad_i whose row goes to `first` in the first half of its sequence.
#include <string_view>

#include "reference/dtype.hpp"
#include "reference/tensor.hpp"
#include "sim/plan/step_rows.hpp"

namespace cpgold::sim {

enum class GradOp { none, copy, add };
std::string_view grad_op_name(GradOp op);                        // "none", "copy", "add"
GradOp parse_grad_op(std::string_view text, const char* field);  // "none", "copy", "add"; InputError otherwise

// The step rows grad_i has for (first, second): a half for one "none", full otherwise. InputError naming
// "grad_correction_mode" for (none, none) and for (copy, copy) / (add, add), which TransformerEngine does not have.
HalfSelect grad_step_rows(GradOp first, GradOp second);

// The op applied to step row r (a StepRow of grad_step_rows(first, second)).
inline GradOp grad_op_of(const StepRow& r, GradOp first, GradOp second, HalfSelect select) {
  if (select == HalfSelect::first) return first;
  if (select == HalfSelect::second) return second;
  return r.column < r.half_length / 2 ? first : second;
}

// grad [t, h, d] (values of dtype), grad_i [rows.rows(), h, d]; rows built on cu_local with grad_step_rows(...).
void grad_correction(Tensor3<float>& grad, const Tensor3<float>& grad_i, const StepRows& rows, GradOp first,
                     GradOp second, DType dtype);

}  // namespace cpgold::sim
