#pragma once
// The machine's aggregate rate of Eigen's matrix product, shared by the benchmark programs that print it beside their
// own numbers.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>

#include "bench/bench_clock.hpp"

namespace cpgold::bench {

// GFLOP/s of Eigen's product [m x k] x [k x n] in T run by `threads` threads at once, each on its own matrices
// (summed over the threads, best of three rounds); each thread repeats the product for about `flops` operations.
template <class T>
double gemm_rate_all(int m, int k, int n, int threads, double flops) {
  using M = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int reps = std::max(1, static_cast<int>(flops / (2.0 * m * k * n)));
  double best = 1e30;
  for (int trial = 0; trial < 3; ++trial) {
    double slowest = 0;
#pragma omp parallel num_threads(threads) reduction(max : slowest)
    {
      const M a = M::Random(m, k), b = M::Random(k, n);
      M c(m, n);
      c.noalias() = a * b;  // warm
#pragma omp barrier
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) c.noalias() = a * b;
      slowest = std::max(slowest, seconds_since(t0));
    }
    best = std::min(best, slowest);
  }
  return 2.0 * m * k * n * reps * threads / best / 1e9;
}

}  // namespace cpgold::bench
