#pragma once
// One attention call as a kernel sees it: per sequence, the Q rows and the KV rows it reads, each as at most two
// segments (first row in the tensor, count, global position of the first row within the sequence), plus the
// sequence's global actual lengths for bottom-right alignment. The non-CP call has one segment per side at
// position 0; a CP step passes the chunks it holds. The same struct drives the CPU reference and GPU kernels.
#include <cstdint>
#include <vector>

#include "reference/mask.hpp"
#include "reference/thd_layout.hpp"

namespace cpgold {

struct RowSegment {
  int64_t first_row = 0;  // row in the tensor passed to the call
  int32_t count = 0;      // rows, all valid tokens
  int32_t position = 0;   // global position of first_row within its sequence
  bool operator==(const RowSegment&) const = default;
};

struct SequenceTile {
  std::vector<RowSegment> q;   // at most 2
  std::vector<RowSegment> kv;  // at most 2
  int32_t length_q = 0;        // global actual length L_q of the sequence
  int32_t length_kv = 0;       // global actual length L_kv of the sequence
  int64_t delta() const { return static_cast<int64_t>(length_kv) - length_q; }
  bool operator==(const SequenceTile&) const = default;
};

struct AttentionCall {
  std::vector<SequenceTile> sequences;
  Window window;
  double softmax_scale = 0.0;
  int64_t q_rows = 0;   // rows of the Q (and O, dO, dQ) tensors the call reads and writes
  int64_t kv_rows = 0;  // rows of the K, V (and dK, dV) tensors
  // Checks segment counts (<= 2), rows inside the tensors, positions inside the lengths, no overlapping rows.
  // Inner invariant: violations are bugs of the caller, reported as std::logic_error with the sequence index.
  void check() const;
};

// Per row of the Q tensor (kv_side false) or the K/V tensors (kv_side true): 1 if one of the call's segments reads
// it. These are the rows whose outputs a kernel computes; every other row of O, dQ, dK, dV is 0.
std::vector<uint8_t> rows_read(const AttentionCall& call, bool kv_side);

// The non-CP call on a validated layout: one Q and one KV segment per sequence at position 0.
AttentionCall non_cp_call(const ThdLayout& layout, Window window, double softmax_scale);

}  // namespace cpgold
