// Forward/backward TFLOP/s of the cpgold GPU attention on varlen batches (bench/gpu/varlen_batches.md).
// Usage: bench_gpu_attention [--reps N] [--dims D/DV,...] [--forward auto|mma|wgmma|both]
//                            [--backward auto|mma|wgmma|both] [--totals N,...] [--pad-rows N] [--divide N]
// prints one table row per (forward kernel, backward kernel, mask, d, total tokens). --dims defaults to
// 128/128,64/64; heads = 2048 / DV. --forward picks the forward kernel (default auto: what attention_forward chooses
// on this device; both: a row for mma.sync and one for wgmma, the before/after of the same run); the impl column
// names the forward kernel that ran, host_us the host time of one attention_forward call (tensor-map encoding
// included for wgmma). --backward picks the backward kernel the same way (the wgmma backward serves every pair of
// the capability table on a 9.0 device: an explicit wgmma request elsewhere fails naming the reason); bwd_impl names the backward
// kernel of the row's bwd_ms, bwd_TF (atomic mode) and bwd_det_TF (deterministic mode). --divide N divides every
// length of the cycle by N (a divisor of 512): the same tokens in sequences as short as CP chunks (8: 64..512, the
// chunks of p2p W = 4 on the undivided batch; 16: 32..256, W = 8), for the rate on short attention blocks.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/gpu/bench_checks.hpp"
#include "bench/gpu/varlen_lengths.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "reference/attention_call.hpp"
#include "reference/thd_layout.hpp"

using namespace cpgold;
using cpgold::bench::check;
using bench::varlen_lengths;

