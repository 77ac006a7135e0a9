#pragma once
// The tensors of one rank of the GPU CP executor: stream-ordered device allocations shared by every copy of a tensor,
// the program's [rows, heads, dim] tensors and [heads, rows] LSEs over them (sim/program/cp_program.hpp's Tensor and Lse).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "gpu/cp/rank_streams.hpp"
#include "gpu/kernels/cp/cp_kernels.hpp"
#include "reference/dtype.hpp"

namespace cpgold::gpu {

// One stream-ordered device allocation, freed on the stream that made it. pending_zero: the program asked for zeros
// and nothing has been written yet; the zeros are written only if something reads the buffer before a write that
// covers all of it (a receive, a first accumulation over every row, the forward merge), so buffers that are fully
// overwritten are never filled. Shared by every copy of a tensor, so all of them see the write.
// side_use: the accumulation stream read or wrote the buffer last (that operation's end event) and no other stream
// has waited for it since; while it is set the buffer is freed on the accumulation stream, and any other stream
// waits for the event before touching the buffer (RankMemory::own).
struct DeviceMemory {
  void* ptr = nullptr;
  cudaStream_t stream = nullptr;       // the compute stream that allocated it
  cudaStream_t side_stream = nullptr;  // that rank's accumulation stream
  EventRef side_use;
  bool pending_zero = false;
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (ptr) cudaFreeAsync(ptr, side_use ? side_stream : stream);
  }
};

// [rows, heads, dim] row-major on the device; copies share the allocation (the program never writes a tensor it
// did not create).
struct DeviceTensor {
  std::shared_ptr<DeviceMemory> mem;
  int64_t rows = 0, heads = 0, dim = 0;
  Elem elem = Elem::f32;
  void* data() const { return mem ? mem->ptr : nullptr; }
  size_t count() const { return static_cast<size_t>(rows * heads * dim); }
  size_t bytes() const { return count() * elem_bytes(elem); }
};

// [heads, rows] float32 on the device.
struct DeviceLse {
  std::shared_ptr<DeviceMemory> mem;
  int64_t heads = 0, rows = 0;
  float* data() const { return mem ? static_cast<float*>(mem->ptr) : nullptr; }
  size_t count() const { return static_cast<size_t>(heads * rows); }
  size_t bytes() const { return count() * sizeof(float); }
};

// The element type of the case's dtype on the device: the GPU CP path runs bf16 and fp16.
inline Elem storage_elem(DType dtype) {
  if (dtype == DType::bf16) return Elem::bf16;
  if (dtype == DType::fp16) return Elem::fp16;
  throw std::invalid_argument("dtype: the GPU CP path runs bf16 or fp16, not " + std::string(dtype_name(dtype)));
}

}  // namespace cpgold::gpu
