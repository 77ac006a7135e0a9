#pragma once
// Softmax statistics of P2P upper-triangle steps (docs/cp-layout.md, "Helper kernels" items 2-3): a step whose queries
// are the second half (chunk 2W-1-r) of every sequence produces a half-size LSE; thd_second_half_lse_correction merges
// it into the rank's full LSE and thd_read_second_half_lse extracts the second-half rows for the backward. Layouts:
// packed [h, S] (column = rank-local row) or unpacked [B, h, S] (column = row within its sequence).
#include <cstdint>
#include <string>
#include <vector>

#include "sim/plan/step_rows.hpp"

namespace cpgold::sim {

struct LseShape {
  bool packed = true;
  int heads = 0;
  int batch = 0;       // B (unpacked layout only)
  int64_t seqlen = 0;  // S: columns per (head) or per (sequence, head)
  int64_t size() const { return (packed ? 1 : batch) * static_cast<int64_t>(heads) * seqlen; }
};

// Index of (sequence, head, row, column): packed head*S + row, unpacked (sequence*h + head)*S + column.
inline int64_t lse_index(const LseShape& shape, int sequence, int head, int64_t row, int64_t column) {
  return shape.packed ? head * shape.seqlen + row
                      : (static_cast<int64_t>(sequence) * shape.heads + head) * shape.seqlen + column;
}

// Checks that the LSE of the rank-local rows (full) and of the step rows (step) fit `rows`: same heads and layout,
// batch B when unpacked, every indexed column inside S. InputError names the field ("lse_seqlen", ...) and value.
void check_lse_shapes(const LseShape& full, const LseShape& step, const StepRows& rows);

// The part of check_lse_shapes that needs only cu[B] (local_rows) and the step rows: heads, layout and, for packed
// tensors, everything (the unpacked column bounds need every sequence).
void check_lse_heads_and_rows(const LseShape& full, const LseShape& step, int64_t local_rows, int64_t step_rows);

// lse [full.size()], lse_half [half.size()]; rows: second-half StepRows. lse[full] = logaddexp(lse[full], lse_half[x])
// for every (head, half row), evaluated by lse_logaddexp (see docs/gpu-kernels.md).
void second_half_lse_correction(std::vector<float>& lse, const LseShape& full, const std::vector<float>& lse_half,
                                const LseShape& half, const StepRows& rows);

// lse [full.size()] -> [half.size()], zero-initialised, lse_half[x] = lse[full] for every (head, half row).
std::vector<float> read_second_half_lse(const std::vector<float>& lse, const LseShape& full, const LseShape& half,
                                        const StepRows& rows);

// The merge of the correction: logaddexp in float32 (max + log1p(exp(min - max)), -inf with -inf stays -inf) from
// correctly rounded operations only (sim/thd_helpers/lse_merge_float.hpp), the same bits as the device kernel.
float lse_logaddexp(float a, float b);

}  // namespace cpgold::sim
