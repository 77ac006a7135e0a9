// RankMemory: allocation, pending zeros, hand-back from the accumulation stream, row indices, host copies (see the
// header).
#include "gpu/cp/rank_memory.hpp"

#include <algorithm>

#include "gpu/kernels/attention/dtype_bits.hpp"

namespace cpgold::gpu {

namespace {

bool covers_every_row(const std::vector<int64_t>& rows, int64_t n) {
  if (static_cast<int64_t>(rows.size()) != n) return false;
  for (int64_t i = 0; i < n; ++i)
    if (rows[static_cast<size_t>(i)] != i) return false;
  return true;
}

}  // namespace

std::shared_ptr<DeviceMemory> RankMemory::raw(size_t bytes) {
  auto m = std::make_shared<DeviceMemory>();
  m->stream = streams_.compute();
  m->side_stream = streams_.accumulation();
  streams_.check(cudaMallocAsync(&m->ptr, std::max<size_t>(bytes, 16), streams_.compute()), "cudaMallocAsync");
  return m;
}

DeviceTensor RankMemory::alloc(int64_t rows, int64_t heads, int64_t dim, Elem elem) {
  DeviceTensor t;
  t.rows = rows;
  t.heads = heads;
  t.dim = dim;
  t.elem = elem;
  t.mem = raw(t.bytes());
  return t;
}

DeviceLse RankMemory::alloc_lse(int64_t heads, int64_t rows) {
  DeviceLse l;
  l.heads = heads;
  l.rows = rows;
  l.mem = raw(l.bytes());
  return l;
}

DeviceTensor RankMemory::zeros(int64_t rows, int64_t heads, int64_t dim, Elem elem) {
  DeviceTensor t = alloc(rows, heads, dim, elem);
  t.mem->pending_zero = true;
  return t;
}

void RankMemory::materialize(const DeviceTensor& x) {
  own(x.mem);
  fill_pending_zeros(x);
}

void RankMemory::fill_pending_zeros(const DeviceTensor& x) {
  if (!x.mem || !x.mem->pending_zero) return;
  x.mem->pending_zero = false;
  if (x.bytes() > 0)
    timing_.timed("zero fill", x.bytes(), [&] {
      streams_.check(cudaMemsetAsync(x.data(), 0, x.bytes(), streams_.compute()), "cudaMemsetAsync");
    });
}

void RankMemory::own(const std::shared_ptr<DeviceMemory>& m) {
  if (!m || !m->side_use) return;
  streams_.check(cudaStreamWaitEvent(streams_.compute(), m->side_use->event, 0),
                 "cudaStreamWaitEvent (accumulation done)");
  m->side_use.reset();
}

bool RankMemory::start_sum(DeviceTensor& dst, const std::vector<int64_t>& rows) {
  const bool assign = dst.mem && dst.mem->pending_zero && covers_every_row(rows, dst.rows);
  if (!assign) fill_pending_zeros(dst);
  if (dst.mem) dst.mem->pending_zero = false;
  return assign;
}

std::shared_ptr<DeviceMemory> RankMemory::upload_rows(const std::vector<int64_t>& rows) {
  auto it = row_cache_.find(rows);
  if (it != row_cache_.end()) return it->second;
  auto m = raw(rows.size() * sizeof(int64_t));
  if (!rows.empty())
    streams_.check(
        cudaMemcpyAsync(m->ptr, rows.data(), rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice, streams_.compute()),
        "row index upload");
  row_cache_.emplace(rows, m);
  return m;
}

DeviceTensor RankMemory::upload(const Tensor3<float>& x, DType dtype, Elem elem) {
  DeviceTensor t = alloc(x.rows, x.heads, x.dim, elem);
  std::vector<uint16_t> bits(x.values.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_bits(dtype, x.values[i]);
  streams_.check(cudaMemcpyAsync(t.data(), bits.data(), t.bytes(), cudaMemcpyHostToDevice, streams_.compute()),
                 "upload");
  streams_.check(cudaStreamSynchronize(streams_.compute()), "upload");
  return t;
}

Tensor3<float> RankMemory::to_host(const DeviceTensor& x) {
  Tensor3<float> out(x.rows, x.heads, x.dim);
  if (x.count() == 0) return out;
  materialize(x);
  DeviceTensor f = x;
  if (x.elem != Elem::f32) {
    f = alloc(x.rows, x.heads, x.dim, Elem::f32);
    streams_.check(launch_convert(f.data(), Elem::f32, x.data(), x.elem, x.count(), streams_.compute()), "convert");
  }
  streams_.check(cudaMemcpyAsync(out.values.data(), f.data(), f.bytes(), cudaMemcpyDeviceToHost, streams_.compute()),
                 "download");
  streams_.check(cudaStreamSynchronize(streams_.compute()), "download");
  return out;
}

LseTensor<float> RankMemory::to_host(const DeviceLse& x) {
  LseTensor<float> out(x.heads, x.rows, 0.0f);
  if (x.count() == 0) return out;
  streams_.check(cudaMemcpyAsync(out.values.data(), x.data(), x.bytes(), cudaMemcpyDeviceToHost, streams_.compute()),
                 "download");
  streams_.check(cudaStreamSynchronize(streams_.compute()), "download");
  return out;
}

}  // namespace cpgold::gpu
