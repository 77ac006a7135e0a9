#pragma once
// A THD layout as the tests of the CP helpers build it (docs/cp-layout.md): sequence lengths, each padded to a multiple
// of 2W so that it splits into 2W equal chunks, and their cu_seqlens.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "sim/plan/partition.hpp"

namespace cpgold::sim::testing {

struct PaddedLayout {
  int cp_size = 2;
  std::vector<int32_t> lengths, padded;  // per sequence
  std::vector<int32_t> cu, cu_padded;    // [B+1] global
  int batch() const { return static_cast<int>(lengths.size()); }
  int64_t total() const { return cu_padded.back(); }
  int32_t chunk(int b) const { return (cu_padded[b + 1] - cu_padded[b]) / (2 * cp_size); }
  // The offsets of a rank's local tensor: cu_padded / W.
  std::vector<int32_t> local() const {
    std::vector<int32_t> out;
    for (int32_t x : cu_padded) out.push_back(x / cp_size);
    return out;
  }
  // The rows of chunk c of sequence b that hold tokens.
  int32_t valid_in_chunk(int b, int c) const { return std::clamp(lengths[b] - c * chunk(b), 0, chunk(b)); }
  SidePartition partition() const { return SidePartition(make_packed_sequences(lengths, padded, -1, "q"), cp_size, "q"); }
};

// `lengths`, each padded to a multiple of 2W * pad_factor (chunks of multiples of `pad_factor` rows).
inline PaddedLayout padded_layout(int cp_size, const std::vector<int32_t>& lengths, int pad_factor = 1) {
  PaddedLayout l;
  l.cp_size = cp_size;
  l.cu = {0};
  l.cu_padded = {0};
  const int32_t unit = 2 * cp_size * pad_factor;
  for (int32_t len : lengths) {
    const int32_t pad = (len + unit - 1) / unit * unit;
    l.lengths.push_back(len);
    l.padded.push_back(pad);
    l.cu.push_back(l.cu.back() + len);
    l.cu_padded.push_back(l.cu_padded.back() + pad);
  }
  return l;
}

}  // namespace cpgold::sim::testing
