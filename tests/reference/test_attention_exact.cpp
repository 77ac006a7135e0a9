// The tiled reference against an independent dense float64 implementation, and against finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "naive_attention.hpp"
#include "random_case.hpp"
#include "reference/attention.hpp"

using namespace cpgold;
using namespace cpgold::test;

namespace {

struct Config {
  int hq, hk, dqk, dv;
  Window window;
  bool same_q_kv;
  int max_len;
  const char* name;
};

void check_against_naive(const Config& c, uint64_t seed, const KernelOptions& options = {}) {
  SplitMix64 rng{seed};
  const ThdLayout layout = random_layout(rng, 5, c.max_len, c.same_q_kv, rng.below(5));
  const Tensor3<double> q = random_tensor(rng, layout.q, c.hq, c.dqk);
  const Tensor3<double> k = random_tensor(rng, layout.kv, c.hk, c.dqk);
  const Tensor3<double> v = random_tensor(rng, layout.kv, c.hk, c.dv);
  const Tensor3<double> dout = random_tensor(rng, layout.q, c.hq, c.dv);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dqk));
  const AttentionCall call = non_cp_call(layout, c.window, scale);
  const auto fwd = attention_forward(call, q, k, v, options);
  const auto bwd = attention_backward(call, q, k, v, fwd.o, fwd.lse, dout, options);
  const NaiveResult naive = naive_attention(layout, q, k, v, dout, c.window.left, c.window.right, scale);
  CAPTURE(c.name);
  CAPTURE(seed);
  CHECK(relative_error(fwd.o.values, naive.o.values) <= 1e-12);
  CHECK(relative_error(fwd.lse.values, naive.lse.values) <= 1e-12);
  CHECK(relative_error(bwd.dq.values, naive.dq.values) <= 1e-12);
  CHECK(relative_error(bwd.dk.values, naive.dk.values) <= 1e-12);
  CHECK(relative_error(bwd.dv.values, naive.dv.values) <= 1e-12);
}

const Config kConfigs[] = {
    {4, 4, 16, 16, {-1, -1}, true, 40, "MHA full"},
    {4, 4, 16, 16, {-1, 0}, true, 40, "MHA causal"},
    {6, 2, 16, 16, {-1, 0}, false, 40, "GQA causal, L_q != L_kv"},
    {4, 1, 8, 8, {-1, -1}, false, 40, "MQA full, L_q != L_kv"},
    {4, 2, 24, 16, {-1, 0}, true, 40, "MLA causal (d_qk 24, d_v 16)"},
    {4, 2, 24, 16, {5, 0}, true, 40, "MLA causal sliding window (5, 0)"},
    {2, 2, 8, 8, {3, 2}, false, 40, "window (3, 2), L_q != L_kv"},
    {2, 1, 8, 8, {7, -1}, true, 40, "window (7, -1)"},
    {2, 1, 8, 8, {-1, 4}, false, 40, "window (-1, 4)"},
    {2, 2, 8, 8, {500, 500}, true, 40, "window wider than the sequence"},
    {2, 2, 8, 8, {500, 0}, false, 40, "causal window wider than the sequence"},
    {2, 2, 8, 8, {0, 0}, true, 40, "window (0, 0): the diagonal only"},
    {3, 3, 8, 4, {-1, 0}, false, 150, "causal, L_q != L_kv, several row blocks"},
};

}  // namespace

TEST_CASE("tiled reference equals the dense float64 implementation to 1e-12") {
  uint64_t seed = 1;
  for (const Config& c : kConfigs)
    for (int rep = 0; rep < 3; ++rep) check_against_naive(c, seed++);
}

TEST_CASE("tile size and scale placement do not change the float64 result beyond rounding") {
  KernelOptions small_tiles;
  small_tiles.row_block = 7;
  KernelOptions scaled_k;
  scaled_k.scale_on_k = true;
  scaled_k.row_block = 16;
  uint64_t seed = 100;
  for (const Config& c : kConfigs) {
    check_against_naive(c, seed++, small_tiles);
    check_against_naive(c, seed++, scaled_k);
  }
}

TEST_CASE("gradients match central finite differences in float64") {
  SplitMix64 rng{7};
  for (Window window : {Window{-1, -1}, Window{-1, 0}, Window{3, 1}}) {
    ThdLayout layout;  // a zero-length sequence, padding between sequences and tail rows
    layout.q = make_packed_sequences({5, 0, 7}, {6, 1, 8}, 17, "q");
    layout.kv = make_packed_sequences({6, 0, 7}, {6, 2, 9}, 19, "kv");
    const int hq = 4, hk = 2, dqk = 6, dv = 5;
    Tensor3<double> q = random_tensor(rng, layout.q, hq, dqk);
    Tensor3<double> k = random_tensor(rng, layout.kv, hk, dqk);
    Tensor3<double> v = random_tensor(rng, layout.kv, hk, dv);
    const Tensor3<double> dout = random_tensor(rng, layout.q, hq, dv);
    const AttentionCall call = non_cp_call(layout, window, 0.37);
    // loss = sum(dout * O)
    auto loss = [&] {
      const auto f = attention_forward(call, q, k, v);
      double l = 0;
      for (size_t i = 0; i < f.o.values.size(); ++i) l += f.o.values[i] * dout.values[i];
      return l;
    };
    const auto fwd = attention_forward(call, q, k, v);
    const auto grads = attention_backward(call, q, k, v, fwd.o, fwd.lse, dout);
    const double h = 1e-6;
    int checked = 0;
    auto probe = [&](Tensor3<double>& x, const Tensor3<double>& grad, const PackedSequences& seqs, const char* name) {
      for (int64_t r = 0; r < x.rows; ++r) {
        if (!seqs.is_valid_row(r)) continue;
        for (int64_t e = 0; e < x.heads * x.dim; e += 3) {
          double& value = x.values[r * x.heads * x.dim + e];
          const double saved = value;
          value = saved + h;
          const double up = loss();
          value = saved - h;
          const double down = loss();
          value = saved;
          const double numeric = (up - down) / (2 * h);
          CAPTURE(name);
          CAPTURE(r);
          CAPTURE(e);
          CHECK(grad.values[r * x.heads * x.dim + e] == doctest::Approx(numeric).epsilon(1e-6).scale(1.0));
          ++checked;
        }
      }
    };
    probe(q, grads.dq, layout.q, "dq");
    probe(k, grads.dk, layout.kv, "dk");
    probe(v, grads.dv, layout.kv, "dv");
    CHECK(checked > 20);
  }
}
