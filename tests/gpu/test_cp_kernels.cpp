// The CP executors' data-movement and merge kernels (gpu/kernels/cp/cp_kernels.hpp) on the device, against host loops
// written from their contracts. Coded values (every 16-bit word holds its row, head and dim) so a misplaced word cannot
// match by accident; row widths chosen to take every vector width of the row copies (2, 4, 8 and 16 bytes) and the wide
// and narrow paths of the accumulation, conversion and merge kernels. Without a GPU: "SKIPPED: no CUDA device".
#include <doctest/doctest.h>
#include <cuda_runtime.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gpu/kernels/cp/cp_kernels.hpp"
#include "tests/gpu/require_device.hpp"

using namespace cpgold::gpu;

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(e));
}

// A device copy of a host vector (and back).
template <class T>
struct Device {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Device(const std::vector<T>& host) : n(host.size()) {
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n * sizeof(T), 16)), "cudaMalloc");
    if (n) cuda_ok(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  ~Device() { cudaFree(ptr); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  std::vector<T> host() const {
    std::vector<T> out(n);
    cuda_ok(cudaDeviceSynchronize(), "kernel");
    if (n) cuda_ok(cudaMemcpy(out.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

uint16_t bf16_bits(float x) { return Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(x)); }
float bf16_value(uint16_t b) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(b)); }
uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// [rows, heads, dim] of 16-bit words coding (row, head, dim) (never 0).
std::vector<uint16_t> coded(int64_t rows, int64_t heads, int64_t dim) {
  std::vector<uint16_t> x(static_cast<size_t>(rows * heads * dim));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d)
        x[static_cast<size_t>((r * heads + h) * dim + d)] = static_cast<uint16_t>(1 + r * 613 + h * 37 + d);
  return x;
}

}  // namespace

TEST_CASE("cp kernels: row gathers and scatters move the right words at every vector width, negative rows read zero") {
  CPGOLD_REQUIRE_DEVICE();
  // dim 3 -> 2-byte words, 2 -> 4, 4 -> 8, 8 and 64 -> 16 (head slices of bf16 rows).
  for (int64_t dim : {3, 2, 4, 8, 64}) {
    CAPTURE(dim);
    const int64_t rows = 37, heads = 5, h0 = 1, hn = 3, n = 23;
    const std::vector<uint16_t> x = coded(rows, heads, dim);
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::mt19937 rng(static_cast<unsigned>(dim));
    for (auto& i : idx) i = static_cast<int64_t>(rng() % rows);
    idx[5] = -1;
    Device<uint16_t> dx(x), dout(std::vector<uint16_t>(static_cast<size_t>(n * hn * dim), 0xFFFF));
    Device<int64_t> didx(idx);
    cuda_ok(launch_gather_rows(dout.ptr, dx.ptr, didx.ptr, n, heads, h0, hn, dim, Elem::bf16, nullptr), "gather");
    const std::vector<uint16_t> got = dout.host();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hn; ++h)
        for (int64_t d = 0; d < dim; ++d) {
          const int64_t r = idx[static_cast<size_t>(i)];
          const uint16_t want = r < 0 ? 0 : x[static_cast<size_t>((r * heads + h0 + h) * dim + d)];
          REQUIRE(got[static_cast<size_t>((i * hn + h) * dim + d)] == want);
        }
    // Scatter back into distinct rows of a marked tensor: the other rows and heads keep their marks.
    std::vector<int64_t> perm(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) perm[static_cast<size_t>(r)] = (r * 7 + 3) % rows;
    perm.resize(static_cast<size_t>(n));
    const std::vector<uint16_t> src = coded(n, hn, dim);
    Device<uint16_t> dsrc(src), ddst(std::vector<uint16_t>(x.size(), 0xABCD));
    Device<int64_t> dperm(perm);
    cuda_ok(launch_scatter_rows(ddst.ptr, dsrc.ptr, dperm.ptr, n, heads, h0, hn, dim, Elem::bf16, nullptr), "scatter");
    std::vector<uint16_t> want(x.size(), 0xABCD);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hn; ++h)
        for (int64_t d = 0; d < dim; ++d)
          want[static_cast<size_t>((perm[static_cast<size_t>(i)] * heads + h0 + h) * dim + d)] =
              src[static_cast<size_t>((i * hn + h) * dim + d)];
    CHECK(ddst.host() == want);
  }
}

