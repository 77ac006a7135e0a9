#pragma once
// THD CP helper kernels (docs/cp-layout.md, "Helper kernels"): partitioned indices, sequence-order <-> rank-order
// reorders, read half, copy of valid tokens, second-half LSE correction and read, out correction, grad correction. Each
// has a CPU twin in sim/ (partition, reorder, step_rows, lse_halves, out_correction, grad_correction) and is bit-exact
// against it. Row copies use 16-byte vectors, so a row (or, for the out correction, one head) must be a multiple of 16
// bytes and every tensor 16-byte aligned; otherwise the call returns invalid_argument naming field and value. Shapes
// are checked on the host from the host copy of the offsets; launches are asynchronous on `stream` (a cudaStream_t,
// nullptr = default stream).
#include <cstdint>
#include <vector>

#include "gpu/kernels/attention/attention.hpp"
#include "reference/dtype.hpp"
#include "sim/thd_helpers/grad_correction.hpp"
#include "sim/thd_helpers/lse_halves.hpp"

namespace cpgold::gpu {

// offsets [B+1] int32 on the device together with their host copy (read by the shape checks) and the facts the
// per-call checks need (sim::OffsetFacts, found once at the upload: a valid layout is checked in O(1) per call).
// Move-only.
class DeviceOffsets {
 public:
  DeviceOffsets() = default;
  // Uploads synchronously; std::runtime_error naming the CUDA call on failure.
  explicit DeviceOffsets(std::vector<int32_t> host);
  ~DeviceOffsets();
  DeviceOffsets(DeviceOffsets&& other) noexcept;
  DeviceOffsets& operator=(DeviceOffsets&& other) noexcept;
  DeviceOffsets(const DeviceOffsets&) = delete;
  DeviceOffsets& operator=(const DeviceOffsets&) = delete;

  const int32_t* device() const { return device_; }
  const std::vector<int32_t>& host() const { return host_; }
  const sim::OffsetFacts& facts() const { return facts_; }
  int batch() const { return static_cast<int>(host_.size()) - 1; }

 private:
  std::vector<int32_t> host_;
  sim::OffsetFacts facts_;
  int32_t* device_ = nullptr;
};

// A device tensor [rows, heads, dim] of dtype, rows contiguous (row stride heads * dim elements).
struct DeviceRows {
  void* data = nullptr;
  int64_t rows = 0, heads = 0, dim = 0;
  DType dtype = DType::bf16;
  int64_t row_bytes() const { return heads * dim * dtype_bytes(dtype); }
};

// A device float32 softmax-statistics tensor: packed [h, S] or unpacked [B, h, S] (sim::LseShape).
struct DeviceLse {
  float* data = nullptr;
  sim::LseShape shape;
};

// indices [count = cuP[B]/W] int64: global row of every local row of `rank` (thd_get_partitioned_indices);
// cu_padded [B+1] global padded offsets, every PL_b a multiple of 2W.
Outcome partitioned_indices(const DeviceOffsets& cu_padded, int cp_size, int rank, int64_t* indices, int64_t count,
                            void* stream = nullptr);

// in, out [cuP[B], h, d]: sequence order -> rank order (out[gi] = in[src(gi)]), and the inverse.
Outcome sequence_to_rank_order(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_padded,
                               int cp_size, void* stream = nullptr);
Outcome rank_to_sequence_order(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_padded,
                               int cp_size, void* stream = nullptr);

// in [t >= cu_local[B], h, d] -> out [cu_local[B]/2, h, d]: half 0 (chunk r) or 1 (chunk 2W-1-r) of every sequence;
// cu_local [B+1] rank-local padded offsets cuP/W.
Outcome read_half(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_local, int half,
                  void* stream = nullptr);

// out, in [t, h, d]: out[x] = in[x] for the valid rows of every sequence of the step (cu_padded_step [B+1] offsets,
// need not start at 0; cu_step [B+1] actual counts). Other rows of out are not written.
Outcome copy_valid_rows(const DeviceRows& out, const DeviceRows& in, const DeviceOffsets& cu_padded_step,
                        const DeviceOffsets& cu_step, void* stream = nullptr);

// lse [full], lse_half [half shape]: lse[second-half row] = logaddexp(lse, lse_half), the float32 formula of
// sim/thd_helpers/lse_merge_float.hpp (correctly rounded operations only, so the kernel and its twin agree bit for bit).
// Packed layouts whose rank-local lengths are multiples of 8, with head strides multiple of 4 and 16-byte aligned
// tensors, move 16-byte vectors; the others 4-byte elements (the same results).
Outcome second_half_lse_correction(const DeviceLse& lse, const DeviceLse& lse_half, const DeviceOffsets& cu_local,
                                   void* stream = nullptr);

// lse [full] -> lse_half [half shape], zero-initialised, then the second-half rows copied.
Outcome read_second_half_lse(const DeviceLse& lse, const DeviceLse& lse_half, const DeviceOffsets& cu_local,
                             void* stream = nullptr);

// out [t, h, d], out_i [cu_local[B]/(1+k), h, d] (k = only_second_half); lse of the rank-local rows, lse_i of the
// step rows: out[row] = dtype(out + (v == 0 ? 0 : dtype(v * exp(lse_i - lse)))) per element.
Outcome out_correction(const DeviceRows& out, const DeviceRows& out_i, const DeviceLse& lse, const DeviceLse& lse_i,
                       const DeviceOffsets& cu_local, bool only_second_half, void* stream = nullptr);

// grad [t, h, d], grad_i [half or full step rows, h, d] (sim::grad_step_rows(first, second)): copy or add in dtype.
Outcome grad_correction(const DeviceRows& grad, const DeviceRows& grad_i, const DeviceOffsets& cu_local,
                        sim::GradOp first, sim::GradOp second, void* stream = nullptr);

}  // namespace cpgold::gpu
