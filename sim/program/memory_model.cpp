#include "sim/program/memory_model.hpp"

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <vector>

#include "sim/program/cp_program.hpp"

namespace cpgold::sim {

namespace {

// Live and peak bytes of one rank's program.
struct Counter {
  double live = 0, peak = 0;
  void add(double bytes) {
    live += bytes;
    peak = std::max(peak, live);
  }
};

// A tensor that is only a shape: constructing, copying and destroying it count its bytes, as a Tensor3 would allocate
// and free them; moving hands them over.
class CountedBytes {
 public:
  CountedBytes() = default;
  CountedBytes(Counter* counter, double bytes) : counter_(counter), bytes_(bytes) {
    if (counter_) counter_->add(bytes_);
  }
  CountedBytes(const CountedBytes& other) : CountedBytes(other.counter_, other.bytes_) {}
  CountedBytes(CountedBytes&& other) noexcept : counter_(other.counter_), bytes_(other.bytes_) { other.counter_ = nullptr; }
  CountedBytes& operator=(const CountedBytes& other) {
    if (this != &other) *this = CountedBytes(other);
    return *this;
  }
  CountedBytes& operator=(CountedBytes&& other) noexcept {
    if (this != &other) {
      release();
      counter_ = other.counter_;
      bytes_ = other.bytes_;
      other.counter_ = nullptr;
    }
    return *this;
  }
  ~CountedBytes() { release(); }

 private:
  void release() {
    if (counter_) counter_->live -= bytes_;
    counter_ = nullptr;
  }
  Counter* counter_ = nullptr;
  double bytes_ = 0;
};

struct ShapeTensor {
  int64_t rows = 0, heads = 0, dim = 0;
  CountedBytes bytes;
};
struct ShapeLse {
  int64_t heads = 0, rows = 0;
  CountedBytes bytes;
};

class CountingBackend {
 public:
  using Tensor = ShapeTensor;
  using Lse = ShapeLse;
  struct Forward {
    Tensor o;
    Lse lse;
  };
  struct Backward {
    Tensor dq, dk, dv;
  };
  struct Pending {};

  CountingBackend(int rank, const Plan& plan, int dim_qk, int dim_v, int element_bytes, bool record_trace,
                  Counter& counter, Counter& shards, Counter& trace)
      : rank_(rank), element_bytes_(element_bytes), record_trace_(record_trace), counter_(counter), trace_(trace) {
    const int64_t lq = plan.partition.q.local_rows(), lkv = plan.partition.kv.local_rows();
    inputs_[0] = make(lq, plan.heads_q, dim_qk, &shards);
    inputs_[1] = make(lkv, plan.heads_kv, dim_qk, &shards);
    inputs_[2] = make(lkv, plan.heads_kv, dim_v, &shards);
    inputs_[3] = make(lq, plan.heads_q, dim_v, &shards);
  }

  int rank() const { return rank_; }
  const Tensor& input(Payload payload) const {
    switch (payload) {
      case Payload::q: return inputs_[0];
      case Payload::k: return inputs_[1];
      case Payload::v: return inputs_[2];
      case Payload::dout: return inputs_[3];
      default: program_error("no input shard for payload " + std::string(payload_name(payload)));
    }
  }
  Tensor zeros(int64_t rows, int64_t heads, int64_t dim, BufferKind) const { return make(rows, heads, dim); }
  Lse lse_empty(int64_t heads, int64_t rows) const { return make_lse(heads, rows); }
  Shape shape(const Tensor& x) const { return {x.rows, x.heads, x.dim}; }
  Tensor gather(const Tensor& x, const std::vector<int64_t>& rows, int h0, int h1) const {
    return make(static_cast<int64_t>(rows.size()), h1 - h0, x.dim);
  }
  void scatter(Tensor&, const std::vector<int64_t>&, int, const Tensor&) const {}
  void scatter_add(Tensor&, const std::vector<int64_t>&, const Tensor&) const {}
  Lse lse_gather(const Lse& x, const std::vector<int64_t>& rows) const {
    return make_lse(x.heads, static_cast<int64_t>(rows.size()));
  }
  void lse_scatter(Lse&, const std::vector<int64_t>&, int, const Lse&) const {}
  // The attention's results (what reference/attention.cpp allocates and returns).
  Forward forward(const Tile&, const Tensor& q, const Tensor&, const Tensor& v) const {
    return {make(q.rows, q.heads, v.dim), make_lse(q.heads, q.rows)};
  }
  Backward backward(const Tile&, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Lse&,
                    const Tensor&) const {
    return {make(q.rows, q.heads, q.dim), make(k.rows, k.heads, k.dim), make(v.rows, v.heads, v.dim)};
  }
  void merge_forward(const std::vector<MergePart<CountingBackend>>&, Tensor&, Lse&) const {}
  void finalize(Tensor&) const {}
  void exchange(const std::vector<Outgoing<CountingBackend>>&, const std::vector<Incoming<CountingBackend>>&) {}
  Pending exchange_start(const std::vector<Outgoing<CountingBackend>>&, const std::vector<Incoming<CountingBackend>>&) {
    return {};
  }
  void exchange_finish(Pending&) {}
  // With trace the simulator keeps a copy of every step's results (sim::Trace).
  void record_forward(int, const Forward& res) {
    if (!record_trace_) return;
    kept_.push_back(make(res.o.rows, res.o.heads, res.o.dim, &trace_));
    kept_.push_back(make(res.lse.rows, res.lse.heads, 1, &trace_));
  }
  void record_backward(int, Backward&& res, const Tensor* dk_in_flight, const Tensor* dv_in_flight) {
    if (!record_trace_) return;
    for (const Tensor* t : std::initializer_list<const Tensor*>{&res.dq, &res.dk, &res.dv, dk_in_flight, dv_in_flight})
      if (t) kept_.push_back(make(t->rows, t->heads, t->dim, &trace_));
  }

 private:
  Tensor make(int64_t rows, int64_t heads, int64_t dim, Counter* counter = nullptr) const {
    return {rows, heads, dim, CountedBytes(counter ? counter : &counter_, double(rows) * double(heads) * double(dim) * element_bytes_)};
  }
  Lse make_lse(int64_t heads, int64_t rows) const {
    return {heads, rows, CountedBytes(&counter_, double(heads) * double(rows) * element_bytes_)};
  }

  int rank_;
  int element_bytes_;
  bool record_trace_;
  Counter& counter_;
  Counter& trace_;
  Tensor inputs_[4];
  std::vector<Tensor> kept_;
};

}  // namespace

CpMemory cp_memory(const Plan& plan, int dim_qk, int dim_v, int element_bytes, bool record_trace, bool backward) {
  CpMemory memory;
  for (int r = 0; r < plan.cp_size; ++r) {
    Counter program, shards, trace;
    double outputs = 0;
    {
      CountingBackend b(r, plan, dim_qk, dim_v, element_bytes, record_trace, program, shards, trace);
      RankResult<CountingBackend> result = run_rank(plan, b, backward);
      for (const ShapeTensor* t : {&result.o, &result.dq, &result.dk, &result.dv})
        outputs += double(t->rows) * double(t->heads) * double(t->dim) * element_bytes;
      outputs += double(result.lse.heads) * double(result.lse.rows) * element_bytes;
    }
    memory.shards += shards.peak;
    memory.program += program.peak;
    memory.outputs += outputs;
    memory.trace += trace.peak;
  }
  return memory;
}

}  // namespace cpgold::sim
