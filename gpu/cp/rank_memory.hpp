#pragma once
// Device memory of one rank of the GPU CP executor: stream-ordered allocations on the compute stream, the zeros that a
// fresh buffer owes (written only if something reads it before a write covers all of it), buffers that the
// accumulation stream used last handed back to the compute stream, the row index arrays of gathers and scatters
// (uploaded once per content), and copies between host and device.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "gpu/cp/device_tensor.hpp"
#include "gpu/cp/rank_streams.hpp"
#include "gpu/cp/rank_timing.hpp"
#include "reference/dtype.hpp"
#include "reference/tensor.hpp"

namespace cpgold::gpu {

class RankMemory {
 public:
  RankMemory(const RankStreams& streams, RankTiming& timing) : streams_(streams), timing_(timing) {}
  RankMemory(const RankMemory&) = delete;
  RankMemory& operator=(const RankMemory&) = delete;

  // Allocated on the compute stream (16 bytes at least), freed where DeviceMemory says.
  std::shared_ptr<DeviceMemory> raw(size_t bytes);
  DeviceTensor alloc(int64_t rows, int64_t heads, int64_t dim, Elem elem);
  DeviceLse alloc_lse(int64_t heads, int64_t rows);
  // A tensor that reads as zeros (DeviceMemory::pending_zero): nothing is written yet.
  DeviceTensor zeros(int64_t rows, int64_t heads, int64_t dim, Elem elem);

  // Before an operation of the compute stream reads or writes x: waits for the accumulation stream's use of it (own)
  // and writes its zeros if it is still pending_zero.
  void materialize(const DeviceTensor& x);
  // Writes the zeros of a tensor still pending_zero (before anything reads it or writes part of it).
  void fill_pending_zeros(const DeviceTensor& x);
  // Before the compute stream (or an exchange it starts) touches a buffer the accumulation stream used last: the
  // compute stream waits for that use, and the buffer is the compute stream's again (freed there).
  void own(const std::shared_ptr<DeviceMemory>& m);
  // Before rows of a float32 sum receive additions: true when this is the first contribution to every row of a fresh
  // zero sum, which is then written, not added (0 + x, the same bits), and never filled; otherwise its pending zeros
  // are written first.
  bool start_sum(DeviceTensor& dst, const std::vector<int64_t>& rows);

  // Row index arrays are uploaded once per distinct content and kept for later steps and runs: an upload from
  // pageable memory synchronises the stream, which would serialise every gather and scatter with the host.
  std::shared_ptr<DeviceMemory> upload_rows(const std::vector<int64_t>& rows);
  static const int64_t* rows_ptr(const std::shared_ptr<DeviceMemory>& m) { return static_cast<const int64_t*>(m->ptr); }

  // Host float tensor holding values of `dtype` -> a device tensor of its 16-bit storage `elem`; synchronises the
  // compute stream.
  DeviceTensor upload(const Tensor3<float>& x, DType dtype, Elem elem);
  // Device -> host float (values of the element type); synchronises the compute stream.
  Tensor3<float> to_host(const DeviceTensor& x);
  LseTensor<float> to_host(const DeviceLse& x);

 private:
  const RankStreams& streams_;
  RankTiming& timing_;
  struct RowsHash {
    size_t operator()(const std::vector<int64_t>& rows) const {
      uint64_t h = 1469598103934665603ull ^ rows.size();
      for (int64_t r : rows) h = (h ^ static_cast<uint64_t>(r)) * 1099511628211ull;
      return static_cast<size_t>(h);
    }
  };
  std::unordered_map<std::vector<int64_t>, std::shared_ptr<DeviceMemory>, RowsHash> row_cache_;
};

}  // namespace cpgold::gpu
