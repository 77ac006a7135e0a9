// Pad rows, empty rows, thread-count determinism and the size of the peer's rounding error.
#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "random_case.hpp"
#include "reference/attention.hpp"

using namespace cpgold;
using namespace cpgold::test;

namespace {

Tensor3<float> to_dtype(const Tensor3<double>& x, DType dtype) {
  Tensor3<float> y(x.rows, x.heads, x.dim);
  for (size_t i = 0; i < x.values.size(); ++i) y.values[i] = round_to(dtype, x.values[i]);
  return y;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
void check_pad_rows_zero(const Tensor3<T>& x, const PackedSequences& seqs) {
  for (int64_t r = 0; r < x.rows; ++r) {
    if (seqs.is_valid_row(r)) continue;
    for (int64_t i = 0; i < x.heads * x.dim; ++i) {
      CAPTURE(r);
      REQUIRE(x.values[r * x.heads * x.dim + i] == T(0));
      REQUIRE_FALSE(std::signbit(x.values[r * x.heads * x.dim + i]));
    }
  }
}

struct Inputs {
  ThdLayout layout;
  Tensor3<double> q, k, v, dout;
};

Inputs make_inputs(uint64_t seed, double pad, int hq = 4, int hk = 2, int d = 16, int max_len = 70) {
  SplitMix64 rng{seed};
  Inputs in;
  in.layout = random_layout(rng, 6, max_len, true, 3);
  in.q = random_tensor(rng, in.layout.q, hq, d, pad);
  in.k = random_tensor(rng, in.layout.kv, hk, d, pad);
  in.v = random_tensor(rng, in.layout.kv, hk, d, pad);
  in.dout = random_tensor(rng, in.layout.q, hq, d, pad);
  return in;
}

}  // namespace

TEST_CASE("NaN, Inf and huge values in pad rows change nothing") {
  const double poisons[] = {std::nan(""), std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(), 1e300};
  for (Window window : {Window{-1, -1}, Window{-1, 0}, Window{9, 3}}) {
    const Inputs clean = make_inputs(11, 0.0);
    const AttentionCall call = non_cp_call(clean.layout, window, 0.25);
    const auto f0 = attention_forward(call, clean.q, clean.k, clean.v);
    const auto b0 = attention_backward(call, clean.q, clean.k, clean.v, f0.o, f0.lse, clean.dout);
    const auto pf0 = attention_forward(call, to_dtype(clean.q, DType::bf16), to_dtype(clean.k, DType::bf16),
                                       to_dtype(clean.v, DType::bf16), DType::bf16);
    for (double poison : poisons) {
      CAPTURE(poison);
      const Inputs bad = make_inputs(11, poison);
      const auto f = attention_forward(call, bad.q, bad.k, bad.v);
      // O rows at pads hold 0 in both; the backward reads O only at valid rows, so poison O's pads as well.
      Tensor3<double> o_poisoned = f.o;
      for (int64_t r = 0; r < o_poisoned.rows; ++r)
        if (!bad.layout.q.is_valid_row(r))
          for (int64_t i = 0; i < o_poisoned.heads * o_poisoned.dim; ++i)
            o_poisoned.values[r * o_poisoned.heads * o_poisoned.dim + i] = poison;
      const auto b = attention_backward(call, bad.q, bad.k, bad.v, o_poisoned, f.lse, bad.dout);
      CHECK(bitwise_equal(f.o.values, f0.o.values));
      CHECK(bitwise_equal(f.lse.values, f0.lse.values));
      CHECK(bitwise_equal(b.dq.values, b0.dq.values));
      CHECK(bitwise_equal(b.dk.values, b0.dk.values));
      CHECK(bitwise_equal(b.dv.values, b0.dv.values));
      check_pad_rows_zero(f.o, bad.layout.q);
      check_pad_rows_zero(b.dq, bad.layout.q);
      check_pad_rows_zero(b.dk, bad.layout.kv);
      check_pad_rows_zero(b.dv, bad.layout.kv);
      const auto pf = attention_forward(call, to_dtype(bad.q, DType::bf16), to_dtype(bad.k, DType::bf16),
                                        to_dtype(bad.v, DType::bf16), DType::bf16);
      CHECK(bitwise_equal(pf.o.values, pf0.o.values));
      CHECK(bitwise_equal(pf.lse.values, pf0.lse.values));
    }
  }
}

TEST_CASE("rows with no visible key give O = 0 and LSE = -inf") {
  // Causal with L_q = 6 > L_kv = 2: rows 0..3 see nothing (bottom-right). A window that misses every key too.
  ThdLayout layout;
  layout.q = make_packed_sequences({6, 3}, {8, 3}, -1, "q");
  layout.kv = make_packed_sequences({2, 0}, {4, 1}, -1, "kv");
  SplitMix64 rng{5};
  const Tensor3<double> q = random_tensor(rng, layout.q, 2, 8);
  const Tensor3<double> k = random_tensor(rng, layout.kv, 1, 8);
  const Tensor3<double> v = random_tensor(rng, layout.kv, 1, 8);
  const auto f = attention_forward(non_cp_call(layout, Window{-1, 0}, 0.5), q, k, v);
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < 4; ++r) {
      CHECK(f.lse(h, r) == ninf);
      for (int x = 0; x < 8; ++x) CHECK(f.o(r, h, x) == 0.0);
    }
    CHECK(std::isfinite(f.lse(h, 4)));
    CHECK(std::isfinite(f.lse(h, 5)));
    for (int r = 8; r < 11; ++r) CHECK(f.lse(h, r) == ninf);  // sequence 1 has no keys at all
  }
  // A window of (0, 0) with L_q = L_kv + 3 (delta = -3): the diagonal of rows 0..2 falls before key 0.
  layout.q = make_packed_sequences({5}, {}, -1, "q");
  layout.kv = make_packed_sequences({2}, {}, -1, "kv");
  const Tensor3<double> q2 = random_tensor(rng, layout.q, 1, 4);
  const Tensor3<double> k2 = random_tensor(rng, layout.kv, 1, 4);
  const auto f2 = attention_forward(non_cp_call(layout, Window{0, 0}, 0.5), q2, k2, k2);
  for (int r = 0; r < 3; ++r) CHECK(f2.lse(0, r) == ninf);
  CHECK(std::isfinite(f2.lse(0, 3)));
  CHECK(std::isfinite(f2.lse(0, 4)));
  const auto b2 = attention_backward(non_cp_call(layout, Window{0, 0}, 0.5), q2, k2, k2, f2.o, f2.lse, f2.o);
  for (double x : b2.dq.values) CHECK(std::isfinite(x));
}

