#pragma once
// Row reorders of THD tensors between the layouts of the partition (docs/cp-layout.md, "Helper kernels"), on any row
// type.
#include <cstddef>  // size_t, used by reference/tensor.hpp
#include <algorithm>

#include "reference/input_error.hpp"
#include "reference/tensor.hpp"
#include "sim/plan/partition.hpp"
#include "sim/plan/step_rows.hpp"

namespace cpgold::sim {

// thd_sequence_order_to_cp_rank_order: x [cuP[B], h, d] in sequence order -> [cuP[B], h, d] as the concatenation of
// every rank's local tensor (rank 0 first).
template <class T>
Tensor3<T> sequence_to_rank_order(const Tensor3<T>& x, const SidePartition& side) {
  return gather_rows(x, side.rank_order_to_sequence_order());
}

// thd_cp_rank_order_to_sequence_order: the inverse of sequence_to_rank_order.
template <class T>
Tensor3<T> rank_to_sequence_order(const Tensor3<T>& x, const SidePartition& side) {
  const std::vector<int64_t> map = side.rank_order_to_sequence_order();
  Tensor3<T> out(static_cast<int64_t>(map.size()), x.heads, x.dim);
  const int64_t s = x.row_stride();
  for (size_t gi = 0; gi < map.size(); ++gi)
    std::copy_n(x.values.begin() + static_cast<int64_t>(gi) * s, s, out.values.begin() + map[gi] * s);
  return out;
}

// thd_read_half_tensor: x [local_rows, h, d] of a rank -> [cuP[B] / (2W), h, d] holding chunk r (half 0) or
// chunk 2W-1-r (half 1) of every sequence at the half offsets cuP / (2W).
template <class T>
Tensor3<T> read_half(const Tensor3<T>& x, const SidePartition& side, int half) {
  return gather_rows(x, side.read_half_rows(half));
}

// thd_copy_valid_tokens_from_per_split_to_rank_local: out, in [t, h, d]; cu_padded_step [B+1] step offsets (need not
// start at 0), cu_step [B+1] actual counts. out[x] = in[x] for rows x with 0 <= x - cuP_step[s] < L_s (s the sequence
// of x by binary search); other rows of out are left as they are.
template <class T>
void copy_valid_rows(Tensor3<T>& out, const Tensor3<T>& in, const std::vector<int32_t>& cu_padded_step,
                     const std::vector<int32_t>& cu_step) {
  check_offsets(cu_padded_step, "cu_seqlens_padded_step", false);
  check_offsets(cu_step, "cu_seqlens_step");
  if (cu_step.size() != cu_padded_step.size())
    fail_input("cu_seqlens_step", "has ", cu_step.size(), " entries, cu_seqlens_padded_step has ",
               cu_padded_step.size());
  if (!out.same_shape(in)) fail_input("out_rows", "value ", out.rows, " (shape) differs from the input's ", in.rows);
  const int64_t s = in.row_stride();
  for (int64_t x = 0; x < in.rows; ++x) {
    const int b = sequence_of_row(cu_padded_step, x);
    const int64_t loc = x - cu_padded_step[static_cast<size_t>(b)];
    if (loc >= 0 && loc < cu_step[static_cast<size_t>(b) + 1] - cu_step[static_cast<size_t>(b)])
      std::copy_n(in.values.begin() + x * s, s, out.values.begin() + x * s);
  }
}

}  // namespace cpgold::sim
