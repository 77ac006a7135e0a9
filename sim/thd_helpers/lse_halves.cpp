#include "sim/thd_helpers/lse_halves.hpp"

#include <bit>
#include <cmath>
#include <cstdint>

#include "reference/input_error.hpp"
#include "sim/thd_helpers/lse_merge_float.hpp"

namespace cpgold::sim {

void check_lse_heads_and_rows(const LseShape& full, const LseShape& step, int64_t local_rows, int64_t step_rows) {
  if (full.heads < 1) fail_input("lse_heads", "value ", full.heads, " must be >= 1");
  if (step.heads != full.heads)
    fail_input("lse_step_heads", "value ", step.heads, " differs from the full LSE's heads ", full.heads);
  if (step.packed != full.packed)
    fail_input("lse_packed", "the full LSE is ", full.packed ? "packed" : "unpacked", " but the step LSE is not");
  if (full.packed) {
    if (full.seqlen < local_rows)
      fail_input("lse_seqlen", "value ", full.seqlen, " is below the rank-local rows cu[B] = ", local_rows);
    if (step.seqlen < step_rows)
      fail_input("lse_step_seqlen", "value ", step.seqlen, " is below the step rows ", step_rows);
  }
}

void check_lse_shapes(const LseShape& full, const LseShape& step, const StepRows& rows) {
  check_lse_heads_and_rows(full, step, rows.local_rows(), rows.rows());
  if (full.packed) return;
  if (full.batch != rows.batch()) fail_input("lse_batch", "value ", full.batch, " differs from B = ", rows.batch());
  if (step.batch != rows.batch())
    fail_input("lse_step_batch", "value ", step.batch, " differs from B = ", rows.batch());
  const std::vector<int32_t>& cu = rows.cu_local();
  for (int b = 0; b < rows.batch(); ++b) {
    const int64_t len = cu[static_cast<size_t>(b) + 1] - cu[static_cast<size_t>(b)];
    if (full.seqlen < len)
      fail_input("lse_seqlen", "value ", full.seqlen, " is below the local length ", len, " of sequence ", b);
    if (step.seqlen < len / rows.divisor())
      fail_input("lse_step_seqlen", "value ", step.seqlen, " is below the step length ", len / rows.divisor(),
                 " of sequence ", b);
  }
}

namespace {
// Host operations of LseMergeFloat: SSE float arithmetic (the build forbids contraction: -ffp-contract=off) and the
// correctly rounded std::fma.
struct HostFloatOps {
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
  static float add(float a, float b) { return a + b; }
  static float sub(float a, float b) { return a - b; }
  static float mul(float a, float b) { return a * b; }
  static float div(float a, float b) { return a / b; }
  static float rint(float a) { return std::rint(a); }
  static float pow2(int e) { return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23); }
};
}  // namespace

float lse_logaddexp(float a, float b) { return LseMergeFloat<HostFloatOps>::merge(a, b); }

void second_half_lse_correction(std::vector<float>& lse, const LseShape& full, const std::vector<float>& lse_half,
                                const LseShape& half, const StepRows& rows) {
  check_lse_shapes(full, half, rows);
  for (int64_t x = 0; x < rows.rows(); ++x) {
    const StepRow r = rows.at(x);
    for (int k = 0; k < full.heads; ++k) {
      float& dst = lse[static_cast<size_t>(lse_index(full, r.sequence, k, r.local_row, r.local_column))];
      dst = lse_logaddexp(dst, lse_half[static_cast<size_t>(lse_index(half, r.sequence, k, x, r.column))]);
    }
  }
}

std::vector<float> read_second_half_lse(const std::vector<float>& lse, const LseShape& full, const LseShape& half,
                                        const StepRows& rows) {
  check_lse_shapes(full, half, rows);
  std::vector<float> out(static_cast<size_t>(half.size()), 0.f);
  for (int64_t x = 0; x < rows.rows(); ++x) {
    const StepRow r = rows.at(x);
    for (int k = 0; k < full.heads; ++k)
      out[static_cast<size_t>(lse_index(half, r.sequence, k, x, r.column))] =
          lse[static_cast<size_t>(lse_index(full, r.sequence, k, r.local_row, r.local_column))];
  }
  return out;
}

}  // namespace cpgold::sim
