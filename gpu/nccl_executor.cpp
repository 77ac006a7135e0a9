// run_cp_rank: the device backend of the CP program for one rank of a multi-GPU run.
// The backend below is the one of gpu/cp_executor.cpp (DeviceRankBackend), which keeps it private to the
// single-GPU driver; it is repeated here unchanged so that a rank can run alone on its GPU, and should become one
// shared backend once gpu/cp_executor.hpp exposes a per-rank entry point.
#include "gpu/nccl_executor.hpp"

#include <cuda_runtime_api.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "gpu/cp_kernels.hpp"
#include "sim/cp_program.hpp"

namespace cpgold::gpu {
namespace {

// One stream-ordered device allocation, freed on the stream that made it.
struct DeviceMemory {
  void* ptr = nullptr;
  cudaStream_t stream = nullptr;
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (ptr) cudaFreeAsync(ptr, stream);
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

Elem storage_elem(DType dtype) {
  if (dtype == DType::bf16) return Elem::bf16;
  if (dtype == DType::fp16) return Elem::fp16;
  throw std::invalid_argument("dtype: the GPU CP path runs bf16 or fp16, not " + std::string(dtype_name(dtype)));
}

uint16_t to_bits(Elem e, float x) {
  if (e == Elem::bf16) return Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(x));
  return Eigen::numext::bit_cast<uint16_t>(Eigen::half(x));
}

class DeviceRankBackend {
 public:
  using Tensor = DeviceTensor;
  using Lse = DeviceLse;
  struct Forward {
    DeviceTensor o;
    DeviceLse lse;
  };
  struct Backward {
    DeviceTensor dq, dk, dv;
  };

  DeviceRankBackend(int rank, Communicator& comm, DType dtype, const CpGpuOptions& options)
      : rank_(rank), comm_(comm), dtype_(dtype), storage_(storage_elem(dtype)), options_(options),
        stream_(static_cast<cudaStream_t>(comm.stream())) {}

  int rank() const { return rank_; }
  cudaStream_t stream() const { return stream_; }