TEST_CASE("cp kernels: scatter_add adds in float32, assign gives the bits of adding into zeros (-0 becomes +0)") {
  CPGOLD_REQUIRE_DEVICE();
  for (int64_t row_elems : {6, 8, 1024}) {  // narrow (6) and 4-wide paths
    CAPTURE(row_elems);
    const int64_t rows = 19, n = 11;
    std::vector<float> dst(static_cast<size_t>(rows * row_elems));
    std::vector<uint16_t> src(static_cast<size_t>(n * row_elems));
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (auto& x : dst) x = u(rng);
    for (auto& x : src) x = bf16_bits(u(rng));
    src[1] = bf16_bits(-0.0f);
    std::vector<int64_t> idx(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 5 + 2) % rows;
    Device<int64_t> didx(idx);
    Device<uint16_t> dsrc(src);
    for (bool assign : {false, true}) {
      CAPTURE(assign);
      Device<float> ddst(dst);
      cuda_ok(launch_scatter_add(ddst.ptr, dsrc.ptr, Elem::bf16, didx.ptr, n, row_elems, assign, nullptr), "scatter_add");
      std::vector<float> want = dst;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t e = 0; e < row_elems; ++e) {
          float& w = want[static_cast<size_t>(idx[static_cast<size_t>(i)] * row_elems + e)];
          w = (assign ? 0.0f : w) + bf16_value(src[static_cast<size_t>(i * row_elems + e)]);
        }
      const std::vector<float> got = ddst.host();
      for (size_t e = 0; e < got.size(); ++e) REQUIRE(float_bits(got[e]) == float_bits(want[e]));
      if (assign) CHECK(float_bits(got[static_cast<size_t>(idx[0] * row_elems + 1)]) == float_bits(0.0f));
    }
  }
}

TEST_CASE("cp kernels: convert rounds float32 to bf16 to nearest even, tails and unaligned starts included") {
  CPGOLD_REQUIRE_DEVICE();
  std::vector<float> x(1031);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  for (auto& v : x) v = u(rng);
  x[0] = -0.0f;
  x[2] = std::numeric_limits<float>::infinity();
  for (size_t offset : {size_t(0), size_t(1)}) {  // offset 1: the scalar path
    CAPTURE(offset);
    Device<float> dx(x);
    Device<uint16_t> dy(std::vector<uint16_t>(x.size(), 0));
    const size_t count = x.size() - offset;
    cuda_ok(launch_convert(dy.ptr + offset, Elem::bf16, dx.ptr + offset, Elem::f32, count, nullptr), "convert");
    const std::vector<uint16_t> got = dy.host();
    for (size_t i = offset; i < x.size(); ++i) REQUIRE(got[i] == bf16_bits(x[i]));
  }
}

