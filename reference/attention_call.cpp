#include "reference/attention_call.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace cpgold {

namespace {
void check_side(const std::vector<RowSegment>& segments, int64_t rows, int32_t length, size_t b, const char* side,
                std::vector<std::pair<int64_t, int64_t>>& used) {
  const std::string where = "AttentionCall: sequence " + std::to_string(b) + " " + side;
  if (segments.size() > 2) throw std::logic_error(where + " has more than two segments");
  for (const RowSegment& s : segments) {
    if (s.count < 0 || s.first_row < 0 || s.first_row + s.count > rows)
      throw std::logic_error(where + " segment rows [" + std::to_string(s.first_row) + ", +" +
                             std::to_string(s.count) + ") outside the tensor of " + std::to_string(rows) + " rows");
    if (s.position < 0 || s.position + s.count > length)
      throw std::logic_error(where + " segment positions [" + std::to_string(s.position) + ", +" +
                             std::to_string(s.count) + ") outside the sequence length " + std::to_string(length));
    if (s.count > 0) used.emplace_back(s.first_row, s.first_row + s.count);
  }
}

void check_disjoint(std::vector<std::pair<int64_t, int64_t>>& used, const char* side) {
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i)
    if (used[i].first < used[i - 1].second)
      throw std::logic_error(std::string("AttentionCall: overlapping ") + side + " rows at row " +
                             std::to_string(used[i].first));
}
}  // namespace

void AttentionCall::check() const {
  // No row is read by two segments, within a sequence or across sequences (each sequence owns its rows).
  std::vector<std::pair<int64_t, int64_t>> q_used, kv_used;
  for (size_t b = 0; b < sequences.size(); ++b) {
    check_side(sequences[b].q, q_rows, sequences[b].length_q, b, "q", q_used);
    check_side(sequences[b].kv, kv_rows, sequences[b].length_kv, b, "kv", kv_used);
  }
  check_disjoint(q_used, "q");
  check_disjoint(kv_used, "kv");
}

std::vector<uint8_t> rows_read(const AttentionCall& call, bool kv_side) {
  std::vector<uint8_t> read(static_cast<size_t>(kv_side ? call.kv_rows : call.q_rows), 0);
  for (const SequenceTile& sequence : call.sequences)
    for (const RowSegment& segment : kv_side ? sequence.kv : sequence.q)
      for (int64_t r = segment.first_row; r < segment.first_row + segment.count; ++r) read[static_cast<size_t>(r)] = 1;
  return read;
}

AttentionCall non_cp_call(const ThdLayout& layout, Window window, double softmax_scale) {
  AttentionCall call;
  call.window = window;
  call.softmax_scale = softmax_scale;
  call.q_rows = layout.q.total_rows;
  call.kv_rows = layout.kv.total_rows;
  for (int b = 0; b < layout.batch(); ++b) {
    SequenceTile tile;
    tile.length_q = layout.q.length(b);
    tile.length_kv = layout.kv.length(b);
    if (tile.length_q > 0) tile.q.push_back({layout.q.offset(b), tile.length_q, 0});
    if (tile.length_kv > 0) tile.kv.push_back({layout.kv.offset(b), tile.length_kv, 0});
    call.sequences.push_back(std::move(tile));
  }
  return call;
}

}  // namespace cpgold