TEST_CASE("results are bitwise identical for 1, 2 and 5 threads") {
  const Inputs in = make_inputs(21, std::nan(""), 4, 2, 32, 200);
  const AttentionCall call = non_cp_call(in.layout, Window{-1, 0}, 0.2);
  const Tensor3<float> qb = to_dtype(in.q, DType::bf16), kb = to_dtype(in.k, DType::bf16),
                       vb = to_dtype(in.v, DType::bf16), db = to_dtype(in.dout, DType::bf16);
  const int saved = omp_get_max_threads();
  struct Run {
    ForwardResult<double> f;
    BackwardResult<double> b;
    ForwardResult<float> pf;
    BackwardResult<float> pb;
  };
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    Run r;
    r.f = attention_forward(call, in.q, in.k, in.v);
    r.b = attention_backward(call, in.q, in.k, in.v, r.f.o, r.f.lse, in.dout);
    r.pf = attention_forward(call, qb, kb, vb, DType::bf16);
    r.pb = attention_backward(call, qb, kb, vb, r.pf.o, r.pf.lse, db, DType::bf16);
    return r;
  };
  const Run one = run(1);
  for (int threads : {2, 5}) {
    const Run other = run(threads);
    CAPTURE(threads);
    CHECK(bitwise_equal(one.f.o.values, other.f.o.values));
    CHECK(bitwise_equal(one.f.lse.values, other.f.lse.values));
    CHECK(bitwise_equal(one.b.dq.values, other.b.dq.values));
    CHECK(bitwise_equal(one.b.dk.values, other.b.dk.values));
    CHECK(bitwise_equal(one.b.dv.values, other.b.dv.values));
    CHECK(bitwise_equal(one.pf.o.values, other.pf.o.values));
    CHECK(bitwise_equal(one.pf.lse.values, other.pf.lse.values));
    CHECK(bitwise_equal(one.pb.dq.values, other.pb.dq.values));
    CHECK(bitwise_equal(one.pb.dk.values, other.pb.dk.values));
    CHECK(bitwise_equal(one.pb.dv.values, other.pb.dv.values));
  }
  omp_set_num_threads(saved);
}

