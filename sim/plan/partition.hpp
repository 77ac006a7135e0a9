#pragma once
// Dual-chunk ("zigzag") CP partition (docs/cp-layout.md, "Partition"): every sequence's padded range splits into 2W
// chunks of C_b = PL_b / (2W) rows; rank r holds chunk r followed by chunk 2W-1-r, sequences in batch order. The
// rank-local tensor has cuP[B]/W rows (plus tail/W tail rows for p2p layouts with tail rows) and sequence b starts at
// local offset cuP[b]/W. Per-rank actual counts are always the exact clamp formula n_b(c) = clamp(L_b - c*C_b, 0, C_b).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "reference/thd_layout.hpp"

namespace cpgold::sim {

// Which part of a rank-local tensor a step reads: all of it, or one half compacted by read_half
// (half 0 = chunk r of every sequence, half 1 = chunk 2W-1-r), laid out at cuP/(2W).
enum class HalfSelect { full, first, second };
std::string_view half_name(HalfSelect half);  // "full", "first", "second" (the fixtures' step attributes)

// One side (q or kv) of a layout partitioned over W ranks.
class SidePartition {
 public:
  SidePartition() = default;
  // global: validated layout side; side: "q" or "kv" (names fields in errors). InputError if a padded length is not a
  // multiple of 2W, if W < 1, or if tail rows are not a multiple of W.
  SidePartition(const PackedSequences& global, int cp_size, const std::string& side);

  int cp_size() const { return cp_size_; }
  int batch() const { return global_.batch(); }
  const PackedSequences& global() const { return global_; }
  int32_t chunk_size(int b) const;                   // C_b
  int32_t valid_in_chunk(int b, int chunk) const;    // n_b(c), exact clamp
  int64_t local_sequence_rows() const;               // cuP[B] / W
  int64_t local_tail_rows() const;                   // (total_rows - cuP[B]) / W
  int64_t local_rows() const { return local_sequence_rows() + local_tail_rows(); }
  int64_t half_rows() const { return local_sequence_rows() / 2; }  // rows of a read_half tensor: cuP[B] / (2W)
  std::vector<int32_t> local_padded() const;         // [B+1] cuP / W
  std::vector<int32_t> half_padded() const;          // [B+1] cuP / (2W)
  // get_cu_seqlens_on_cp_rank: [B+1] exact actual counts of rank's chunk r (first) and/or chunk 2W-1-r (second).
  std::vector<int32_t> cu_seqlens_on_rank(int rank, bool first, bool second) const;
  // The pad_between_seqs=False shortcut (cu // W for both halves, cu // (2W) for one): wrong under padding
  // unless every L_b is a multiple of 2W (TransformerEngine issue 3331). For explain warnings and mutation tests.
  std::vector<int32_t> cu_seqlens_shortcut(bool first, bool second) const;
  // Global row of a rank-local row (tail rows map to the rank's block of global tail rows).
  int64_t global_row(int rank, int64_t local_row) const;
  // thd_get_partitioned_indices: [local_rows] global row of every local row; local[i] = global[idx[i]].
  std::vector<int64_t> gather_indices(int rank) const;
  // read_half map: [half_rows] local row read by every row of the compacted half tensor (half 0 or 1).
  std::vector<int64_t> read_half_rows(int half) const;
  // thd_cp_rank_order_to_sequence_order: [cuP[B]] for every rank-order row gi (rank gi / (cuP[B]/W)), its
  // sequence-order row. Sequence-to-rank is out[gi] = in[map[gi]]; rank-to-sequence is out[map[gi]] = in[gi].
  std::vector<int64_t> rank_order_to_sequence_order() const;
  // Position within its sequence of a rank-local row, and its sequence (-1 for tail rows).
  int sequence_of_local_row(int64_t local_row) const;

 private:
  PackedSequences global_;
  int cp_size_ = 1;
};

struct Partition {
  int cp_size = 1;
  SidePartition q, kv;
};

// Partitions both sides. InputError for W < 1 ("cp_size"), padded lengths not multiples of 2W ("padded_q[b]"),
// and, when W > 1 and the mask is causal or windowed, L_q != L_kv ("seqlens_kv[b]").
Partition make_partition(const ThdLayout& layout, int cp_size, bool causal_or_windowed);

}  // namespace cpgold::sim