  // Host float tensor holding dtype values -> device storage tensor.
  void upload_input(sim::Payload payload, const Tensor3<float>& x) {
    DeviceTensor t = alloc(x.rows, x.heads, x.dim, storage_);
    std::vector<uint16_t> bits(x.values.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_bits(storage_, x.values[i]);
    cuda(cudaMemcpyAsync(t.data(), bits.data(), t.bytes(), cudaMemcpyHostToDevice, stream_), "upload");
    cuda(cudaStreamSynchronize(stream_), "upload");
    inputs_[static_cast<int>(payload)] = std::move(t);
  }

  const Tensor& input(sim::Payload payload) const {
    auto it = inputs_.find(static_cast<int>(payload));
    if (it == inputs_.end())
      throw std::logic_error("rank " + std::to_string(rank_) + ": no input " + std::string(sim::payload_name(payload)));
    return it->second;
  }
  Tensor zeros(int64_t rows, int64_t heads, int64_t dim, sim::BufferKind kind) {
    DeviceTensor t = alloc(rows, heads, dim, kind == sim::BufferKind::storage ? storage_ : Elem::f32);
    if (t.bytes() > 0) cuda(cudaMemsetAsync(t.data(), 0, t.bytes(), stream_), "cudaMemsetAsync");
    return t;
  }
  Lse lse_empty(int64_t heads, int64_t rows) {
    DeviceLse l;
    l.heads = heads;
    l.rows = rows;
    l.mem = raw(l.bytes());
    cuda(launch_fill(l.data(), l.count(), -INFINITY, stream_), "fill");
    return l;
  }
  sim::Shape shape(const Tensor& x) const { return {x.rows, x.heads, x.dim}; }

  Tensor gather(const Tensor& x, const std::vector<int64_t>& rows, int h0, int h1) {
    DeviceTensor out = alloc(static_cast<int64_t>(rows.size()), h1 - h0, x.dim, x.elem);
    const auto idx = upload_rows(rows);
    cuda(launch_gather_rows(out.data(), x.data(), rows_ptr(idx), out.rows, x.heads, h0, h1 - h0, x.dim, x.elem, stream_),
         "gather");
    return out;
  }
  void scatter(Tensor& dst, const std::vector<int64_t>& rows, int h0, const Tensor& src) {
    if (dst.elem != src.elem) throw std::logic_error("rank " + std::to_string(rank_) + ": scatter between element types");
    const auto idx = upload_rows(rows);
    cuda(launch_scatter_rows(dst.data(), src.data(), rows_ptr(idx), static_cast<int64_t>(rows.size()), dst.heads, h0,
                             src.heads, src.dim, src.elem, stream_),
         "scatter");
  }
  void scatter_add(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) {
    if (dst.elem != Elem::f32) throw std::logic_error("rank " + std::to_string(rank_) + ": accumulation into 16-bit");
    const auto idx = upload_rows(rows);
    cuda(launch_scatter_add(static_cast<float*>(dst.data()), src.data(), src.elem, rows_ptr(idx),
                            static_cast<int64_t>(rows.size()), src.heads * src.dim, stream_),
         "scatter_add");
  }
  Lse lse_gather(const Lse& x, const std::vector<int64_t>& rows) {
    DeviceLse out;
    out.heads = x.heads;
    out.rows = static_cast<int64_t>(rows.size());
    out.mem = raw(out.bytes());
    const auto idx = upload_rows(rows);
    cuda(launch_lse_gather(out.data(), x.data(), rows_ptr(idx), out.rows, x.heads, x.rows, stream_), "lse_gather");
    return out;
  }
  void lse_scatter(Lse& dst, const std::vector<int64_t>& rows, int h0, const Lse& src) {
    const auto idx = upload_rows(rows);
    cuda(launch_lse_scatter(dst.data(), src.data(), rows_ptr(idx), static_cast<int64_t>(rows.size()), src.heads,
                            dst.rows, h0, stream_),
         "lse_scatter");
  }

  Forward forward(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) {
    const AttentionPlan& plan = plan_for(t, q, k, v);
    Forward r{alloc(q.rows, q.heads, v.dim, storage_), {}};
    r.lse.heads = q.heads;
    r.lse.rows = q.rows;
    r.lse.mem = raw(r.lse.bytes());
    const Outcome out = attention_forward(plan, {q.data(), k.data(), v.data(), r.o.data(), r.lse.data()}, stream_);
    if (!out.ok()) fail_step(t, "attention_forward", out);
    if (options_.inject && options_.inject->rank == rank_ && options_.inject->step == t.step) corrupt(t, r.o);
    return r;
  }
  Backward backward(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                    const Lse& lse, const Tensor& dout) {
    const AttentionPlan& plan = plan_for(t, q, k, v);
    Backward r{alloc(q.rows, q.heads, q.dim, storage_), alloc(k.rows, k.heads, k.dim, storage_),
               alloc(v.rows, v.heads, v.dim, storage_)};
    const Outcome out = attention_backward(
        plan, {q.data(), k.data(), v.data(), o.data(), dout.data(), lse.data(), r.dq.data(), r.dk.data(), r.dv.data()},
        options_.mode, stream_);
    if (!out.ok()) fail_step(t, "attention_backward", out);
    return r;
  }
  // LSE merged in step order, then O accumulated in float32 and rounded once to the dtype.
  void merge_forward(const std::vector<sim::MergePart<DeviceRankBackend>>& parts, Tensor& o, Lse& lse) {
    std::vector<std::shared_ptr<DeviceMemory>> idx;
    for (const auto& part : parts) {
      idx.push_back(upload_rows(part.rows));
      cuda(launch_lse_merge_into(lse.data(), part.lse->data(), rows_ptr(idx.back()),
                                 static_cast<int64_t>(part.rows.size()), lse.heads, lse.rows, stream_),
           "lse merge");
    }
    for (size_t i = 0; i < parts.size(); ++i)
      cuda(launch_o_accumulate(static_cast<float*>(o.data()), parts[i].o->data(), parts[i].o->elem,
                               parts[i].lse->data(), lse.data(), rows_ptr(idx[i]),
                               static_cast<int64_t>(parts[i].rows.size()), o.heads, o.dim, lse.rows, stream_),
           "O accumulate");
    finalize(o);
  }
  void finalize(Tensor& x) {
    if (x.elem == storage_) return;
    DeviceTensor out = alloc(x.rows, x.heads, x.dim, storage_);
    cuda(launch_convert(out.data(), storage_, x.data(), x.elem, x.count(), stream_), "convert");
    x = std::move(out);
  }

  void exchange(const std::vector<sim::Outgoing<DeviceRankBackend>>& sends,
                const std::vector<sim::Incoming<DeviceRankBackend>>& recvs) {
    std::vector<SendTo> s;
    std::vector<RecvFrom> r;
    for (const auto& x : sends)
      s.push_back(x.tensor ? SendTo{x.peer, x.tensor->data(), x.tensor->bytes()}
                           : SendTo{x.peer, x.lse->data(), x.lse->bytes()});
    for (const auto& x : recvs)
      r.push_back(x.tensor ? RecvFrom{x.peer, x.tensor->data(), x.tensor->bytes()}
                           : RecvFrom{x.peer, x.lse->data(), x.lse->bytes()});
    comm_.send_recv(s, r);
  }

  void record_forward(int step, const Forward& res) {
    if (options_.record_trace) trace.forward.push_back({rank_, step, to_host(res.o), to_host(res.lse)});
  }
  void record_backward(int step, Backward&& res, const Tensor* dk_in_flight, const Tensor* dv_in_flight) {
    if (!options_.record_trace) return;
    sim::BackwardStepTrace<float> rec{rank_, step, to_host(res.dq), to_host(res.dk), to_host(res.dv), {}, {}};
    if (dk_in_flight) rec.dk_in_flight = to_host(*dk_in_flight);
    if (dv_in_flight) rec.dv_in_flight = to_host(*dv_in_flight);
    trace.backward.push_back(std::move(rec));
  }

  // Device -> host float (values of the element type); synchronises the rank's stream.
  Tensor3<float> to_host(const Tensor& x) {
    Tensor3<float> out(x.rows, x.heads, x.dim);
    if (x.count() == 0) return out;
    DeviceTensor f = x;
    if (x.elem != Elem::f32) {
      f = alloc(x.rows, x.heads, x.dim, Elem::f32);
      cuda(launch_convert(f.data(), Elem::f32, x.data(), x.elem, x.count(), stream_), "convert");
    }
    cuda(cudaMemcpyAsync(out.values.data(), f.data(), f.bytes(), cudaMemcpyDeviceToHost, stream_), "download");
    cuda(cudaStreamSynchronize(stream_), "download");
    return out;
  }
  LseTensor<float> to_host(const Lse& x) {
    LseTensor<float> out(x.heads, x.rows, 0.0f);
    if (x.count() == 0) return out;
    cuda(cudaMemcpyAsync(out.values.data(), x.data(), x.bytes(), cudaMemcpyDeviceToHost, stream_), "download");
    cuda(cudaStreamSynchronize(stream_), "download");
    return out;
  }

  sim::Trace<float> trace;

 private:
  std::shared_ptr<DeviceMemory> raw(size_t bytes) {
    auto m = std::make_shared<DeviceMemory>();
    m->stream = stream_;
    cuda(cudaMallocAsync(&m->ptr, std::max<size_t>(bytes, 16), stream_), "cudaMallocAsync");
    return m;
  }
  DeviceTensor alloc(int64_t rows, int64_t heads, int64_t dim, Elem elem) {
    DeviceTensor t;
    t.rows = rows;
    t.heads = heads;
    t.dim = dim;
    t.elem = elem;
    t.mem = raw(t.bytes());
    return t;
  }
  std::shared_ptr<DeviceMemory> upload_rows(const std::vector<int64_t>& rows) {
    auto m = raw(rows.size() * sizeof(int64_t));
    if (!rows.empty())
      cuda(cudaMemcpyAsync(m->ptr, rows.data(), rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
           "row index upload");
    // From pageable memory cudaMemcpyAsync returns once the source is staged: `rows` may die right after.
    return m;
  }
  static const int64_t* rows_ptr(const std::shared_ptr<DeviceMemory>& m) { return static_cast<const int64_t*>(m->ptr); }

  const AttentionPlan& plan_for(const sim::Tile& t, const Tensor& q, const Tensor& k, const Tensor& v) {
    auto it = plans_.find(&t);
    if (it != plans_.end()) return it->second;
    AttentionShape shape{dtype_, static_cast<int>(q.heads), static_cast<int>(k.heads), static_cast<int>(q.dim),
                         static_cast<int>(v.dim)};
    AttentionPlan plan;
    const Outcome built = plan.build(t.call, shape);
    if (!built.ok()) fail_step(t, "AttentionPlan::build", built);
    return plans_.emplace(&t, std::move(plan)).first->second;
  }
  void corrupt(const sim::Tile& t, DeviceTensor& o) {
    for (const SequenceTile& s : t.call.sequences)
      for (const RowSegment& seg : s.q)
        if (seg.count > 0) {
          const size_t row_elems = static_cast<size_t>(o.heads * o.dim);
          cuda(launch_add_one(o.data(), o.elem, static_cast<size_t>(seg.first_row) * row_elems, row_elems, stream_),
               "inject");
          return;
        }
  }
  [[noreturn]] void fail_step(const sim::Tile& t, const char* what, const Outcome& out) const {
    throw std::runtime_error("rank " + std::to_string(rank_) + " step " + std::to_string(t.step) + " " + what + ": " +
                             std::string(status_name(out.status)) + ": " + out.message);
  }
  void cuda(cudaError_t e, const char* what) const {
    if (e != cudaSuccess)
      throw std::runtime_error("rank " + std::to_string(rank_) + " " + what + ": " + cudaGetErrorString(e));
  }

  int rank_;
  Communicator& comm_;
  DType dtype_;
  Elem storage_;
  CpGpuOptions options_;
  cudaStream_t stream_;
  std::map<int, DeviceTensor> inputs_;
  std::map<const sim::Tile*, AttentionPlan> plans_;
};

}  // namespace

sim::RankOutputs<float> run_cp_rank(const sim::Plan& plan, const sim::CaseInputs& inputs, int rank, Communicator& comm,
                                    DType dtype, const CpGpuOptions& options) {
  if (const Outcome cap = cp_capability(plan, dtype, inputs); !cap.ok())
    throw std::invalid_argument("GPU CP: " + std::string(status_name(cap.status)) + ": " + cap.message);
  if (comm.size() != plan.cp_size || comm.rank() != rank)
    throw std::invalid_argument("GPU CP: rank " + std::to_string(rank) + " of cp_size " + std::to_string(plan.cp_size) +
                                " runs on communicator rank " + std::to_string(comm.rank()) + " of " +
                                std::to_string(comm.size()));
  DeviceRankBackend b(rank, comm, dtype, options);
  b.upload_input(sim::Payload::q, sim::shard_rows(plan.partition.q, rank, inputs.q));
  b.upload_input(sim::Payload::k, sim::shard_rows(plan.partition.kv, rank, inputs.k));
  b.upload_input(sim::Payload::v, sim::shard_rows(plan.partition.kv, rank, inputs.v));
  b.upload_input(sim::Payload::dout, sim::shard_rows(plan.partition.q, rank, inputs.dout));
  sim::RankResult<DeviceRankBackend> r = sim::run_rank(plan, b, options.backward);
  sim::RankOutputs<float> out;
  out.o = b.to_host(r.o);
  out.lse = b.to_host(r.lse);
  if (options.backward) {
    out.dq = b.to_host(r.dq);
    out.dk = b.to_host(r.dk);
    out.dv = b.to_host(r.dv);
  }
  comm.synchronize();
  return out;
}

}  // namespace cpgold::gpu
