// Host-tensor wrappers: 16-bit conversion, upload, launch, download (synchronous).
#include "gpu/kernels/attention/host_attention.hpp"

#include <cuda_runtime_api.h>

#include <Eigen/Core>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/kernels/attention/dtype_bits.hpp"

namespace cpgold::gpu {

namespace {


// Owns one device allocation.
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  cudaError_t allocate(size_t bytes) {
    bytes_ = bytes;
    return cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes);
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct Failure {
  Outcome outcome;
};

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Failure{{Status::cuda_error, std::string(what) + ": " + cudaGetErrorString(e)}};
}

void upload(DeviceArray& dst, DType dtype, const Tensor3<float>& x) {
  std::vector<uint16_t> bits(x.values.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_bits(dtype, x.values[i]);
  check(dst.allocate(bits.size() * 2), "cudaMalloc");
  check(cudaMemcpy(dst.get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

void upload_floats(DeviceArray& dst, const std::vector<float>& x) {
  check(dst.allocate(x.size() * 4), "cudaMalloc");
  check(cudaMemcpy(dst.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

// An output buffer pre-filled with 0xFF bytes (NaN in bf16, fp16 and float32).
void allocate_poisoned(DeviceArray& dst, size_t bytes) {
  check(dst.allocate(bytes), "cudaMalloc");
  check(cudaMemset(dst.get(), 0xFF, bytes == 0 ? 16 : bytes), "cudaMemset");
}

Tensor3<float> download(const DeviceArray& src, DType dtype, int64_t rows, int64_t heads, int64_t dim) {
  Tensor3<float> x(rows, heads, dim);
  std::vector<uint16_t> bits(x.values.size());
  check(cudaMemcpy(bits.data(), src.get(), bits.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  for (size_t i = 0; i < bits.size(); ++i) x.values[i] = from_bits(dtype, bits[i]);
  return x;
}

}  // namespace

AttentionShape shape_of(DType dtype, const Tensor3<float>& q, const Tensor3<float>& k, const Tensor3<float>& v) {
  AttentionShape shape;
  shape.dtype = dtype;
  shape.heads_q = static_cast<int>(q.heads);
  shape.heads_kv = static_cast<int>(k.heads);
  shape.dim_qk = static_cast<int>(q.dim);
  shape.dim_v = static_cast<int>(v.dim);
  return shape;
}

Outcome forward_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                          const Tensor3<float>& v, HostForward& out, ForwardKernel kernel,
                          ForwardSchedule schedule) {
  const AttentionShape shape = shape_of(dtype, q, k, v);
  if (q.rows != call.q_rows || k.rows != call.kv_rows || v.rows != call.kv_rows || k.dim != q.dim ||
      v.heads != k.heads)
    return {Status::invalid_argument, "forward_on_device: tensor shapes do not match the call"};
  AttentionPlan plan;
  if (Outcome o = plan.build(call, shape); !o.ok()) return o;
  try {
    DeviceArray dq, dk, dv, d_o, d_lse;
    upload(dq, dtype, q);
    upload(dk, dtype, k);
    upload(dv, dtype, v);
    allocate_poisoned(d_o, static_cast<size_t>(q.rows * q.heads * v.dim) * 2);
    allocate_poisoned(d_lse, static_cast<size_t>(q.heads * q.rows) * 4);
    ForwardBuffers b{dq.get(), dk.get(), dv.get(), d_o.get(), static_cast<float*>(d_lse.get())};
    if (Outcome o = attention_forward(plan, b, nullptr, kernel, schedule); !o.ok()) return o;
    check(cudaDeviceSynchronize(), "attention forward");
    out.o = download(d_o, dtype, q.rows, q.heads, v.dim);
    out.lse = LseTensor<float>(q.heads, q.rows, 0.f);
    check(cudaMemcpy(out.lse.values.data(), d_lse.get(), out.lse.values.size() * 4, cudaMemcpyDeviceToHost),
          "cudaMemcpy to host");
  } catch (const Failure& f) {
    return f.outcome;
  }
  return {};
}

namespace {

void upload_rows(DeviceArray& dst, const std::vector<int64_t>& x) {
  check(dst.allocate(x.size() * 8), "cudaMalloc");
  check(cudaMemcpy(dst.get(), x.data(), x.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
void download_floats(std::vector<float>& x, const DeviceArray& src) {
  check(cudaMemcpy(x.data(), src.get(), x.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

// Both forms: with `sums`, the outputs go into its float32 tensors instead of `out`.
Outcome backward_common(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                        const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                        const Tensor3<float>& dout, BackwardMode mode, HostBackward* out, HostSums* sums,
                        const HostBackwardOptions& options) {
  const AttentionShape shape = shape_of(dtype, q, k, v);
  if (q.rows != call.q_rows || k.rows != call.kv_rows || v.rows != call.kv_rows || k.dim != q.dim ||
      v.heads != k.heads || !o.same_shape(dout) || o.rows != q.rows || o.heads != q.heads || o.dim != v.dim ||
      lse.rows != q.rows || lse.heads != q.heads)
    return {Status::invalid_argument, "backward_on_device: tensor shapes do not match the call"};
  if (sums != nullptr) {
    auto fits = [](const Tensor3<float>& sum, const Tensor3<float>& x, const std::vector<int64_t>& map) {
      if (sum.heads * sum.dim != x.heads * x.dim || static_cast<int64_t>(map.size()) != x.rows) return false;
      for (int64_t r : map)
        if (r < 0 || r >= sum.rows) return false;
      return true;
    };
    if (!fits(sums->dq, q, sums->q_map) || !fits(sums->dk, k, sums->kv_map) || !fits(sums->dv, v, sums->kv_map))
      return {Status::invalid_argument, "backward_sum_on_device: a sum's row width or row map does not fit"};
  }
  AttentionPlan plan;
  if (Outcome r = plan.build(call, shape, sums != nullptr ? sums->outside : OutsideRows{}); !r.ok()) return r;
  try {
    DeviceArray d_q, d_k, d_v, d_o, d_do, d_lse, d_dq, d_dk, d_dv, d_qmap, d_kvmap, r_dq, r_dk, r_dv, d_delta;
    upload(d_q, dtype, q);
    upload(d_k, dtype, k);
    upload(d_v, dtype, v);
    upload(d_o, dtype, o);
    upload(d_do, dtype, dout);
    upload_floats(d_lse, lse.values);
    BackwardBuffers b;
    b.q = d_q.get();
    b.k = d_k.get();
    b.v = d_v.get();
    b.o = d_o.get();
    b.dout = d_do.get();
    b.lse = static_cast<const float*>(d_lse.get());
    if (sums == nullptr) {
      allocate_poisoned(d_dq, q.values.size() * 2);
      allocate_poisoned(d_dk, k.values.size() * 2);
      allocate_poisoned(d_dv, v.values.size() * 2);
      b.dq = d_dq.get();
      b.dk = d_dk.get();
      b.dv = d_dv.get();
    } else {
      upload_floats(d_dq, sums->dq.values);
      upload_floats(d_dk, sums->dk.values);
      upload_floats(d_dv, sums->dv.values);
      upload_rows(d_qmap, sums->q_map);
      upload_rows(d_kvmap, sums->kv_map);
      const auto* qmap = static_cast<const int64_t*>(d_qmap.get());
      const auto* kvmap = static_cast<const int64_t*>(d_kvmap.get());
      b.dq_sum = {static_cast<float*>(d_dq.get()), qmap, sums->assign_q};
      b.dk_sum = {static_cast<float*>(d_dk.get()), kvmap, sums->assign_kv};
      b.dv_sum = {static_cast<float*>(d_dv.get()), kvmap, sums->assign_kv};
      if (sums->result_q) {
        allocate_poisoned(r_dq, sums->dq.values.size() * 2);
        b.dq_sum.result = r_dq.get();
      }
      if (sums->result_kv) {
        allocate_poisoned(r_dk, sums->dk.values.size() * 2);
        allocate_poisoned(r_dv, sums->dv.values.size() * 2);
        b.dk_sum.result = r_dk.get();
        b.dv_sum.result = r_dv.get();
      }
    }
    if (options.caller_delta) {
      allocate_poisoned(d_delta, static_cast<size_t>(q.heads * q.rows) * 4);
      if (Outcome r = attention_row_delta(shape, d_o.get(), d_do.get(), q.rows, static_cast<float*>(d_delta.get()));
          !r.ok())
        return r;
      b.delta = static_cast<const float*>(d_delta.get());
    }
    if (Outcome r = attention_backward(plan, b, mode, nullptr, options.kernel); !r.ok()) return r;
    check(cudaDeviceSynchronize(), "attention backward");
    if (sums == nullptr) {
      out->dq = download(d_dq, dtype, q.rows, q.heads, q.dim);
      out->dk = download(d_dk, dtype, k.rows, k.heads, k.dim);
      out->dv = download(d_dv, dtype, v.rows, v.heads, v.dim);
    } else {
      auto back = [&](Tensor3<float>& x, const DeviceArray& sum, const DeviceArray& result, bool is_result) {
        if (is_result)
          x = download(result, dtype, x.rows, x.heads, x.dim);
        else
          download_floats(x.values, sum);
      };
      back(sums->dq, d_dq, r_dq, sums->result_q);
      back(sums->dk, d_dk, r_dk, sums->result_kv);
      back(sums->dv, d_dv, r_dv, sums->result_kv);
    }
  } catch (const Failure& f) {
    return f.outcome;
  }
  return {};
}

}  // namespace

Outcome backward_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                           const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                           const Tensor3<float>& dout, BackwardMode mode, HostBackward& out,
                           HostBackwardOptions options) {
  return backward_common(call, dtype, q, k, v, o, lse, dout, mode, &out, nullptr, options);
}

Outcome backward_sum_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q,
                               const Tensor3<float>& k, const Tensor3<float>& v, const Tensor3<float>& o,
                               const LseTensor<float>& lse, const Tensor3<float>& dout, BackwardMode mode,
                               HostSums& sums, HostBackwardOptions options) {
  return backward_common(call, dtype, q, k, v, o, lse, dout, mode, nullptr, &sums, options);
}

}  // namespace cpgold::gpu
