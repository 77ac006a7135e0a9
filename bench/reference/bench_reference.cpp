// Reference attention throughput: forward and backward GFLOP/s of the float64 oracle on a causal varlen batch,
// at 1 and 2 threads, next to the rate Eigen's own matrix product reaches for the tile shapes the reference uses.
//
// FLOPs are counted from the visible mask area A (pairs (i, j) a query sees): forward 2*A*(d_qk + d_v) per head,
// backward 2.5x the forward (the FlashAttention convention: five products where the forward has two).
//
// usage: bench_reference [--lengths 8192,4096,2048,1024,1024] [--heads 8] [--dim 128] [--threads 1,2]
//        bench_reference --gemm-only [threads]   (the GEMM rates alone: one thread and all threads at once)
#include <omp.h>

#include <Eigen/Core>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_clock.hpp"
#include "bench/gemm_rate.hpp"
#include "reference/attention.hpp"
#include "reference/isa_level.hpp"

using namespace cpgold;

using namespace cpgold::bench;

namespace {

std::vector<int> parse_list(const char* text) {
  std::vector<int> out;
  std::string s(text);
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    out.push_back(std::stoi(s.substr(pos, comma - pos)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}


// GFLOP/s of Eigen's product C[m, n] = A[m, k] * B[k, n] (row-major, double), best of a few repetitions.
double eigen_gemm_rate(int m, int k, int n) {
  using M = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const M a = M::Random(m, k), b = M::Random(k, n);
  M c(m, n);
  double best = 1e30;
  int reps = std::max(1, static_cast<int>(2e9 / (2.0 * m * k * n)));
  for (int trial = 0; trial < 3; ++trial) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) c.noalias() = a * b;
    best = std::min(best, seconds_since(t0) / reps);
  }
  return 2.0 * m * k * n / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> lengths{8192, 4096, 2048, 1024, 1024};
  std::vector<int> thread_counts{1, 2};
  int heads = 8, dim = 128;
  if (argc >= 2 && !std::strcmp(argv[1], "--gemm-only")) {
    // The machine's float64 matrix-product rate: one thread, and every thread at once (usage: --gemm-only [threads]).
    pin_eigen_blocking();
    const int threads = argc >= 3 ? std::stoi(argv[2]) : omp_get_max_threads();
    const int block = KernelOptions{}.row_block;
    std::printf("Eigen GEMM (double, %s) rates, GFLOP/s:\n", isa_level());
    std::printf("| shape | 1 thread | %d threads at once |\n|---|---|---|\n", threads);
    const int shapes[3][3] = {{block, 128, 2048}, {block, 2048, 128}, {2048, 128, 2048}};
    for (const auto& s : shapes)
      std::printf("| [%d x %d] x [%d x %d] | %.2f | %.1f |\n", s[0], s[1], s[1], s[2], eigen_gemm_rate(s[0], s[1], s[2]),
                  gemm_rate_all<double>(s[0], s[1], s[2], threads, 4e9));
    return 0;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--lengths")) lengths = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--heads")) heads = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--dim")) dim = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) thread_counts = parse_list(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  pin_eigen_blocking();
  std::vector<int32_t> lens(lengths.begin(), lengths.end());
  ThdLayout layout;
  layout.q = make_packed_sequences(lens, {}, -1, "q");
  layout.kv = layout.q;
  const int64_t tokens = layout.q.total_rows;
  Tensor3<double> q(tokens, heads, dim), k(tokens, heads, dim), v(tokens, heads, dim), dout(tokens, heads, dim);
  uint64_t state = 1;
  for (auto* x : {&q, &k, &v, &dout})
    for (double& value : x->values) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      value = static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0;
    }
  const AttentionCall call = non_cp_call(layout, Window{-1, 0}, 1.0 / std::sqrt(static_cast<double>(dim)));
  double area = 0;
  for (int b = 0; b < layout.batch(); ++b) area += 0.5 * lens[b] * (lens[b] + 1.0);
  const double fwd_flop = 2.0 * area * (2.0 * dim) * heads;
  const double bwd_flop = 2.5 * fwd_flop;

  std::printf("reference attention, float64 oracle: causal, %lld tokens (lengths", static_cast<long long>(tokens));
  for (int l : lengths) std::printf(" %d", l);
  std::printf("), %d heads, d=%d; visible pairs per head %.4g\n", heads, dim, area);
  std::printf("Eigen GEMM (double, 1 thread) on the reference's tile shapes:\n");
  const int block = KernelOptions{}.row_block;
  const double qk = eigen_gemm_rate(block, dim, 2048);
  const double pv = eigen_gemm_rate(block, 2048, dim);
  const double big = eigen_gemm_rate(2048, 128, 2048);
  std::printf("  [%d x %d] x [%d x 2048] (S = Q.K^T)  %.2f GFLOP/s\n", block, dim, dim, qk);
  std::printf("  [%d x 2048] x [2048 x %d] (O = P.V)  %.2f GFLOP/s\n", block, dim, pv);
  std::printf("  [2048 x 128] x [128 x 2048]          %.2f GFLOP/s\n", big);
  const double gemm_rate = 0.5 * (qk + pv);
  std::printf("\n| threads | forward s | forward GFLOP/s | vs GEMM | backward s | backward GFLOP/s | vs GEMM |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int threads : thread_counts) {
    omp_set_num_threads(threads);
    auto t0 = std::chrono::steady_clock::now();
    const auto fwd = attention_forward(call, q, k, v);
    const double tf = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    const auto bwd = attention_backward(call, q, k, v, fwd.o, fwd.lse, dout);
    const double tb = seconds_since(t0);
    const double rf = fwd_flop / tf / 1e9, rb = bwd_flop / tb / 1e9;
    std::printf("| %d | %.2f | %.2f | %.0f%% | %.2f | %.2f | %.0f%% |\n", threads, tf, rf,
                100.0 * rf / (gemm_rate * threads), tb, rb, 100.0 * rb / (gemm_rate * threads));
    std::fflush(stdout);
  }
  std::printf("\n'vs GEMM' divides by threads x the mean of the two tile-shape GEMM rates above.\n");
  return 0;
}
