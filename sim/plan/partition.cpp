#include "sim/plan/partition.hpp"

#include <algorithm>
#include <stdexcept>

#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"

namespace cpgold::sim {

constexpr std::pair<HalfSelect, std::string_view> kHalfNames[] = {
    {HalfSelect::full, "full"}, {HalfSelect::first, "first"}, {HalfSelect::second, "second"}};

std::string_view half_name(HalfSelect half) { return name_in(kHalfNames, half); }

SidePartition::SidePartition(const PackedSequences& global, int cp_size, const std::string& side)
    : global_(global), cp_size_(cp_size) {
  if (cp_size < 1) fail_input("cp_size", "must be >= 1, got ", cp_size);
  for (int b = 0; b < batch(); ++b)
    if (global.padded_length(b) % (2 * cp_size) != 0)
      fail_input("padded_" + side + "[" + std::to_string(b) + "]", "value ", global.padded_length(b),
                 " is not a multiple of 2 * cp_size = ", 2 * cp_size, " (dual-chunk CP split)");
  const int64_t tail = global.total_rows - global.cu_seqlens_padded.back();
  if (tail % cp_size != 0)
    fail_input("total_tokens_" + side, "value ", global.total_rows, " leaves ", tail,
               " tail rows, not a multiple of cp_size = ", cp_size);
}

int32_t SidePartition::chunk_size(int b) const { return global_.padded_length(b) / (2 * cp_size_); }

int32_t SidePartition::valid_in_chunk(int b, int chunk) const {
  const int64_t c = chunk_size(b);
  return static_cast<int32_t>(std::clamp<int64_t>(global_.length(b) - chunk * c, 0, c));
}

int64_t SidePartition::local_sequence_rows() const { return global_.cu_seqlens_padded.back() / cp_size_; }
int64_t SidePartition::local_tail_rows() const {
  return (global_.total_rows - global_.cu_seqlens_padded.back()) / cp_size_;
}

std::vector<int32_t> SidePartition::local_padded() const {
  std::vector<int32_t> out;
  for (int32_t x : global_.cu_seqlens_padded) out.push_back(x / cp_size_);
  return out;
}

std::vector<int32_t> SidePartition::half_padded() const {
  std::vector<int32_t> out;
  for (int32_t x : global_.cu_seqlens_padded) out.push_back(x / (2 * cp_size_));
  return out;
}

std::vector<int32_t> SidePartition::cu_seqlens_on_rank(int rank, bool first, bool second) const {
  std::vector<int32_t> out{0};
  for (int b = 0; b < batch(); ++b) {
    const int32_t n = (first ? valid_in_chunk(b, rank) : 0) + (second ? valid_in_chunk(b, 2 * cp_size_ - 1 - rank) : 0);
    out.push_back(out.back() + n);
  }
  return out;
}

std::vector<int32_t> SidePartition::cu_seqlens_shortcut(bool first, bool second) const {
  const int div = (first && second) ? cp_size_ : 2 * cp_size_;
  std::vector<int32_t> out;
  for (int32_t x : global_.cu_seqlens) out.push_back((first || second) ? x / div : 0);
  return out;
}

int64_t SidePartition::global_row(int rank, int64_t local_row) const {
  const int64_t seq_rows = local_sequence_rows();
  if (local_row >= seq_rows)
    return global_.cu_seqlens_padded.back() + rank * local_tail_rows() + (local_row - seq_rows);
  const int b = sequence_of_local_row(local_row);
  const int64_t start = global_.cu_seqlens_padded[b] / cp_size_;
  const int64_t c = chunk_size(b);
  const int64_t j = local_row - start;
  const int chunk = j < c ? rank : 2 * cp_size_ - 1 - rank;
  return global_.cu_seqlens_padded[b] + chunk * c + (j < c ? j : j - c);
}

int SidePartition::sequence_of_local_row(int64_t local_row) const {
  if (local_row < 0 || local_row >= local_sequence_rows()) return -1;
  // Last b with cuP[b] / W <= local_row, skipping empty sequences (upper_bound lands after equal offsets).
  const auto& cup = global_.cu_seqlens_padded;
  auto it = std::upper_bound(cup.begin(), cup.end(), local_row,
                             [this](int64_t row, int32_t offset) { return row < offset / cp_size_; });
  return static_cast<int>(it - cup.begin()) - 1;
}

std::vector<int64_t> SidePartition::gather_indices(int rank) const {
  std::vector<int64_t> idx(static_cast<size_t>(local_rows()));
  for (int64_t i = 0; i < local_rows(); ++i) idx[static_cast<size_t>(i)] = global_row(rank, i);
  return idx;
}

std::vector<int64_t> SidePartition::read_half_rows(int half) const {
  // thd_read_half_tensor: out[x] = in[x + cu_s[s + half]] with cu_s = (cuP / W) / 2 and s the sequence of half-row x.
  std::vector<int64_t> out(static_cast<size_t>(half_rows()));
  const std::vector<int32_t> cu_s = half_padded();
  for (int b = 0; b < batch(); ++b)
    for (int64_t x = cu_s[b]; x < cu_s[b + 1]; ++x) out[static_cast<size_t>(x)] = x + cu_s[b + half];
  return out;
}

std::vector<int64_t> SidePartition::rank_order_to_sequence_order() const {
  const int64_t tpr = local_sequence_rows();
  std::vector<int64_t> out(static_cast<size_t>(tpr * cp_size_));
  for (int r = 0; r < cp_size_; ++r)
    for (int64_t i = 0; i < tpr; ++i) out[static_cast<size_t>(r * tpr + i)] = global_row(r, i);
  return out;
}

Partition make_partition(const ThdLayout& layout, int cp_size, bool causal_or_windowed) {
  if (cp_size < 1) fail_input("cp_size", "must be >= 1, got ", cp_size);
  if (cp_size > 1 && causal_or_windowed)
    for (int b = 0; b < layout.batch(); ++b)
      if (layout.q.length(b) != layout.kv.length(b))
        fail_input("seqlens_kv[" + std::to_string(b) + "]", "value ", layout.kv.length(b), " differs from seqlens_q[", b,
                   "] = ", layout.q.length(b), ": causal or windowed CP (cp_size = ", cp_size,
                   ") needs L_q == L_kv per sequence");
  Partition p;
  p.cp_size = cp_size;
  p.q = SidePartition(layout.q, cp_size, "q");
  p.kv = SidePartition(layout.kv, cp_size, "kv");
  return p;
}

}  // namespace cpgold::sim
