// Progress reporting: the kernels tell a sink about every score tile, from any thread, and nothing else changes.
#include <doctest/doctest.h>

#include <atomic>

#include "reference/attention.hpp"
#include "tests/reference/random_case.hpp"

using namespace cpgold;

namespace {
class CountingSink final : public ProgressSink {
 public:
  void advance(int64_t score_elements) override {
    calls += 1;
    elements += score_elements;
  }
  std::atomic<int64_t> calls{0}, elements{0};
};
}  // namespace

TEST_CASE("progress: every score tile is reported (forward, dQ and dK/dV passes) and results do not change") {
  const int64_t length = 150, heads = 3, dim = 16;
  ThdLayout layout;
  layout.q = make_packed_sequences({static_cast<int32_t>(length)}, {static_cast<int32_t>(length)}, -1, "q");
  layout.kv = layout.q;
  const AttentionCall call = non_cp_call(layout, Window{-1, -1}, 0.25);
  test::SplitMix64 rng{7};
  auto random = [&](int64_t rows) {
    Tensor3<float> t(rows, heads, dim);
    for (float& x : t.values) x = static_cast<float>(rng.uniform() - 0.5);
    return t;
  };
  const Tensor3<float> q = random(length), k = random(length), v = random(length), dout = random(length);
  CountingSink sink;
  KernelOptions with_progress;
  with_progress.progress = &sink;
  const auto plain = attention_forward(call, q, k, v, DType::fp32);
  const auto reported = attention_forward(call, q, k, v, DType::fp32, with_progress);
  CHECK(plain.o.values == reported.o.values);
  CHECK(plain.lse.values == reported.lse.values);
  // No mask: each query row block sees every key, so the forward pass reports exactly L x L per head.
  CHECK(sink.elements.load() == heads * length * length);
  CHECK(sink.calls.load() == heads * ((length + 63) / 64));
  sink.elements = 0;
  const auto backward_plain = attention_backward(call, q, k, v, plain.o, plain.lse, dout, DType::fp32);
  const auto backward = attention_backward(call, q, k, v, plain.o, plain.lse, dout, DType::fp32, with_progress);
  CHECK(backward_plain.dq.values == backward.dq.values);
  CHECK(backward_plain.dk.values == backward.dk.values);
  CHECK(sink.elements.load() == 2 * heads * length * length);  // dQ tiles and dK/dV tiles
}