TEST_CASE("the peer's error against the oracle is non-zero and of the dtype's order") {
  struct Expect {
    DType dtype;
    double o_low, o_high;
  };
  // Relative max error on O: bf16 has 8 significand bits (unit roundoff 3.9e-3), fp16 has 11 (4.9e-4).
  for (const Expect e : {Expect{DType::bf16, 1e-3, 3e-2}, Expect{DType::fp16, 1e-4, 4e-3}}) {
    CAPTURE(dtype_name(e.dtype));
    const Inputs in = make_inputs(31, 0.0, 4, 4, 64, 300);
    Inputs stored = in;  // inputs as stored in the dtype: the oracle sees exactly the peer's values
    for (auto* x : {&stored.q, &stored.k, &stored.v, &stored.dout})
      for (double& value : x->values) value = round_to(e.dtype, value);
    const AttentionCall call = non_cp_call(in.layout, Window{-1, 0}, 0.125);
    const auto f = attention_forward(call, stored.q, stored.k, stored.v);
    const auto b = attention_backward(call, stored.q, stored.k, stored.v, f.o, f.lse, stored.dout);
    const Tensor3<float> q = to_dtype(stored.q, e.dtype), k = to_dtype(stored.k, e.dtype),
                         v = to_dtype(stored.v, e.dtype), d = to_dtype(stored.dout, e.dtype);
    const auto pf = attention_forward(call, q, k, v, e.dtype);
    const auto pb = attention_backward(call, q, k, v, pf.o, pf.lse, d, e.dtype);
    auto rel = [](const std::vector<float>& peer, const std::vector<double>& oracle) {
      std::vector<double> p(peer.begin(), peer.end());
      return relative_error(p, oracle);
    };
    const double o_err = rel(pf.o.values, f.o.values);
    MESSAGE(dtype_name(e.dtype), " peer relative errors: O ", o_err, ", dQ ", rel(pb.dq.values, b.dq.values),
            ", dK ", rel(pb.dk.values, b.dk.values), ", dV ", rel(pb.dv.values, b.dv.values));
    CHECK(o_err > e.o_low);
    CHECK(o_err < e.o_high);
    for (double g : {rel(pb.dq.values, b.dq.values), rel(pb.dk.values, b.dk.values), rel(pb.dv.values, b.dv.values)}) {
      CHECK(g > e.o_low);
      CHECK(g < 5 * e.o_high);
    }
    // LSE stays float32: absolute error at float32 level for values of order 1-10.
    double lse_err = 0;
    for (size_t i = 0; i < f.lse.values.size(); ++i) {
      if (!std::isfinite(f.lse.values[i])) {
        CHECK(pf.lse.values[i] == -std::numeric_limits<float>::infinity());
        continue;
      }
      lse_err = std::max(lse_err, std::fabs(pf.lse.values[i] - f.lse.values[i]));
    }
    MESSAGE("LSE max abs error ", lse_err);
    CHECK(lse_err > 0);
    CHECK(lse_err < 1e-5);
  }
}
