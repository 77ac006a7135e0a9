#include "check/check_request.hpp"

#include "reference/input_error.hpp"

namespace cpgold::fx {

CheckOptions check_options(const CheckRequest& request, const CheckRequestFields& fields) {
  CheckOptions options;
  set_conventions(options, request.empty_row_lse, fields.empty_row_lse, request.pad_rows, fields.pad_rows);
  options.diagnose = request.diagnose;
  if (!(request.diagnosis_budget >= 0 && request.diagnosis_budget <= 86400))  // NaN too
    fail_input(fields.diagnosis_budget, "expected ", fields.diagnosis_budget_expected, ", got ", request.diagnosis_budget);
  options.diagnosis_budget_seconds = request.diagnosis_budget;
  if (!request.tensors.empty()) options.tensors = parse_tensor_list(request.tensors, fields.tensors);
  options.allow_same_file = request.allow_same_file;
  if (!request.ranks.empty()) options.ranks = parse_rank_list(request.ranks, fields.ranks);
  return options;
}

}  // namespace cpgold::fx
