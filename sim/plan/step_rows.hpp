#pragma once
// Rows of a CP step tensor against the rank-local rows (docs/cp-layout.md, "Helper kernels"): a full step has the
// rank-local rows themselves; a half step (read_half layout) has cu_s = cu/2 rows per sequence, half 0 = chunk r (local
// row x + cu_s[s]), half 1 = chunk 2W-1-r (local row x + cu_s[s+1]). Every THD helper kernel and its CPU twin index
// through this one map; the LSE tensors additionally use the column of the row inside its sequence (unpacked layout).
#include <cstdint>
#include <string>
#include <vector>

#include "sim/plan/partition.hpp"

namespace cpgold::sim {

// Largest b in [0, B-1] with offsets[b] / divisor <= row (TransformerEngine's binary_search on cu_s = cu / divisor);
// offsets [B+1]. With zero-length sequences this is the non-empty sequence holding the row.
int sequence_of_row(const std::vector<int32_t>& offsets, int64_t row, int divisor = 1);

// One step row mapped onto the rank-local tensor.
struct StepRow {
  int sequence = 0;
  int64_t local_row = 0;     // row of the rank-local [t, h, d] tensor
  int64_t column = 0;        // step row within its sequence (x - cu_s[s])
  int64_t local_column = 0;  // local row within its sequence (local_row - cu[s])
  int64_t half_length = 0;   // cu_s[s+1] - cu_s[s] (the whole sequence length for a full step)
};

class StepRows {
 public:
  // cu_local: [B+1] rank-local padded offsets cuP/W (field names the caller's argument in errors). InputError when
  // the offsets decrease, do not start at 0, or (half steps) a sequence length is odd.
  StepRows(std::vector<int32_t> cu_local, HalfSelect select, const std::string& field = "cu_seqlens_padded");
  int batch() const { return static_cast<int>(cu_.size()) - 1; }
  int divisor() const { return select_ == HalfSelect::full ? 1 : 2; }
  int64_t rows() const { return cu_.back() / divisor(); }    // step rows: cu[B] or cu[B] / 2
  int64_t local_rows() const { return cu_.back(); }           // rank-local rows covered: cu[B]
  StepRow at(int64_t x) const;                                // x in [0, rows())
  const std::vector<int32_t>& cu_local() const { return cu_; }
  HalfSelect select() const { return select_; }

 private:
  std::vector<int32_t> cu_;
  HalfSelect select_;
};

// Rows, heads and dim of a [rows, heads, dim] tensor (host or device).
struct RowShape {
  int64_t rows = 0, heads = 0, dim = 0;
};

// Checks a rank-local tensor (full) and a step tensor (step) against rows: step.rows == rows.rows(),
// full.rows >= rows.local_rows(), same heads and dim. InputError naming "step_rows", "rows", "step_heads", "step_dim".
void check_step_shape(const RowShape& full, const RowShape& step, const StepRows& rows);

// Checks offsets [B+1]: start at 0 (when from_zero), non-decreasing; InputError naming field[b] and its value.
void check_offsets(const std::vector<int32_t>& offsets, const std::string& field, bool from_zero = true);

// What the per-call checks need to know of offsets [B+1], found in one pass: gpu::DeviceOffsets keeps it from the
// upload, so a call on a layout of 256k sequences checks it in O(1) (walking the offsets on every call cost more host
// time than some kernels take) and walks them only to name a failing entry.
struct OffsetFacts {
  bool ordered = false;     // check_offsets(offsets, field) passes: B+1 >= 2 entries, offsets[0] = 0, non-decreasing
  int64_t length_gcd = 0;   // gcd of every length offsets[b+1] - offsets[b] (0 when all are 0)
};
OffsetFacts offset_facts(const std::vector<int32_t>& offsets);

}  // namespace cpgold::sim
