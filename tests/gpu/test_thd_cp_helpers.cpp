// THD CP helper kernels (gpu/kernels/thd_helpers/thd_cp_helpers.hpp) on the device: bit-exact against their CPU twins in sim/ and,
// one way, against the expected global row ids. Coded values: every 32-bit word of a row tensor holds
// (sequence + 1, row within the sequence, word within the row), i.e. sequence, row, head and dim of the element
// (a word holds one float32 element or two 16-bit elements), so a misplaced row cannot match by accident.
// Random layouts with zero-length sequences, W in {2, 3, 4, 8}. Without a GPU: "SKIPPED: no CUDA device".
#include <doctest/doctest.h>
#include <cuda_runtime.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/kernels/attention/dtype_bits.hpp"
#include "gpu/kernels/thd_helpers/thd_cp_helpers.hpp"
#include "sim/thd_helpers/grad_correction.hpp"
#include "sim/thd_helpers/lse_halves.hpp"
#include "sim/thd_helpers/out_correction.hpp"
#include "sim/plan/partition.hpp"
#include "sim/thd_helpers/reorder.hpp"
#include "tests/gpu/require_device.hpp"
#include "tests/sim/padded_layout.hpp"

using namespace cpgold;
using namespace cpgold::gpu;
using sim::HalfSelect;

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(e));
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { cuda_ok(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

template <class W>
void put(DeviceBuffer& b, const std::vector<W>& v) {
  cuda_ok(cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(W), cudaMemcpyHostToDevice), "upload");
}
template <class W>
std::vector<W> get(const DeviceBuffer& b, size_t n) {
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  std::vector<W> v(n);
  cuda_ok(cudaMemcpy(v.data(), b.ptr, n * sizeof(W), cudaMemcpyDeviceToHost), "download");
  return v;
}

void require_ok(const Outcome& o) {
  INFO(o.message);
  REQUIRE(o.ok());
}

// ---- Layouts ------------------------------------------------------------------------------------------------------

using Layout = sim::testing::PaddedLayout;

// Random lengths 0..max (a quarter zero-length), padded to multiples of 2W as TransformerEngine's tests do, or of
// `pad_factor` * 2W (chunks of multiples of `pad_factor` rows).
Layout random_layout(std::mt19937_64& rng, int cp_size, int max_batch, int max_len, int pad_factor = 1) {
  const int batch = 1 + static_cast<int>(rng() % max_batch);
  std::vector<int32_t> lengths;
  for (int b = 0; b < batch; ++b) lengths.push_back(rng() % 4 == 0 ? 0 : static_cast<int32_t>(rng() % (max_len + 1)));
  const Layout l = sim::testing::padded_layout(cp_size, lengths, pad_factor);
  if (l.total() == 0) return random_layout(rng, cp_size, max_batch, max_len, pad_factor);
  return l;
}

// ---- Coded row tensors ---------------------------------------------------------------------------------------------

struct RowFormat {
  DType dtype;
  int heads, dim;
  int64_t words() const { return static_cast<int64_t>(heads) * dim * dtype_bytes(dtype) / 4; }
};
const RowFormat kFormats[] = {{DType::bf16, 2, 8}, {DType::fp16, 3, 8}, {DType::fp32, 1, 4}, {DType::fp32, 5, 4},
                              {DType::bf16, 9, 128}};

uint32_t code(int sequence, int64_t row_in_sequence, int64_t word) {
  return (static_cast<uint32_t>(sequence + 1) << 22) | (static_cast<uint32_t>(row_in_sequence) << 10) |
         static_cast<uint32_t>(word);
}
uint32_t code_of_global_row(const Layout& l, int64_t g, int64_t word) {
  const int s = sim::sequence_of_row(l.cu_padded, g);
  return code(s, g - l.cu_padded[s], word);
}

// [rows, 1, words] of uint32 codes; row r holds the codes of global row rows[r].
Tensor3<uint32_t> coded_rows(const Layout& l, const std::vector<int64_t>& global_rows, const RowFormat& f) {
  Tensor3<uint32_t> t(static_cast<int64_t>(global_rows.size()), 1, f.words());
  for (size_t r = 0; r < global_rows.size(); ++r)
    for (int64_t w = 0; w < f.words(); ++w) t(static_cast<int64_t>(r), 0, w) = code_of_global_row(l, global_rows[r], w);
  return t;
}

DeviceRows rows_of(DeviceBuffer& b, int64_t rows, const RowFormat& f) { return {b.ptr, rows, f.heads, f.dim, f.dtype}; }

// Global row of local row i of rank, written from §2.1 directly (not through sim) for the one-way checks.
int64_t expected_global_row(const Layout& l, int rank, int64_t i) {
  const std::vector<int32_t> cul = l.local();
  int b = 0;
  while (b + 1 < l.batch() && cul[b + 1] <= i) ++b;
  while (cul[b + 1] - cul[b] == 0 && b + 1 < l.batch()) ++b;
  const int64_t j = i - cul[b], c = l.chunk(b);
  return l.cu_padded[b] + (j < c ? rank * c + j : (2 * l.cp_size - 1 - rank) * c + (j - c));
}

std::vector<int64_t> iota_rows(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// ---- Typed tensors for the arithmetic helpers ------------------------------------------------------------------------


void put_typed(DeviceBuffer& b, const Tensor3<float>& x, DType dtype) {
  if (dtype == DType::fp32) return put(b, x.values);
  std::vector<uint16_t> bits(x.values.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_bits(dtype, x.values[i]);
  put(b, bits);
}
// Bits of the device tensor, widened to uint32 for comparison.
std::vector<uint32_t> get_bits(const DeviceBuffer& b, size_t n, DType dtype) {
  std::vector<uint32_t> out(n);
  if (dtype == DType::fp32) {
    const auto v = get<float>(b, n);
    std::memcpy(out.data(), v.data(), n * 4);
  } else {
    const auto v = get<uint16_t>(b, n);
    for (size_t i = 0; i < n; ++i) out[i] = v[i];
  }
  return out;
}
std::vector<uint32_t> host_bits(const Tensor3<float>& x, DType dtype) {
  std::vector<uint32_t> out(x.values.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == DType::fp32) std::memcpy(&out[i], &x.values[i], 4);
    else out[i] = to_bits(dtype, x.values[i]);
  }
  return out;
}

// Values in [-2, 2] rounded to dtype; a fifth of the rows exactly zero (pad rows of a step output).
Tensor3<float> random_values(int64_t rows, int heads, int dim, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  Tensor3<float> t(rows, heads, dim);
  for (int64_t r = 0; r < rows; ++r) {
    const bool zero = rng() % 5 == 0;
    for (int h = 0; h < heads; ++h)
      for (int x = 0; x < dim; ++x) t(r, h, x) = zero ? 0.f : round_to(dtype, u(rng));
  }
  return t;
}

std::vector<float> random_lse(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-3.f, 6.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = rng() % 17 == 0 ? -INFINITY : u(rng);
  return v;
}

const int kWorldSizes[] = {2, 3, 4, 8};

// Every W of kWorldSizes with every row format, each on a layout of up to 6 sequences of up to 40 tokens drawn from
// `rng` just before: check(layout, format).
template <class Check>
void on_random_layouts_of_every_format(std::mt19937_64& rng, Check&& check) {
  for (int w : kWorldSizes)
    for (const RowFormat& f : kFormats) check(random_layout(rng, w, 6, 40), f);
}

}  // namespace

TEST_CASE("thd helpers: partitioned indices, §2.4 vector and random layouts against §2.1") {
  CPGOLD_REQUIRE_DEVICE();
  {
    const DeviceOffsets cu({0, 8, 16});
    DeviceBuffer idx(8 * 8);
    require_ok(partitioned_indices(cu, 2, 1, static_cast<int64_t*>(idx.ptr), 8));
    CHECK(get<int64_t>(idx, 8) == std::vector<int64_t>{2, 3, 4, 5, 10, 11, 12, 13});
  }
  std::mt19937_64 rng(11);
  for (int w : kWorldSizes)
    for (int trial = 0; trial < 4; ++trial) {
      const Layout l = random_layout(rng, w, 7, 60);
      const DeviceOffsets cu(l.cu_padded);
      const int64_t n = l.total() / w;
      DeviceBuffer idx(static_cast<size_t>(n) * 8);
      for (int r = 0; r < w; ++r) {
        require_ok(partitioned_indices(cu, w, r, static_cast<int64_t*>(idx.ptr), n));
        const auto got = get<int64_t>(idx, static_cast<size_t>(n));
        const auto twin = l.partition().gather_indices(r);
        for (int64_t i = 0; i < n; ++i) {
          CHECK(got[static_cast<size_t>(i)] == expected_global_row(l, r, i));
          CHECK(got[static_cast<size_t>(i)] == twin[static_cast<size_t>(i)]);
        }
      }
    }
  // Thousands of sequences: many warp tiles, a multi-round warp search, lanes stepping over zero-length sequences;
  // once into a 16-byte-aligned array (pair stores) and once at an 8-byte offset (single stores).
  for (int w : {2, 4, 8}) {
    const Layout l = random_layout(rng, w, 4000, 400);
    const DeviceOffsets cu(l.cu_padded);
    const int64_t n = l.total() / w;
    DeviceBuffer idx(static_cast<size_t>(n + 2) * 8);
    for (int r : {0, w - 1})
      for (int64_t offset : {0, 1}) {
        INFO("W " << w << ", rank " << r << ", " << l.batch() << " sequences, offset " << offset);
        int64_t* out = static_cast<int64_t*>(idx.ptr) + offset;
        require_ok(partitioned_indices(cu, w, r, out, n));
        cuda_ok(cudaDeviceSynchronize(), "kernel");
        std::vector<int64_t> got(static_cast<size_t>(n));
        cuda_ok(cudaMemcpy(got.data(), out, static_cast<size_t>(n) * 8, cudaMemcpyDeviceToHost), "download");
        CHECK(got == l.partition().gather_indices(r));
        for (int64_t i = 0; i < n; i += 997) CHECK(got[static_cast<size_t>(i)] == expected_global_row(l, r, i));
      }
  }
}

TEST_CASE("thd helpers: sequence <-> rank order on coded rows, every row format, W in {2,3,4,8}") {
  CPGOLD_REQUIRE_DEVICE();
  std::mt19937_64 rng(12);
  on_random_layouts_of_every_format(rng, [&](const Layout& l, const RowFormat& f) {
    const int w = l.cp_size;
    const DeviceOffsets cu(l.cu_padded);
    const int64_t t = l.total(), n = t / w;
    const Tensor3<uint32_t> seq = coded_rows(l, iota_rows(t), f);
    std::vector<int64_t> rank_rows;
    for (int r = 0; r < w; ++r)
      for (int64_t i = 0; i < n; ++i) rank_rows.push_back(expected_global_row(l, r, i));
    const Tensor3<uint32_t> ranked = coded_rows(l, rank_rows, f);
    DeviceBuffer a(seq.values.size() * 4), b(seq.values.size() * 4);
    put(a, seq.values);
    require_ok(sequence_to_rank_order(rows_of(a, t, f), rows_of(b, t, f), cu, w));
    const auto got = get<uint32_t>(b, seq.values.size());
    CHECK(got == ranked.values);                                              // one way: expected global rows
    CHECK(got == sim::sequence_to_rank_order(seq, l.partition()).values);     // twin
    put(a, ranked.values);
    require_ok(rank_to_sequence_order(rows_of(a, t, f), rows_of(b, t, f), cu, w));
    const auto back = get<uint32_t>(b, seq.values.size());
    CHECK(back == seq.values);
    CHECK(back == sim::rank_to_sequence_order(ranked, l.partition()).values);
  });
}

TEST_CASE("thd helpers: read half on coded rows: half 0 = chunk r, half 1 = chunk 2W-1-r") {
  CPGOLD_REQUIRE_DEVICE();
  std::mt19937_64 rng(13);
  on_random_layouts_of_every_format(rng, [&](const Layout& l, const RowFormat& f) {
    const int w = l.cp_size;
    const DeviceOffsets cul(l.local());
    const int64_t n = l.total() / w;
    const int r = static_cast<int>(rng() % w);
    std::vector<int64_t> local_rows;
    for (int64_t i = 0; i < n; ++i) local_rows.push_back(expected_global_row(l, r, i));
    const Tensor3<uint32_t> local = coded_rows(l, local_rows, f);
    DeviceBuffer in(local.values.size() * 4), out(local.values.size() * 2 + 16);
    put(in, local.values);
    for (int half = 0; half < 2; ++half) {
      require_ok(read_half(rows_of(in, n, f), rows_of(out, n / 2, f), cul, half));
      const auto got = get<uint32_t>(out, static_cast<size_t>(n / 2 * f.words()));
      std::vector<int64_t> expect;  // chunk c of every sequence, in batch order
      for (int b = 0; b < l.batch(); ++b) {
        const int c = half == 0 ? r : 2 * w - 1 - r;
        for (int32_t j = 0; j < l.chunk(b); ++j) expect.push_back(l.cu_padded[b] + c * l.chunk(b) + j);
      }
      CHECK(got == coded_rows(l, expect, f).values);
      CHECK(got == sim::read_half(local, l.partition(), half).values);
    }
  });
}

TEST_CASE("thd helpers: copy of valid tokens, §8 vector and all-gather steps of random layouts") {
  CPGOLD_REQUIRE_DEVICE();
  const RowFormat f{DType::bf16, 1, 8};
  {
    Layout l;
    l.cu_padded = {0, 14};
    l.lengths = {14};
    const Tensor3<uint32_t> in = coded_rows(l, iota_rows(14), f);
    Tensor3<uint32_t> twin(14, 1, f.words(), 0xFFFFFFFFu);
    DeviceBuffer a(in.values.size() * 4), b(in.values.size() * 4);
    put(a, in.values);
    put(b, twin.values);
    const DeviceOffsets cup({2, 6, 12}), cu({0, 3, 7});
    require_ok(copy_valid_rows(rows_of(b, 14, f), rows_of(a, 14, f), cup, cu));
    sim::copy_valid_rows(twin, in, {2, 6, 12}, {0, 3, 7});
    const auto got = get<uint32_t>(b, in.values.size());
    CHECK(got == twin.values);
    for (int64_t row = 0; row < 14; ++row) {
      const bool copied = (row >= 2 && row <= 4) || (row >= 6 && row <= 9);
      CHECK(got[static_cast<size_t>(row * f.words())] == (copied ? in(row, 0, 0) : 0xFFFFFFFFu));
    }
  }
  std::mt19937_64 rng(14);
  for (int w : kWorldSizes)
    for (int trial = 0; trial < 3; ++trial) {
      const Layout l = random_layout(rng, w, 7, 50);
      const sim::SidePartition p = l.partition();
      const int r = static_cast<int>(rng() % w);
      const int64_t n = l.total() / w;
      std::vector<int64_t> local_rows;
      for (int64_t i = 0; i < n; ++i) local_rows.push_back(expected_global_row(l, r, i));
      const Tensor3<uint32_t> in = coded_rows(l, local_rows, f);
      for (int step = 0; step < 2; ++step) {
        // All-gather step offsets (§5): step 0 at cuP/W, step 1 at cuP/W + C_b; counts of chunk r resp. 2W-1-r.
        std::vector<int32_t> cup = l.local();
        if (step == 1)
          for (int b = 0; b < l.batch(); ++b) cup[b] += l.chunk(b);
        const std::vector<int32_t> cnt = p.cu_seqlens_on_rank(r, step == 0, step == 1);
        Tensor3<uint32_t> twin(n, 1, f.words(), 0xFFFFFFFFu);
        DeviceBuffer a(in.values.size() * 4 + 16), b(in.values.size() * 4 + 16);
        put(a, in.values);
        put(b, twin.values);
        require_ok(copy_valid_rows(rows_of(b, n, f), rows_of(a, n, f), DeviceOffsets(cup), DeviceOffsets(cnt)));
        sim::copy_valid_rows(twin, in, cup, cnt);
        const auto got = get<uint32_t>(b, in.values.size());
        CHECK(got == twin.values);
        // One way: exactly the valid tokens of the step's chunk arrive, each on its own row.
        int64_t copied = 0;
        for (int64_t row = 0; row < n; ++row) {
          const uint32_t c = got[static_cast<size_t>(row * f.words())];
          if (c == 0xFFFFFFFFu) continue;
          ++copied;
          const int s = static_cast<int>(c >> 22) - 1;
          const int64_t within = (c >> 10) & 0xFFF;
          const int chunk = step == 0 ? r : 2 * w - 1 - r;
          CHECK(within < l.lengths[s]);
          CHECK(within / l.chunk(s) == chunk);
        }
        CHECK(copied == cnt.back());
      }
    }
}

TEST_CASE("thd helpers: second-half LSE read and correction, packed and unpacked, bit-exact with the twin") {
  CPGOLD_REQUIRE_DEVICE();
  std::mt19937_64 rng(15);
  for (int w : kWorldSizes)
    for (bool packed : {true, false}) {
      const Layout l = random_layout(rng, w, 6, 60);
      const std::vector<int32_t> cul = l.local();
      const sim::StepRows rows(cul, HalfSelect::second);
      const int heads = 3;
      int64_t max_len = 0;
      for (int b = 0; b < l.batch(); ++b) max_len = std::max<int64_t>(max_len, cul[b + 1] - cul[b]);
      const sim::LseShape full = packed ? sim::LseShape{true, heads, l.batch(), rows.local_rows() + 3}
                                        : sim::LseShape{false, heads, l.batch(), max_len};
      const sim::LseShape half = packed ? sim::LseShape{true, heads, l.batch(), rows.rows() + 2}
                                        : sim::LseShape{false, heads, l.batch(), max_len / 2};
      // Coded LSE: value = 1000 * head + rank-local row (packed column) or 1000 * (h * s + head) + column.
      std::vector<float> lse(static_cast<size_t>(full.size()));
      for (size_t i = 0; i < lse.size(); ++i) lse[i] = static_cast<float>(i % full.seqlen) + 1000.f * (i / full.seqlen);
      const DeviceOffsets cu(cul);
      DeviceBuffer dl(lse.size() * 4), dh(static_cast<size_t>(half.size()) * 4);
      put(dl, lse);
      put(dh, std::vector<float>(static_cast<size_t>(half.size()), 7.f));  // must be zeroed
      require_ok(read_second_half_lse({static_cast<float*>(dl.ptr), full}, {static_cast<float*>(dh.ptr), half}, cu));
      const auto got = get<float>(dh, static_cast<size_t>(half.size()));
      CHECK(got == sim::read_second_half_lse(lse, full, half, rows));
      // One way, packed: half column x of head k holds rank-local row x + cu_s[s+1], with cu_s = cul / 2.
      if (packed)
        for (int64_t x = 0; x < rows.rows(); ++x) {
          int s = 0;
          while (s + 1 < l.batch() && cul[s + 1] / 2 <= x) ++s;
          while (cul[s + 1] == cul[s] && s + 1 < l.batch()) ++s;
          CHECK(got[static_cast<size_t>(2 * half.seqlen + x)] == 2000.f + x + cul[s + 1] / 2);
        }
      // Correction on random values with -inf entries.
      std::vector<float> a = random_lse(full.size(), rng);
      const std::vector<float> h = random_lse(half.size(), rng);
      put(dl, a);
      put(dh, h);
      require_ok(second_half_lse_correction({static_cast<float*>(dl.ptr), full}, {static_cast<float*>(dh.ptr), half}, cu));
      const auto corrected = get<float>(dl, a.size());
      sim::second_half_lse_correction(a, full, h, half, rows);
      CHECK(std::memcmp(corrected.data(), a.data(), a.size() * 4) == 0);
    }
}

// `vectors`: chunks of multiples of 4 rows and head strides of multiples of 4, the layouts the packed kernels move
// as 16-byte vectors; the others take the element path.
TEST_CASE("thd helpers: second-half LSE read and correction over thousands of sequences, bit-exact with the twin") {
  CPGOLD_REQUIRE_DEVICE();
  std::mt19937_64 rng(17);
  for (int w : {2, 4})
    for (bool packed : {true, false})
      for (bool vectors : {false, true}) {
        if (vectors && !packed) continue;
        const Layout l = random_layout(rng, w, packed ? 3000 : 800, 300, vectors ? 4 : 1);
        const std::vector<int32_t> cul = l.local();
        const sim::StepRows rows(cul, HalfSelect::second);
        const int heads = 11;  // the read's head groups of four, and a remainder of three
        int64_t max_len = 0;
        for (int b = 0; b < l.batch(); ++b) max_len = std::max<int64_t>(max_len, cul[b + 1] - cul[b]);
        const int64_t full_extra = vectors ? 8 : 5, half_extra = vectors ? 300 : 301;
        const sim::LseShape full = packed ? sim::LseShape{true, heads, l.batch(), rows.local_rows() + full_extra}
                                          : sim::LseShape{false, heads, l.batch(), max_len + 1};
        const sim::LseShape half = packed ? sim::LseShape{true, heads, l.batch(), rows.rows() + half_extra}
                                          : sim::LseShape{false, heads, l.batch(), max_len / 2 + 3};
        INFO("W " << w << (packed ? ", packed, " : ", unpacked, ") << (vectors ? "vectors, " : "elements, ")
                  << l.batch() << " sequences");
        if (vectors) {
          REQUIRE(sim::offset_facts(cul).length_gcd % 8 == 0);
          REQUIRE(full.seqlen % 4 == 0);
          REQUIRE(half.seqlen % 4 == 0);
        }
        const DeviceOffsets cu(cul);
        DeviceBuffer dl(static_cast<size_t>(full.size()) * 4), dh(static_cast<size_t>(half.size()) * 4);
        std::vector<float> lse = random_lse(full.size(), rng);
        put(dl, lse);
        put(dh, std::vector<float>(static_cast<size_t>(half.size()), 7.f));  // must be zeroed
        require_ok(
            read_second_half_lse({static_cast<float*>(dl.ptr), full}, {static_cast<float*>(dh.ptr), half}, cu));
        const auto got = get<float>(dh, static_cast<size_t>(half.size()));
        const auto twin = sim::read_second_half_lse(lse, full, half, rows);
        CHECK(std::memcmp(got.data(), twin.data(), got.size() * 4) == 0);
        const std::vector<float> h = random_lse(half.size(), rng);
        put(dh, h);
        require_ok(
            second_half_lse_correction({static_cast<float*>(dl.ptr), full}, {static_cast<float*>(dh.ptr), half}, cu));
        const auto corrected = get<float>(dl, lse.size());
        sim::second_half_lse_correction(lse, full, h, half, rows);
        CHECK(std::memcmp(corrected.data(), lse.data(), lse.size() * 4) == 0);
      }
}

// The float merge of the correction on 2^20 pairs: differences from -110 to 0 (subnormal and zero exp, rounding
// boundaries of log1p), -inf, large and tiny maxima, equal values; bit-identical to sim::lse_logaddexp.
TEST_CASE("thd helpers: the LSE correction's float logaddexp is bit-identical to the twin on a dense sweep") {
  CPGOLD_REQUIRE_DEVICE();
  const int64_t n = int64_t{1} << 20;
  std::mt19937_64 rng(18);
  std::uniform_real_distribution<float> diff(-110.f, 0.f), level(-40.f, 40.f);
  const float maxima[] = {0.f, -0.f, 1e-30f, -3.5f, 88.f, 1e6f, -1e6f, 0.6931472f};
  std::vector<float> full(static_cast<size_t>(2 * n)), half(static_cast<size_t>(n));
  for (int64_t x = 0; x < n; ++x) {
    const float hi = x % 4 == 0 ? maxima[(x / 4) % 8] : level(rng);
    const float d = x % 3 == 0 ? -110.f * static_cast<float>(x) / static_cast<float>(n) : diff(rng);
    float a = hi, b = hi + d;
    if (x % 101 == 0) b = -INFINITY;
    if (x % 103 == 0) a = -INFINITY;
    if (x % 2 == 1) std::swap(a, b);
    full[static_cast<size_t>(n + x)] = a;
    half[static_cast<size_t>(x)] = b;
  }
  const std::vector<int32_t> cul = {0, static_cast<int32_t>(2 * n)};
  const sim::StepRows rows(cul, HalfSelect::second);
  const sim::LseShape fs{true, 1, 1, 2 * n}, hs{true, 1, 1, n};
  const DeviceOffsets cu(cul);
  DeviceBuffer dl(full.size() * 4), dh(half.size() * 4);
  put(dl, full);
  put(dh, half);
  require_ok(second_half_lse_correction({static_cast<float*>(dl.ptr), fs}, {static_cast<float*>(dh.ptr), hs}, cu));
  const auto got = get<float>(dl, full.size());
  sim::second_half_lse_correction(full, fs, half, hs, rows);
  int64_t differing = 0;
  for (size_t i = 0; i < full.size(); ++i) differing += std::memcmp(&got[i], &full[i], 4) != 0;
  CHECK(differing == 0);
}

TEST_CASE("thd helpers: out correction, bf16/fp16/fp32, full and second half, packed and unpacked") {
  CPGOLD_REQUIRE_DEVICE();
  std::mt19937_64 rng(16);
  for (int w : kWorldSizes)
    for (DType dtype : {DType::bf16, DType::fp16, DType::fp32})
      for (bool second : {false, true})
        for (bool packed : {true, false}) {
          const Layout l = random_layout(rng, w, 5, 50);
          const std::vector<int32_t> cul = l.local();
          const sim::StepRows rows(cul, second ? HalfSelect::second : HalfSelect::full);
          const int heads = 2, dim = dtype == DType::fp32 ? 8 : 16;
          const int64_t t = rows.local_rows() + 2;  // two tail rows, never written
          int64_t max_len = 0;
          for (int b = 0; b < l.batch(); ++b) max_len = std::max<int64_t>(max_len, cul[b + 1] - cul[b]);
          const sim::LseShape full = packed ? sim::LseShape{true, heads, l.batch(), t}
                                            : sim::LseShape{false, heads, l.batch(), max_len};
          const sim::LseShape step = packed ? sim::LseShape{true, heads, l.batch(), rows.rows()}
                                            : sim::LseShape{false, heads, l.batch(), max_len / (second ? 2 : 1)};
          Tensor3<float> out = random_values(t, heads, dim, dtype, rng);
          const Tensor3<float> out_i = random_values(rows.rows(), heads, dim, dtype, rng);
          // lse >= lse_i mostly (a merged LSE), with -inf rows: weights in (0, 1], sometimes exp(-inf - x) = 0.
          std::vector<float> lse_i = random_lse(step.size(), rng), lse = random_lse(full.size(), rng);
          for (float& x : lse) x = std::isinf(x) ? 9.f : x + 3.f;
          DeviceBuffer d_out(out.values.size() * 4), d_oi(out_i.values.size() * 4 + 16), d_l(lse.size() * 4 + 16),
              d_li(lse_i.size() * 4 + 16);
          put_typed(d_out, out, dtype);
          put_typed(d_oi, out_i, dtype);
          put(d_l, lse);
          put(d_li, lse_i);
          require_ok(out_correction({d_out.ptr, t, heads, dim, dtype}, {d_oi.ptr, rows.rows(), heads, dim, dtype},
                                    {static_cast<float*>(d_l.ptr), full}, {static_cast<float*>(d_li.ptr), step},
                                    DeviceOffsets(cul), second));
          const auto got = get_bits(d_out, out.values.size(), dtype);
          sim::out_correction(out, out_i, lse, full, lse_i, step, rows, dtype);
          CHECK(got == host_bits(out, dtype));
        }
  // One way: weight 1 and out = 0 put every step row on its rank-local row (fp32 coded values).
  const Layout l = random_layout(rng, 3, 6, 40);
  const std::vector<int32_t> cul = l.local();
  const sim::StepRows rows(cul, HalfSelect::second);
  const int64_t t = rows.local_rows();
  Tensor3<float> coded_i(rows.rows(), 1, 4);
  for (int64_t x = 0; x < rows.rows(); ++x)
    for (int e = 0; e < 4; ++e) coded_i(x, 0, e) = 1.f + 10.f * x + e;
  DeviceBuffer d_out(static_cast<size_t>(t) * 16 + 16), d_oi(coded_i.values.size() * 4 + 16),
      d_l(static_cast<size_t>(t) * 4 + 16), d_li(static_cast<size_t>(rows.rows()) * 4 + 16);
  put(d_out, std::vector<float>(static_cast<size_t>(t) * 4, 0.f));
  put(d_oi, coded_i.values);
  put(d_l, std::vector<float>(static_cast<size_t>(t), 1.5f));
  put(d_li, std::vector<float>(static_cast<size_t>(rows.rows()), 1.5f));
  require_ok(out_correction({d_out.ptr, t, 1, 4, DType::fp32}, {d_oi.ptr, rows.rows(), 1, 4, DType::fp32},
                            {static_cast<float*>(d_l.ptr), {true, 1, l.batch(), t}},
                            {static_cast<float*>(d_li.ptr), {true, 1, l.batch(), rows.rows()}}, DeviceOffsets(cul),
                            true));
  const auto got = get<float>(d_out, static_cast<size_t>(t) * 4);
  std::vector<float> expect(static_cast<size_t>(t) * 4, 0.f);
  for (int b = 0; b < l.batch(); ++b) {
    const int32_t c = (cul[b + 1] - cul[b]) / 2;
    for (int32_t j = 0; j < c; ++j) {
      const int64_t x = cul[b] / 2 + j, row = cul[b] + c + j;  // second chunk of sequence b
      for (int e = 0; e < 4; ++e) expect[static_cast<size_t>(row * 4 + e)] = 1.f + 10.f * x + e;
    }
  }
  CHECK(got == expect);
}

TEST_CASE("thd helpers: grad correction, all six modes, bf16/fp16/fp32, coded copies and exact adds") {
  CPGOLD_REQUIRE_DEVICE();
  using sim::GradOp;
  const std::pair<GradOp, GradOp> modes[] = {{GradOp::copy, GradOp::none}, {GradOp::add, GradOp::none},
                                             {GradOp::none, GradOp::copy}, {GradOp::none, GradOp::add},
                                             {GradOp::add, GradOp::copy},  {GradOp::copy, GradOp::add}};
  std::mt19937_64 rng(17);
  for (int w : kWorldSizes)
    for (DType dtype : {DType::bf16, DType::fp16, DType::fp32})
      for (const auto& [first, second] : modes) {
        const Layout l = random_layout(rng, w, 5, 50);
        const std::vector<int32_t> cul = l.local();
        const sim::StepRows rows(cul, sim::grad_step_rows(first, second));
        const int heads = 2, dim = 8;
        const int64_t t = rows.local_rows() + 1;
        Tensor3<float> grad = random_values(t, heads, dim, dtype, rng);
        const Tensor3<float> gi = random_values(rows.rows(), heads, dim, dtype, rng);
        DeviceBuffer dg(grad.values.size() * 4), dgi(gi.values.size() * 4 + 16);
        put_typed(dg, grad, dtype);
        put_typed(dgi, gi, dtype);
        require_ok(grad_correction({dg.ptr, t, heads, dim, dtype}, {dgi.ptr, rows.rows(), heads, dim, dtype},
                                   DeviceOffsets(cul), first, second));
        const auto got = get_bits(dg, grad.values.size(), dtype);
        sim::grad_correction(grad, gi, rows, first, second, dtype);
        CHECK(got == host_bits(grad, dtype));
      }
  // One way, copy modes on coded words: grad row of local row i receives step row x of the expected chunk.
  const RowFormat f{DType::fp32, 1, 4};
  for (int w : kWorldSizes) {
    const Layout l = random_layout(rng, w, 6, 40);
    const std::vector<int32_t> cul = l.local();
    const int64_t n = cul.back();
    for (int half = 0; half < 2; ++half) {
      const GradOp first = half == 0 ? GradOp::copy : GradOp::none, second = half == 0 ? GradOp::none : GradOp::copy;
      const sim::StepRows rows(cul, half == 0 ? HalfSelect::first : HalfSelect::second);
      const Tensor3<uint32_t> gi = coded_rows(l, iota_rows(rows.rows()), f);
      DeviceBuffer dg(static_cast<size_t>(n) * 16 + 16), dgi(gi.values.size() * 4 + 16);
      put(dg, std::vector<uint32_t>(static_cast<size_t>(n) * 4, 0xFFFFFFFFu));
      put(dgi, gi.values);
      require_ok(grad_correction(rows_of(dg, n, f), rows_of(dgi, rows.rows(), f), DeviceOffsets(cul), first, second));
      const auto got = get<uint32_t>(dg, static_cast<size_t>(n) * 4);
      for (int b = 0; b < l.batch(); ++b) {
        const int32_t c = (cul[b + 1] - cul[b]) / 2;
        for (int32_t j = 0; j < 2 * c; ++j) {
          const int64_t row = cul[b] + j;
          const bool written = (j < c) == (half == 0);
          const uint32_t expect = written ? gi(cul[b] / 2 + (j % c), 0, 1) : 0xFFFFFFFFu;
          CHECK(got[static_cast<size_t>(row * 4 + 1)] == expect);
        }
      }
    }
  }
}

TEST_CASE("thd helpers: rows that are not 16-byte multiples and bad shapes are rejected naming field and value") {
  CPGOLD_REQUIRE_DEVICE();
  DeviceBuffer a(4096), b(4096);
  const DeviceOffsets cu({0, 8, 16}), cul({0, 4, 8});
  const Outcome narrow = sequence_to_rank_order({a.ptr, 16, 1, 6, DType::bf16}, {b.ptr, 16, 1, 6, DType::bf16}, cu, 2);
  CHECK(narrow.status == Status::invalid_argument);
  CHECK(narrow.message.find("in.row_bytes") != std::string::npos);
  CHECK(narrow.message.find("12") != std::string::npos);
  const Outcome misaligned = read_half({static_cast<char*>(a.ptr) + 8, 8, 1, 8, DType::bf16},
                                       {b.ptr, 4, 1, 8, DType::bf16}, cul, 0);
  CHECK(misaligned.message.find("in.data") != std::string::npos);
  const Outcome rows = read_half({a.ptr, 8, 1, 8, DType::bf16}, {b.ptr, 5, 1, 8, DType::bf16}, cul, 1);
  CHECK(rows.message.find("step_rows") != std::string::npos);
  const Outcome head = out_correction({a.ptr, 8, 2, 4, DType::bf16}, {b.ptr, 4, 2, 4, DType::bf16},
                                      {static_cast<float*>(a.ptr), {true, 2, 2, 8}},
                                      {static_cast<float*>(b.ptr), {true, 2, 2, 4}}, cul, true);
  CHECK(head.message.find("out.dim") != std::string::npos);
  const Outcome uneven = partitioned_indices(DeviceOffsets({0, 6}), 2, 0, static_cast<int64_t*>(a.ptr), 3);
  CHECK(uneven.message.find("cu_seqlens_padded[1]") != std::string::npos);
  const Outcome total = rank_to_sequence_order({a.ptr, 15, 1, 8, DType::bf16}, {b.ptr, 16, 1, 8, DType::bf16}, cu, 2);
  CHECK(total.message.find("in.rows") != std::string::npos);
}
