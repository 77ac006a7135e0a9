// Golden vectors of docs/cp-layout.md, "Worked example" and "TE test configurations" (partitioned indices, exact
// counts, reorders on coded values).
#include <doctest/doctest.h>

#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/plan/partition.hpp"
#include "sim/thd_helpers/reorder.hpp"
#include "tests/reference/input_error_check.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::testing;

namespace {
PackedSequences side(std::vector<int32_t> lengths, std::vector<int32_t> padded) {
  return make_packed_sequences(lengths, padded, -1, "q");
}
}  // namespace

TEST_CASE("partitioned indices for cuP=[0,8,16], W=2 (cp-semantics §2.4, §8)") {
  const SidePartition p(side({5, 8}, {8, 8}), 2, "q");
  CHECK(p.gather_indices(0) == std::vector<int64_t>{0, 1, 6, 7, 8, 9, 14, 15});
  CHECK(p.gather_indices(1) == std::vector<int64_t>{2, 3, 4, 5, 10, 11, 12, 13});
  CHECK(p.local_padded() == std::vector<int32_t>{0, 4, 8});
  CHECK(p.half_padded() == std::vector<int32_t>{0, 2, 4});
  CHECK(p.cu_seqlens_on_rank(0, true, true) == std::vector<int32_t>{0, 2, 6});
  CHECK(p.cu_seqlens_on_rank(0, true, false) == std::vector<int32_t>{0, 2, 4});
  CHECK(p.cu_seqlens_on_rank(0, false, true) == std::vector<int32_t>{0, 0, 2});
  CHECK(p.cu_seqlens_on_rank(1, true, true) == std::vector<int32_t>{0, 3, 7});
  CHECK(p.cu_seqlens_on_rank(1, true, false) == std::vector<int32_t>{0, 2, 4});
  CHECK(p.cu_seqlens_on_rank(1, false, true) == std::vector<int32_t>{0, 1, 3});
  // The cu // W shortcut differs here (cu = [0, 5, 13] -> [0, 2, 6] for both ranks): the issue 3331 class of bug.
  CHECK(p.cu_seqlens_shortcut(true, true) == std::vector<int32_t>{0, 2, 6});
  CHECK(p.cu_seqlens_shortcut(true, true) != p.cu_seqlens_on_rank(1, true, true));
  // read_half: half 0 of rank 0 is chunk 0 of each sequence (local rows 0,1 and 4,5), half 1 chunk 3 (2,3 and 6,7).
  CHECK(p.read_half_rows(0) == std::vector<int64_t>{0, 1, 4, 5});
  CHECK(p.read_half_rows(1) == std::vector<int64_t>{2, 3, 6, 7});
}

TEST_CASE("reorder for cuP=[0,8,24,40], W=4 on coded values (cp-semantics §8)") {
  const SidePartition p(side({8, 16, 16}, {8, 16, 16}), 4, "q");
  // Chunk sizes 1, 2, 2; rank r holds chunks r and 7-r of every sequence (worked out by hand from §2.1).
  const std::vector<std::vector<int64_t>> expected = {
      {0, 7, 8, 9, 22, 23, 24, 25, 38, 39},
      {1, 6, 10, 11, 20, 21, 26, 27, 36, 37},
      {2, 5, 12, 13, 18, 19, 28, 29, 34, 35},
      {3, 4, 14, 15, 16, 17, 30, 31, 32, 33}};
  // Coded values: element (row, head, x) = row * 100 + head * 10 + x.
  Tensor3<double> seq(40, 2, 3);
  for (int64_t r = 0; r < 40; ++r)
    for (int h = 0; h < 2; ++h)
      for (int x = 0; x < 3; ++x) seq(r, h, x) = r * 100 + h * 10 + x;
  const Tensor3<double> ranked = sequence_to_rank_order(seq, p);
  for (int r = 0; r < 4; ++r) {
    CHECK(p.gather_indices(r) == expected[r]);
    for (int i = 0; i < 10; ++i)
      for (int h = 0; h < 2; ++h)
        for (int x = 0; x < 3; ++x)
          CHECK(ranked(r * 10 + i, h, x) == expected[r][i] * 100 + h * 10 + x);
  }
  // The other direction on rank-order coded values: every element lands on the global row it encodes.
  Tensor3<double> coded(40, 2, 3);
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 10; ++i)
      for (int h = 0; h < 2; ++h)
        for (int x = 0; x < 3; ++x) coded(r * 10 + i, h, x) = expected[r][i] * 100 + h * 10 + x;
  const Tensor3<double> back = rank_to_sequence_order(coded, p);
  for (int64_t row = 0; row < 40; ++row) CHECK(back(row, 1, 2) == row * 100 + 12);
  CHECK(back.values == seq.values);
}

