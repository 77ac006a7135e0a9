#include "sim/plan/step_rows.hpp"

#include <numeric>

#include <algorithm>

#include "reference/input_error.hpp"

namespace cpgold::sim {

int sequence_of_row(const std::vector<int32_t>& offsets, int64_t row, int divisor) {
  // Same search as the kernels: lo..hi over [0, B-1], keep the last b with offsets[b] / divisor <= row.
  int lo = 0, hi = static_cast<int>(offsets.size()) - 2;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[static_cast<size_t>(mid)] / divisor <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

void check_offsets(const std::vector<int32_t>& offsets, const std::string& field, bool from_zero) {
  if (offsets.size() < 2) fail_input(field, "needs B+1 >= 2 entries, got ", offsets.size());
  if (from_zero && offsets[0] != 0) fail_input(field + "[0]", "value ", offsets[0], " must be 0");
  if (offsets[0] < 0) fail_input(field + "[0]", "value ", offsets[0], " is negative");
  for (size_t b = 1; b < offsets.size(); ++b)
    if (offsets[b] < offsets[b - 1])
      fail_input(field + "[" + std::to_string(b) + "]", "value ", offsets[b], " is below the previous entry ",
                 offsets[b - 1]);
}

OffsetFacts offset_facts(const std::vector<int32_t>& offsets) {
  OffsetFacts f;
  f.ordered = offsets.size() >= 2 && offsets[0] == 0;
  for (size_t b = 1; b < offsets.size(); ++b) {
    const int64_t length = static_cast<int64_t>(offsets[b]) - offsets[b - 1];
    if (length < 0) f.ordered = false;
    f.length_gcd = std::gcd(f.length_gcd, length);
  }
  return f;
}

void check_step_shape(const RowShape& full, const RowShape& step, const StepRows& rows) {
  if (step.rows != rows.rows())
    fail_input("step_rows", "value ", step.rows, " differs from the step rows of cu_seqlens_padded: ", rows.rows());
  if (full.rows < rows.local_rows())
    fail_input("rows", "value ", full.rows, " is below the rank-local rows cu[B] = ", rows.local_rows());
  if (step.heads != full.heads) fail_input("step_heads", "value ", step.heads, " differs from heads ", full.heads);
  if (step.dim != full.dim) fail_input("step_dim", "value ", step.dim, " differs from dim ", full.dim);
}

StepRows::StepRows(std::vector<int32_t> cu_local, HalfSelect select, const std::string& field)
    : cu_(std::move(cu_local)), select_(select) {
  check_offsets(cu_, field);
  if (select_ != HalfSelect::full)
    for (size_t b = 0; b + 1 < cu_.size(); ++b)
      if ((cu_[b + 1] - cu_[b]) % 2 != 0)
        fail_input(field + "[" + std::to_string(b + 1) + "]", "value ", cu_[b + 1], " leaves sequence ", b,
                   " with odd local length ", cu_[b + 1] - cu_[b], " (two chunks of C_b rows expected)");
}

StepRow StepRows::at(int64_t x) const {
  const int div = divisor();
  StepRow r;
  r.sequence = sequence_of_row(cu_, x, div);
  const int64_t start = cu_[static_cast<size_t>(r.sequence)] / div;
  const int64_t next = cu_[static_cast<size_t>(r.sequence) + 1] / div;
  r.column = x - start;
  r.half_length = next - start;
  switch (select_) {
    case HalfSelect::full: r.local_row = x; break;
    case HalfSelect::first: r.local_row = x + start; break;
    case HalfSelect::second: r.local_row = x + next; break;
  }
  r.local_column = r.local_row - cu_[static_cast<size_t>(r.sequence)];
  return r;
}

}  // namespace cpgold::sim