TEST_CASE("cp kernels: the forward merge against the LSE merge formula, rows of no step zero with LSE -inf") {
  CPGOLD_REQUIRE_DEVICE();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t dim : {6, 64}) {  // one-element and 8-wide paths
    CAPTURE(dim);
    const int64_t rows = 13, heads = 3;
    // Source 0 covers every row, source 1 the even rows (in reverse order), source 2 rows 1 and 4 (LSE -inf on row 4).
    struct Part {
      std::vector<int64_t> rows;
      std::vector<uint16_t> o;
      std::vector<float> lse;
    };
    std::vector<Part> parts(3);
    for (int64_t r = 0; r < rows - 1; ++r) parts[0].rows.push_back(r);  // the last row: nobody
    for (int64_t r = rows - 2; r >= 0; r -= 2) parts[1].rows.push_back(r);
    parts[2].rows = {1, 4};
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    for (Part& p : parts) {
      const int64_t n = static_cast<int64_t>(p.rows.size());
      p.o.resize(static_cast<size_t>(n * heads * dim));
      for (auto& x : p.o) x = bf16_bits(u(rng));
      p.lse.resize(static_cast<size_t>(heads * n));
      for (auto& x : p.lse) x = u(rng);
    }
    parts[2].lse[1] = ninf;  // head 0 of row 4
    std::vector<std::unique_ptr<Device<uint16_t>>> d_o;
    std::vector<std::unique_ptr<Device<float>>> d_lse;
    std::vector<std::unique_ptr<Device<int64_t>>> d_src;
    std::vector<MergeSource> sources;
    for (const Part& p : parts) {
      std::vector<int64_t> src(static_cast<size_t>(rows), -1);
      for (size_t i = 0; i < p.rows.size(); ++i) src[static_cast<size_t>(p.rows[i])] = static_cast<int64_t>(i);
      d_o.push_back(std::make_unique<Device<uint16_t>>(p.o));
      d_lse.push_back(std::make_unique<Device<float>>(p.lse));
      d_src.push_back(std::make_unique<Device<int64_t>>(src));
      sources.push_back({d_o.back()->ptr, d_lse.back()->ptr, d_src.back()->ptr, static_cast<int64_t>(p.rows.size()),
                         Elem::bf16});
    }
    Device<uint16_t> dout(std::vector<uint16_t>(static_cast<size_t>(rows * heads * dim), 0x7FC0));
    Device<float> dlse(std::vector<float>(static_cast<size_t>(heads * rows), 12345.0f));
    cuda_ok(launch_merge_forward(dout.ptr, Elem::bf16, dlse.ptr, sources.data(), 3, rows, heads, dim, nullptr), "merge");
    const std::vector<uint16_t> got = dout.host();
    const std::vector<float> got_lse = dlse.host();
    if (dim % 8 == 0) {
      // The same merge into an output one element off the 16-byte grid takes the one-element path: the same bits.
      Device<uint16_t> shifted(std::vector<uint16_t>(static_cast<size_t>(rows * heads * dim + 1), 0x7FC0));
      Device<float> shifted_lse(std::vector<float>(static_cast<size_t>(heads * rows), 12345.0f));
      cuda_ok(launch_merge_forward(shifted.ptr + 1, Elem::bf16, shifted_lse.ptr, sources.data(), 3, rows, heads, dim,
                                   nullptr),
              "merge (one-element path)");
      const std::vector<uint16_t> narrow = shifted.host();
      CHECK(std::vector<uint16_t>(narrow.begin() + 1, narrow.end()) == got);
      CHECK(shifted_lse.host() == got_lse);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        // The formula in double: lse = log sum exp(lse_i), o = sum o_i exp(lse_i - lse).
        struct Term {
          double lse;
          const Part* part;
          size_t offset;  // of (row, h, 0) in the part's o
        };
        std::vector<Term> terms;
        double m = -INFINITY;
        for (const Part& p : parts)
          for (size_t i = 0; i < p.rows.size(); ++i)
            if (p.rows[i] == r && std::isfinite(p.lse[static_cast<size_t>(h) * p.rows.size() + i])) {
              terms.push_back({p.lse[static_cast<size_t>(h) * p.rows.size() + i], &p,
                               static_cast<size_t>((static_cast<int64_t>(i) * heads + h) * dim)});
              m = std::max(m, terms.back().lse);
            }
        double s = 0;
        for (const Term& t : terms) s += std::exp(t.lse - m);
        const double lse = terms.empty() ? -INFINITY : m + std::log(s);
        const float gl = got_lse[static_cast<size_t>(h * rows + r)];
        if (terms.empty()) {
          REQUIRE(gl == ninf);
        } else {
          REQUIRE(std::abs(gl - lse) <= 1e-5 * (1 + std::abs(lse)));
        }
        for (int64_t d = 0; d < dim; ++d) {
          double want = 0, magnitude = 0;
          for (const Term& t : terms) {
            const double x = bf16_value(t.part->o[t.offset + static_cast<size_t>(d)]) * std::exp(t.lse - lse);
            want += x;
            magnitude += std::abs(x);
          }
          const uint16_t g = got[static_cast<size_t>((r * heads + h) * dim + d)];
          if (terms.empty()) {
            REQUIRE(g == 0);  // exactly +0
          } else {
            // Summed in float32, rounded once to bf16: within one bf16 step (2^-8 relative) of the exact sum.
            REQUIRE(std::abs(bf16_value(g) - want) <= std::ldexp(1.0, -8) * std::abs(want) + 1e-5 * magnitude);
          }
        }
      }
    // One source over every row: O is that source's words exactly (weight exp(0) = 1), LSE its LSE.
    std::vector<int64_t> all(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) all[static_cast<size_t>(r)] = r;
    const std::vector<uint16_t> one_o = coded(rows, heads, dim);
    std::vector<float> one_lse(static_cast<size_t>(heads * rows));
    for (auto& x : one_lse) x = u(rng);
    Device<uint16_t> d1o(one_o);
    Device<float> d1l(one_lse);
    Device<int64_t> d1s(all);
    const MergeSource one{d1o.ptr, d1l.ptr, d1s.ptr, rows, Elem::bf16};
    cuda_ok(launch_merge_forward(dout.ptr, Elem::bf16, dlse.ptr, &one, 1, rows, heads, dim, nullptr), "merge");
    std::vector<uint16_t> want_o(one_o.size());
    for (size_t i = 0; i < one_o.size(); ++i) want_o[i] = bf16_bits(bf16_value(one_o[i]));
    CHECK(dout.host() == want_o);
    CHECK(dlse.host() == one_lse);
  }
}
