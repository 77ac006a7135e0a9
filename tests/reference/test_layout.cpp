// Layout validation: every violation names the field, the index and the values.
#include <doctest/doctest.h>

#include <string>

#include "reference/input_error.hpp"
#include "reference/mask.hpp"
#include "reference/thd_layout.hpp"

using namespace cpgold;

namespace {
// Runs f, expects an InputError, returns its message.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("no InputError thrown");
  return {};
}

PackedSequences side(std::vector<int32_t> cu, std::vector<int32_t> cup, int64_t total) {
  PackedSequences s;
  s.cu_seqlens = std::move(cu);
  s.cu_seqlens_padded = std::move(cup);
  s.total_rows = total;
  return s;
}
}  // namespace

TEST_CASE("a valid layout passes and classifies rows") {
  const PackedSequences s = side({0, 5, 5, 13}, {0, 8, 8, 16}, 20);
  CHECK_NOTHROW(s.validate("q"));
  CHECK(s.batch() == 3);
  CHECK(s.is_valid_row(4));
  CHECK_FALSE(s.is_valid_row(5));  // padding of sequence 0
  CHECK(s.is_valid_row(8));        // sequence 2 (sequence 1 is empty)
  CHECK(s.is_valid_row(15));
  CHECK_FALSE(s.is_valid_row(16));  // tail row
  CHECK_FALSE(s.is_valid_row(19));
}

TEST_CASE("first entries must be zero") {
  const std::string m = error_of([] { side({3, 5}, {0, 8}, 8).validate("q"); });
  CHECK(m.find("cu_seqlens_q[0]") != std::string::npos);
  CHECK(m.find("got 3") != std::string::npos);
  const std::string mp = error_of([] { side({0, 5}, {2, 8}, 8).validate("kv"); });
  CHECK(mp.find("cu_seqlens_kv_padded[0]") != std::string::npos);
  CHECK(mp.find("got 2") != std::string::npos);
}

TEST_CASE("cu_seqlens must be non-decreasing") {
  const std::string m = error_of([] { side({0, 5, 3}, {0, 8, 16}, 16).validate("q"); });
  CHECK(m.find("cu_seqlens_q[2]") != std::string::npos);
  CHECK(m.find("value 3") != std::string::npos);
  CHECK(m.find("= 5") != std::string::npos);
  const std::string mp = error_of([] { side({0, 2, 3}, {0, 8, 6}, 16).validate("q"); });
  CHECK(mp.find("cu_seqlens_q_padded[2]") != std::string::npos);
  CHECK(mp.find("value 6") != std::string::npos);
}

TEST_CASE("actual length above padded length") {
  const std::string m = error_of([] { side({0, 5, 14}, {0, 8, 16}, 16).validate("kv"); });
  CHECK(m.find("cu_seqlens_kv[2]") != std::string::npos);
  CHECK(m.find("actual length 9") != std::string::npos);
  CHECK(m.find("padded length 8") != std::string::npos);
}

TEST_CASE("sizes of cu_seqlens and cu_seqlens_padded must agree") {
  const std::string m = error_of([] { side({0, 5, 9}, {0, 8}, 16).validate("q"); });
  CHECK(m.find("cu_seqlens_q_padded") != std::string::npos);
  CHECK(m.find("2 entries") != std::string::npos);
  const std::string e = error_of([] { side({}, {}, 0).validate("q"); });
  CHECK(e.find("cu_seqlens_q") != std::string::npos);
}

TEST_CASE("offsets must fit the tensor and the int32 range") {
  const std::string m = error_of([] { side({0, 5}, {0, 8}, 6).validate("q"); });
  CHECK(m.find("total_tokens_q") != std::string::npos);
  CHECK(m.find("value 6") != std::string::npos);
  CHECK(m.find("= 8") != std::string::npos);
  const std::string big = error_of([] { side({0, 5}, {0, 8}, 3000000000LL).validate("kv"); });
  CHECK(big.find("total_tokens_kv") != std::string::npos);
  CHECK(big.find("3000000000") != std::string::npos);
  const std::string neg = error_of([] { side({0, 0}, {0, 0}, -1).validate("q"); });
  CHECK(neg.find("total_tokens_q") != std::string::npos);
}

TEST_CASE("q and kv must describe the same number of sequences") {
  ThdLayout layout;
  layout.q = side({0, 5, 9}, {0, 8, 16}, 16);
  layout.kv = side({0, 5}, {0, 8}, 8);
  const std::string m = error_of([&] { layout.validate(); });
  CHECK(m.find("cu_seqlens_kv") != std::string::npos);
  CHECK(m.find("1 sequences") != std::string::npos);
  CHECK(m.find("2") != std::string::npos);
}

TEST_CASE("layouts built from lengths") {
  const PackedSequences s = make_packed_sequences({5, 0, 8}, {8, 0, 8}, 20, "q");
  CHECK(s.cu_seqlens == std::vector<int32_t>{0, 5, 5, 13});
  CHECK(s.cu_seqlens_padded == std::vector<int32_t>{0, 8, 8, 16});
  CHECK(s.total_rows == 20);
  CHECK(make_packed_sequences({3, 4}, {}, -1, "kv").total_rows == 7);
  const std::string m = error_of([] { make_packed_sequences({5, 8}, {8, 6}, -1, "q"); });
  CHECK(m.find("padded_q[1]") != std::string::npos);
  CHECK(m.find("value 6") != std::string::npos);
  const std::string n = error_of([] { make_packed_sequences({5, -2}, {}, -1, "kv"); });
  CHECK(n.find("seqlens_kv[1]") != std::string::npos);
  CHECK(n.find("-2") != std::string::npos);
  const std::string c = error_of([] { make_packed_sequences({5, 8}, {8}, -1, "q"); });
  CHECK(c.find("padded_q") != std::string::npos);
  const std::string t = error_of([] { make_packed_sequences({5, 8}, {8, 8}, 10, "q"); });
  CHECK(t.find("total_tokens_q") != std::string::npos);
}

TEST_CASE("window values below -1 are rejected") {
  const std::string m = error_of([] { normalize_window(false, {-3, 0}); });
  CHECK(m.find("window[0]") != std::string::npos);
  CHECK(m.find("-3") != std::string::npos);
  const std::string r = error_of([] { normalize_window(true, {4, -7}); });
  CHECK(r.find("window[1]") != std::string::npos);
  CHECK(r.find("-7") != std::string::npos);
}
