#pragma once
// THD layout: B packed sequences with padding after each one's valid tokens, plus tail rows past the last.
// Sequence b owns rows [cu_seqlens_padded[b], cu_seqlens_padded[b+1]); its valid tokens are the first
// cu_seqlens[b+1] - cu_seqlens[b] of them. Every constructor validates and throws InputError naming the field.
#include <cstdint>
#include <string>
#include <vector>

namespace cpgold {

// One side (q or kv) of a THD layout.
struct PackedSequences {
  std::vector<int32_t> cu_seqlens;         // [B+1] cumulative actual lengths
  std::vector<int32_t> cu_seqlens_padded;  // [B+1] physical offsets
  int64_t total_rows = 0;                  // rows of the tensor (>= cu_seqlens_padded[B]; the rest are tail rows)

  int batch() const { return static_cast<int>(cu_seqlens.size()) - 1; }
  int32_t length(int b) const { return cu_seqlens[b + 1] - cu_seqlens[b]; }
  int32_t padded_length(int b) const { return cu_seqlens_padded[b + 1] - cu_seqlens_padded[b]; }
  int32_t offset(int b) const { return cu_seqlens_padded[b]; }
  // True if row r holds a valid token of some sequence.
  bool is_valid_row(int64_t row) const;
  // Validates; `side` is "q" or "kv" and names fields "cu_seqlens_q", "cu_seqlens_q_padded", "total_tokens_q".
  void validate(const std::string& side) const;
};

struct ThdLayout {
  PackedSequences q, kv;
  int batch() const { return q.batch(); }
  // Validates both sides and that they describe the same number of sequences.
  void validate() const;
};

// Builds one side from per-sequence lengths; padded_lengths empty means no padding; total_rows < 0 means the
// sum of padded lengths. Validates.
PackedSequences make_packed_sequences(const std::vector<int32_t>& lengths, const std::vector<int32_t>& padded_lengths,
                                      int64_t total_rows, const std::string& side);

}  // namespace cpgold