TEST_CASE("read_half on coded values, W=2") {
  const SidePartition p(side({5, 8}, {8, 8}), 2, "q");
  Tensor3<float> local(8, 1, 1);
  const auto idx = p.gather_indices(1);  // [2,3,4,5,10,11,12,13]
  for (int i = 0; i < 8; ++i) local(i, 0, 0) = static_cast<float>(idx[i]);
  const auto h0 = read_half(local, p, 0), h1 = read_half(local, p, 1);
  CHECK(h0.values == std::vector<float>{2, 3, 10, 11});
  CHECK(h1.values == std::vector<float>{4, 5, 12, 13});
}

TEST_CASE("exact counts equal cu // W without padding") {
  const SidePartition p(side({8, 12, 4}, {8, 12, 4}), 2, "q");
  for (int r = 0; r < 2; ++r) {
    CHECK(p.cu_seqlens_on_rank(r, true, true) == p.cu_seqlens_shortcut(true, true));
    CHECK(p.cu_seqlens_on_rank(r, true, false) == p.cu_seqlens_shortcut(true, false));
  }
}

TEST_CASE("zero-length sequences and tail rows") {
  // L = 0 with PL = 0, then L = 3 padded to 4; 4 tail rows split 2 per rank.
  const SidePartition p(make_packed_sequences({0, 3}, {0, 4}, 8, "q"), 2, "q");
  CHECK(p.local_rows() == 4);
  CHECK(p.gather_indices(0) == std::vector<int64_t>{0, 3, 4, 5});
  CHECK(p.gather_indices(1) == std::vector<int64_t>{1, 2, 6, 7});
  CHECK(p.sequence_of_local_row(0) == 1);
  CHECK(p.cu_seqlens_on_rank(1, true, true) == std::vector<int32_t>{0, 0, 2});
  CHECK(p.cu_seqlens_on_rank(0, true, true) == std::vector<int32_t>{0, 0, 1});
}

TEST_CASE("partition errors name the field and the value") {
  SUBCASE("padded length not a multiple of 2W") {
    check_input_error([] { SidePartition(side({5, 6}, {8, 6}), 2, "q"); }, "padded_q[1]",
                      {"6", "multiple of 2 * cp_size = 4"});
  }
  SUBCASE("W < 1") {
    ThdLayout l{side({4}, {4}), side({4}, {4})};
    check_input_error([&] { make_partition(l, 0, false); }, "cp_size", {"got 0"});
  }
  SUBCASE("causal CP with L_q != L_kv") {
    ThdLayout l{side({4, 4}, {4, 4}), make_packed_sequences({4, 3}, {4, 4}, -1, "kv")};
    CHECK_NOTHROW(make_partition(l, 2, false));
    CHECK_NOTHROW(make_partition(l, 1, true));
    check_input_error([&] { make_partition(l, 2, true); }, "seqlens_kv[1]", {"value 3"});
  }
}

TEST_CASE("pad_lengths_for_cp") {
  CHECK(pad_lengths_for_cp({0, 1, 4, 5, 8}, 2) == std::vector<int32_t>{0, 4, 4, 8, 8});
  CHECK(pad_lengths_for_cp({7}, 3) == std::vector<int32_t>{12});
  CHECK_THROWS_AS(pad_lengths_for_cp({7}, 0), InputError);
}
