#include "reference/thd_layout.hpp"

#include <algorithm>
#include <limits>

#include "reference/input_error.hpp"

namespace cpgold {

namespace {
std::string indexed(const std::string& name, size_t i) { return name + "[" + std::to_string(i) + "]"; }
}  // namespace

bool PackedSequences::is_valid_row(int64_t row) const {
  // Last b with cu_seqlens_padded[b] <= row.
  auto it = std::upper_bound(cu_seqlens_padded.begin(), cu_seqlens_padded.end(), row);
  if (it == cu_seqlens_padded.begin()) return false;
  const auto b = static_cast<int>(it - cu_seqlens_padded.begin()) - 1;
  if (b >= batch()) return false;
  return row - cu_seqlens_padded[b] < length(b);
}

void PackedSequences::validate(const std::string& side) const {
  const std::string cu = "cu_seqlens_" + side;
  const std::string cup = "cu_seqlens_" + side + "_padded";
  const std::string total = "total_tokens_" + side;
  if (cu_seqlens.empty()) fail_input(cu, "must have B+1 >= 1 entries, got 0");
  if (cu_seqlens_padded.size() != cu_seqlens.size())
    fail_input(cup, "has ", cu_seqlens_padded.size(), " entries but ", cu, " has ", cu_seqlens.size(),
               " (both must be B+1)");
  if (cu_seqlens[0] != 0) fail_input(indexed(cu, 0), "must be 0, got ", cu_seqlens[0]);
  if (cu_seqlens_padded[0] != 0) fail_input(indexed(cup, 0), "must be 0, got ", cu_seqlens_padded[0]);
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    if (cu_seqlens[i] < cu_seqlens[i - 1])
      fail_input(indexed(cu, i), "value ", cu_seqlens[i], " is below ", indexed(cu, i - 1), " = ", cu_seqlens[i - 1],
                 " (must be non-decreasing)");
    if (cu_seqlens_padded[i] < cu_seqlens_padded[i - 1])
      fail_input(indexed(cup, i), "value ", cu_seqlens_padded[i], " is below ", indexed(cup, i - 1), " = ",
                 cu_seqlens_padded[i - 1], " (must be non-decreasing)");
    const int32_t actual = cu_seqlens[i] - cu_seqlens[i - 1];
    const int32_t padded = cu_seqlens_padded[i] - cu_seqlens_padded[i - 1];
    if (actual > padded)
      fail_input(indexed(cu, i), "sequence ", i - 1, " has actual length ", actual, " (", cu, "[", i, "] - ", cu, "[",
                 i - 1, "]) above its padded length ", padded, " (from ", cup, ")");
  }
  if (total_rows < 0) fail_input(total, "must be >= 0, got ", total_rows);
  if (total_rows > std::numeric_limits<int32_t>::max())
    fail_input(total, "value ", total_rows, " exceeds the int32 range of cu_seqlens");
  if (cu_seqlens_padded.back() > total_rows)
    fail_input(total, "value ", total_rows, " is below ", indexed(cup, cu_seqlens_padded.size() - 1), " = ",
               cu_seqlens_padded.back(), " (the sequences do not fit the tensor)");
}

void ThdLayout::validate() const {
  q.validate("q");
  kv.validate("kv");
  if (q.batch() != kv.batch())
    fail_input("cu_seqlens_kv", "describes ", kv.batch(), " sequences but cu_seqlens_q describes ", q.batch(),
               " (q and kv must have the same B)");
}

PackedSequences make_packed_sequences(const std::vector<int32_t>& lengths, const std::vector<int32_t>& padded_lengths,
                                      int64_t total_rows, const std::string& side) {
  const std::string seqlens = "seqlens_" + side;
  const std::string padded = "padded_" + side;
  if (!padded_lengths.empty() && padded_lengths.size() != lengths.size())
    fail_input(padded, "has ", padded_lengths.size(), " entries but ", seqlens, " has ", lengths.size());
  PackedSequences seqs;
  seqs.cu_seqlens.assign(1, 0);
  seqs.cu_seqlens_padded.assign(1, 0);
  int64_t sum = 0, sum_padded = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0) fail_input(indexed(seqlens, b), "must be >= 0, got ", lengths[b]);
    const int64_t p = padded_lengths.empty() ? lengths[b] : padded_lengths[b];
    if (p < lengths[b]) fail_input(indexed(padded, b), "value ", p, " is below ", indexed(seqlens, b), " = ", lengths[b]);
    sum += lengths[b];
    sum_padded += p;
    if (sum_padded > std::numeric_limits<int32_t>::max())
      fail_input(padded.empty() ? seqlens : padded, "total ", sum_padded, " exceeds the int32 range of cu_seqlens");
    seqs.cu_seqlens.push_back(static_cast<int32_t>(sum));
    seqs.cu_seqlens_padded.push_back(static_cast<int32_t>(sum_padded));
  }
  seqs.total_rows = total_rows < 0 ? sum_padded : total_rows;
  seqs.validate(side);
  return seqs;
}

}  // namespace cpgold