namespace {

double forward_flops(const std::vector<int32_t>& lens, int heads, int d, int dv, bool causal) {
  double flops = 0;
  for (int32_t s : lens) flops += 2.0 * s * (causal ? s / 2.0 : s) * (d + dv) * heads;
  return flops;
}

void* device_random(size_t elems, std::mt19937& rng) {
  std::vector<uint16_t> host(elems);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : host) {
    const float f = u(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<uint16_t>(bits >> 16);  // bf16 by truncation: any bf16 value will do for timing
  }
  void* d = nullptr;
  check(cudaMalloc(&d, elems * 2), "cudaMalloc");
  check(cudaMemcpy(d, host.data(), elems * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

template <class F>
float median_ms(F&& f, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    check(cudaEventSynchronize(b), "timed run");
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return times[times.size() / 2];
}

// --forward/--backward KERNEL: "both" (mma.sync, then wgmma: the before and after of one run) or the kernel `parse`
// names; false for any other text.
template <class Kernel, class Parse>
bool choose_kernels(const std::string& text, Parse parse, std::vector<Kernel>& kernels) {
  if (text == "both") {
    kernels = {Kernel::mma_sync, Kernel::wgmma};
    return true;
  }
  const std::optional<Kernel> kernel = parse(text);
  if (kernel) kernels = {*kernel};
  return kernel.has_value();
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a log even if a guard stops the run
  int reps = 20;
  std::vector<int64_t> totals = {16384, 32768, 65536};
  int pad_rows = 0;  // --pad-rows N: every sequence keeps its slot of the cycle length and holds N tokens fewer
  int divide = 1;    // --divide N: the cycle's lengths divided by N
  std::vector<std::pair<int, int>> dims = {{128, 128}, {64, 64}};
  std::vector<gpu::ForwardKernel> forwards = {gpu::ForwardKernel::automatic};
  std::vector<gpu::BackwardKernel> backwards = {gpu::BackwardKernel::automatic};
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string option = argv[i];
    if (option == "--backward" || option == "--forward") {
      const bool known = option == "--backward" ? choose_kernels(argv[i + 1], gpu::parse_backward_kernel, backwards)
                                                : choose_kernels(argv[i + 1], gpu::parse_forward_kernel, forwards);
      if (!known) {
        std::fprintf(stderr, "%s: expected auto, mma, wgmma or both, got \"%s\"\n", option.c_str(), argv[i + 1]);
        return 2;
      }
    }
    if (option == "--reps") reps = std::atoi(argv[i + 1]);
    if (option == "--pad-rows") pad_rows = std::atoi(argv[i + 1]);
    if (option == "--divide") {
      divide = std::atoi(argv[i + 1]);
      if (divide < 1 || 512 % divide != 0) {
        std::fprintf(stderr, "--divide: expected a divisor of 512 (1, 2, 4, ..., 512), got \"%s\"\n", argv[i + 1]);
        return 2;
      }
    }
    if (option == "--totals") {  // token counts (slot rows), comma separated
      totals.clear();
      for (const char* at = argv[i + 1]; *at;) {
        totals.push_back(std::atoll(at));
        while (*at && *at != ',') ++at;
        if (*at == ',') ++at;
      }
    }
    if (option == "--dims") {
      dims.clear();
      const std::string list = argv[i + 1];
      for (size_t at = 0; at < list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        const std::string item = list.substr(at, comma - at);
        const size_t slash = item.find('/');
        const int d = std::atoi(item.c_str());
        dims.push_back({d, slash == std::string::npos ? d : std::atoi(item.c_str() + slash + 1)});
        at = comma + 1;
      }
    }
  }
  if (gpu::cuda_device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs; sequence lengths: %d..%d cycling; pad rows per sequence: %d\n", prop.name,
              prop.multiProcessorCount, 512 / divide, 4096 / divide, pad_rows);
  for (const auto& [d, dv] : dims)
    for (gpu::ForwardKernel f : forwards)
      std::printf("forward kernel (requested %s) for d %d/%d: %s\n", std::string(gpu::forward_kernel_name(f)).c_str(), d,
                  dv, gpu::forward_kernel_description({DType::bf16, 2048 / dv, 2048 / dv, d, dv}, f).c_str());
  for (const auto& [d, dv] : dims)
    for (gpu::BackwardKernel b : backwards)
      std::printf("backward kernel (requested %s) for d %d/%d: %s\n", std::string(gpu::backward_kernel_name(b)).c_str(),
                  d, dv, gpu::backward_kernel_description({DType::bf16, 2048 / dv, 2048 / dv, d, dv}, b).c_str());
  std::printf("%-8s %-5s %-7s %-6s %10s %10s %8s %-8s %10s %10s %10s\n", "impl", "mask", "d", "tokens", "fwd_ms",
              "fwd_TF", "host_us", "bwd_impl", "bwd_ms", "bwd_TF", "bwd_det_TF");
  std::mt19937 rng(1);
  for (const auto& [d, dv] : dims)
    for (bool causal : {true, false})
      for (int64_t total : totals) {
        const int heads = 2048 / dv;
        const std::vector<int32_t> slots = varlen_lengths(total, 1, divide);
        std::vector<int32_t> lens;  // actual lengths; the slot's remaining rows are padding between sequences
        for (int32_t s : slots) lens.push_back(std::max(0, s - pad_rows));
        const std::vector<int32_t> padded = pad_rows > 0 ? slots : std::vector<int32_t>{};
        ThdLayout layout{make_packed_sequences(lens, padded, -1, "q"), make_packed_sequences(lens, padded, -1, "kv")};
        const AttentionCall call =
            non_cp_call(layout, causal ? Window{-1, 0} : Window{-1, -1}, 1.0 / std::sqrt(static_cast<double>(d)));
        gpu::AttentionPlan plan;
        check(plan.build(call, {DType::bf16, heads, heads, d, dv}), "plan");
        const size_t elems = static_cast<size_t>(total) * heads * d;      // q, k, dq, dk
        const size_t elems_v = static_cast<size_t>(total) * heads * dv;   // v, o, dout, dv
        void* q = device_random(elems, rng);
        void* k = device_random(elems, rng);
        void* v = device_random(elems_v, rng);
        void* dout = device_random(elems_v, rng);
        void *o, *dq, *dk, *dv_grad;
        float* lse;
        check(cudaMalloc(&o, elems_v * 2), "cudaMalloc");
        check(cudaMalloc(&dq, elems * 2), "cudaMalloc");
        check(cudaMalloc(&dk, elems * 2), "cudaMalloc");
        check(cudaMalloc(&dv_grad, elems_v * 2), "cudaMalloc");
        check(cudaMalloc(reinterpret_cast<void**>(&lse), static_cast<size_t>(total) * heads * 4), "cudaMalloc");
        gpu::ForwardBuffers fb{q, k, v, o, lse};
        const gpu::BackwardBuffers bb{q, k, v, o, dout, lse, dq, dk, dv_grad, {}, {}, {}};
        // O and LSE of the inputs, so that the backward runs on a real forward's outputs.
        check(gpu::attention_forward(plan, fb), "forward");
        std::vector<float> bwd_ms, bwd_det_ms;  // per backward kernel
        std::vector<gpu::BackwardKernel> bwd_ran;
        for (gpu::BackwardKernel bk : backwards) {
          gpu::BackwardKernel ran{};
          check(gpu::backward_kernel_for({DType::bf16, heads, heads, d, dv}, bk, ran), "backward kernel");
          bwd_ran.push_back(ran);
          bwd_ms.push_back(median_ms(
              [&] { check(gpu::attention_backward(plan, bb, gpu::BackwardMode::atomic, nullptr, bk), "backward"); },
              reps));
          bwd_det_ms.push_back(median_ms(
              [&] {
                check(gpu::attention_backward(plan, bb, gpu::BackwardMode::deterministic, nullptr, bk), "backward");
              },
              reps));
        }
        const double flops = forward_flops(lens, heads, d, dv, causal);
        const std::string dims_text = d == dv ? std::to_string(d) : std::to_string(d) + "/" + std::to_string(dv);
        for (gpu::ForwardKernel f : forwards) {
          gpu::ForwardKernel ran{};
          check(gpu::forward_kernel_for({DType::bf16, heads, heads, d, dv}, f, ran), "forward kernel");
          const float fwd = median_ms([&] { check(gpu::attention_forward(plan, fb, nullptr, f), "forward"); }, reps);
          // Host time of one call (argument checks, kernel choice, tensor maps, launch), over 200 back-to-back calls.
          check(cudaDeviceSynchronize(), "sync");
          constexpr int kHostCalls = 200;
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < kHostCalls; ++i) check(gpu::attention_forward(plan, fb, nullptr, f), "forward");
          const double host_us =
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kHostCalls;
          check(cudaDeviceSynchronize(), "sync");
          for (size_t i = 0; i < backwards.size(); ++i)
            std::printf("%-8s %-5s %-7s %-6lld %10.3f %10.1f %8.2f %-8s %10.3f %10.1f %10.1f\n",
                        std::string(gpu::forward_kernel_name(ran)).c_str(), causal ? "causal" : "full",
                        dims_text.c_str(), static_cast<long long>(total), fwd, flops / fwd * 1e-9, host_us,
                        std::string(gpu::backward_kernel_name(bwd_ran[i])).c_str(), bwd_ms[i],
                        2.5 * flops / bwd_ms[i] * 1e-9, 2.5 * flops / bwd_det_ms[i] * 1e-9);
        }
        for (void* p : {q, k, v, dout, o, dq, dk, dv_grad, static_cast<void*>(lse)}) cudaFree(p);
      }
  return 0;
}
