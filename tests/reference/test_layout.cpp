// Layout validation: every violation names the field, the index and the values.
#include <doctest/doctest.h>

#include <string>

#include "reference/mask.hpp"
#include "reference/thd_layout.hpp"
#include "tests/reference/input_error_check.hpp"

using namespace cpgold;
using namespace cpgold::testing;

namespace {
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
  check_input_error_says([] { side({3, 5}, {0, 8}, 8).validate("q"); }, {"cu_seqlens_q[0]", "got 3"});
  check_input_error_says([] { side({0, 5}, {2, 8}, 8).validate("kv"); }, {"cu_seqlens_kv_padded[0]", "got 2"});
}

TEST_CASE("cu_seqlens must be non-decreasing") {
  check_input_error_says([] { side({0, 5, 3}, {0, 8, 16}, 16).validate("q"); }, {"cu_seqlens_q[2]", "value 3", "= 5"});
  check_input_error_says([] { side({0, 2, 3}, {0, 8, 6}, 16).validate("q"); }, {"cu_seqlens_q_padded[2]", "value 6"});
}

TEST_CASE("actual length above padded length") {
  check_input_error_says([] { side({0, 5, 14}, {0, 8, 16}, 16).validate("kv"); },
                         {"cu_seqlens_kv[2]", "actual length 9", "padded length 8"});
}

TEST_CASE("sizes of cu_seqlens and cu_seqlens_padded must agree") {
  check_input_error_says([] { side({0, 5, 9}, {0, 8}, 16).validate("q"); }, {"cu_seqlens_q_padded", "2 entries"});
  check_input_error_says([] { side({}, {}, 0).validate("q"); }, {"cu_seqlens_q"});
}

TEST_CASE("offsets must fit the tensor and the int32 range") {
  check_input_error_says([] { side({0, 5}, {0, 8}, 6).validate("q"); }, {"total_tokens_q", "value 6", "= 8"});
  check_input_error_says([] { side({0, 5}, {0, 8}, 3000000000LL).validate("kv"); }, {"total_tokens_kv", "3000000000"});
  check_input_error_says([] { side({0, 0}, {0, 0}, -1).validate("q"); }, {"total_tokens_q"});
}

TEST_CASE("q and kv must describe the same number of sequences") {
  ThdLayout layout;
  layout.q = side({0, 5, 9}, {0, 8, 16}, 16);
  layout.kv = side({0, 5}, {0, 8}, 8);
  check_input_error_says([&] { layout.validate(); }, {"cu_seqlens_kv", "1 sequences", "2"});
}

TEST_CASE("layouts built from lengths") {
  const PackedSequences s = make_packed_sequences({5, 0, 8}, {8, 0, 8}, 20, "q");
  CHECK(s.cu_seqlens == std::vector<int32_t>{0, 5, 5, 13});
  CHECK(s.cu_seqlens_padded == std::vector<int32_t>{0, 8, 8, 16});
  CHECK(s.total_rows == 20);
  CHECK(make_packed_sequences({3, 4}, {}, -1, "kv").total_rows == 7);
  check_input_error_says([] { make_packed_sequences({5, 8}, {8, 6}, -1, "q"); }, {"padded_q[1]", "value 6"});
  check_input_error_says([] { make_packed_sequences({5, -2}, {}, -1, "kv"); }, {"seqlens_kv[1]", "-2"});
  check_input_error_says([] { make_packed_sequences({5, 8}, {8}, -1, "q"); }, {"padded_q"});
  check_input_error_says([] { make_packed_sequences({5, 8}, {8, 8}, 10, "q"); }, {"total_tokens_q"});
}

TEST_CASE("window values below -1 are rejected") {
  check_input_error_says([] { normalize_window(false, {-3, 0}); }, {"window[0]", "-3"});
  check_input_error_says([] { normalize_window(true, {4, -7}); }, {"window[1]", "-7"});
}
