#pragma once
// The row operations of one rank's CP program on the device (sim/program/cp_program.hpp): gathers and scatters of tensor and
// LSE rows between step, group and rank tensors; the float32 accumulation of backward partials (scatter_add, on the
// accumulation stream with CpGpuOptions::accumulate_aside); the forward merge of the step partials; and the final
// rounding of float32 accumulators to the dtype. Kernels: gpu/kernels/cp/cp_kernels.hpp.
#include <cstdint>
#include <vector>

#include "gpu/cp/device_tensor.hpp"
#include "gpu/cp/rank_memory.hpp"
#include "gpu/cp/rank_streams.hpp"
#include "gpu/cp/rank_timing.hpp"

namespace cpgold::gpu {

class RankRowOps {
 public:
  // One forward partial of a merge: O [n_i, h, d], LSE [h, n_i], and the merged row of each of its rows.
  struct Partial {
    const DeviceTensor* o = nullptr;
    const DeviceLse* lse = nullptr;
    const std::vector<int64_t>* rows = nullptr;
  };

  // storage: the element type of the case's dtype. accumulate_aside: scatter_add runs on the accumulation stream.
  RankRowOps(const RankStreams& streams, RankTiming& timing, RankMemory& memory, Elem storage, bool accumulate_aside)
      : streams_(streams), timing_(timing), memory_(memory), storage_(storage), accumulate_aside_(accumulate_aside) {}
  RankRowOps(const RankRowOps&) = delete;
  RankRowOps& operator=(const RankRowOps&) = delete;

  // [heads, rows] of -inf.
  DeviceLse lse_empty(int64_t heads, int64_t rows);
  // [rows.size(), h1 - h0, d]: out[i] = x[rows[i], h0:h1].
  DeviceTensor gather(const DeviceTensor& x, const std::vector<int64_t>& rows, int h0, int h1);
  // dst[rows[i], h0:h0 + src.heads] = src[i].
  void scatter(DeviceTensor& dst, const std::vector<int64_t>& rows, int h0, const DeviceTensor& src);
  // dst[rows[i]] += src[i] (all heads) into a float32 dst.
  void scatter_add(DeviceTensor& dst, const std::vector<int64_t>& rows, const DeviceTensor& src);
  DeviceLse lse_gather(const DeviceLse& x, const std::vector<int64_t>& rows);
  void lse_scatter(DeviceLse& dst, const std::vector<int64_t>& rows, int h0, const DeviceLse& src);
  // One pass (launch_merge_forward): LSE merged in step order, O summed in float32 in step order and rounded once to
  // the dtype, written straight into a storage tensor that replaces the fresh zero accumulator `o`.
  void merge_forward(const std::vector<Partial>& parts, DeviceTensor& o, DeviceLse& lse);
  // A float32 accumulator -> a tensor of the dtype (a storage tensor is left as it is).
  void finalize(DeviceTensor& x);

 private:
  // [n] for the merge: the partial's row holding merged row r, -1 where the partial has none. rows: [partial rows].
  std::vector<int64_t> source_rows(const std::vector<int64_t>& rows, int64_t n) const;

  const RankStreams& streams_;
  RankTiming& timing_;
  RankMemory& memory_;
  Elem storage_;
  bool accumulate_aside_;
};

}  // namespace cpgold::gpu
