// Local CP (W virtual ranks on one GPU, gpu/cp/cp_executor.hpp) against the non-CP GPU path on the same tokens:
// forward + backward wall time of one whole run (shard exchanges, per-step attention calls on the Plan's segments,
// merges, dKV ring, reverse exchanges, all ranks' host threads) over the non-CP forward + backward. The ratio is the
// overhead of splitting, merging and copying (target <= 1.25x); both sides run the same attention kernels.
// Prints one table; numbers go to lab/records/perf.md with the command, device and date. --phases 1 adds the device time of
// each phase of one forward + backward run (every operation alone on the device, gpu::PhaseTimes) and the device's
// measured copy rate (1 GiB device-to-device copy, bytes read + written), the limit of the copying phases.
// --aside 1 runs the CP path with CpGpuOptions::accumulate_aside (the backward's float32 accumulation on its own
// stream per rank); --sum 0 without CpGpuOptions::sum_in_backward (default 1, as `verify --backend local`: the ring
// steps' attention backward adds into the float32 sums itself, no scatter_add). --once cp|noncp runs one untimed
// forward + backward of that path and exits, for a profiler (lab/gpu/profile_cp_local.sh). --timeline FILE adds one more CP run with CpGpuOptions::timeline: every operation's
// span on its stream, not serialised, written to FILE in Chrome's trace format (chrome://tracing, Perfetto), and a
// summary of how long each kind of stream was busy and how long two kinds were busy at once. --mode deterministic
// runs both paths with the deterministic backward (default atomic). --scale n multiplies the sequence lengths of the
// batch (512..4096 tokens, bench/gpu/varlen_batches.md) by n: longer sequences, so longer CP chunks (2W per sequence).
// --in-place 0 gathers the ring steps' halves into step tensors (CpGpuOptions::read_halves_in_place off; default 1).
// --last-dtype 0 keeps the summing backward's last step in float32 and converts afterwards
// (CpGpuOptions::last_sum_in_dtype off; default 1).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpu/bench_checks.hpp"
#include "bench/gpu/varlen_lengths.hpp"
#include "gpu/cp/cp_executor.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "reference/attention_call.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/explain/explain.hpp"
#include "sim/plan/plan.hpp"

using namespace cpgold;
using cpgold::bench::check;
using bench::varlen_lengths;

namespace {

template <class F>
double median_ms(F&& f, int reps) {
  for (int i = 0; i < 2; ++i) f();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    check(cudaDeviceSynchronize(), "timed run");
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void* upload(const Tensor3<float>& x) {
  std::vector<uint16_t> bits(x.values.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &x.values[i], 4);
    bits[i] = static_cast<uint16_t>(b >> 16);  // the inputs hold bf16 values: exact
  }
  void* d = nullptr;
  check(cudaMalloc(&d, bits.size() * 2), "cudaMalloc");
  check(cudaMemcpy(d, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
  return d;
}

// Device-to-device copy of 1 GiB, bytes read + written per second (median of 5), in GB/s.
double copy_rate_gbs() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc");
  check(cudaMalloc(&b, bytes), "cudaMalloc");
  check(cudaMemset(a, 1, bytes), "cudaMemset");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int i = 0; i < 6; ++i) {
    cudaEventRecord(e0);
    check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "copy");
    cudaEventRecord(e1);
    check(cudaEventSynchronize(e1), "copy");
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3) / 1e9;
}

// One warm-up run of a local CP executor of `options` (attention plans, row index uploads, pool), then `reset()` (the
// warm-up's records go), then the run that counts.
template <class Reset>
void warm_then_run(const sim::Plan& plan, const sim::CaseInputs& in, const gpu::CpGpuOptions& options, Reset&& reset) {
  gpu::LocalCpExecutor executor(plan, in, DType::bf16, options);
  executor.run(false);
  reset();
  executor.run(false);
}

// One forward + backward run with every backend operation alone on the device: device time per phase.
void print_phases(const sim::CaseSpec& spec, const sim::Plan& plan, const sim::CaseInputs& in, double copy_gbs,
                  gpu::CpGpuOptions options) {
  options.phases = std::make_shared<gpu::PhaseTimes>();
  warm_then_run(plan, in, options, [&] { options.phases->phases.clear(); });
  std::printf("\nphases of one run (all ranks summed; each operation alone on the device; copy rate %.0f GB/s)\n",
              copy_gbs);
  std::printf("| phase | calls | device ms | GB moved | GB/s | ms at the copy rate |\n|---|---|---|---|---|---|\n");
  double total = 0, total_gb = 0;
  for (const auto& [name, e] : options.phases->phases) {
    const double gb = e.bytes / 1e9;
    std::printf("| %s | %lld | %.3f | %.3f | %s | %.3f |\n", name.c_str(), static_cast<long long>(e.calls), e.ms, gb,
                gb > 0 ? std::to_string(static_cast<int>(gb / (e.ms * 1e-3))).c_str() : "-", gb / copy_gbs * 1e3);
    total += e.ms;
    total_gb += gb;
  }
  std::printf("| total | | %.3f | %.3f | | %.3f |\n", total, total_gb, total_gb / copy_gbs * 1e3);
  // The attention calls by step section: useful FLOPs (visible (q, k) pairs x heads, as sim::tile_work counts them;
  // forward 2 matmuls, backward 5) over the summed device time of those calls.
  std::printf("\nattention calls by step section (FLOPs of the visible pairs only)\n");
  std::printf("| pass | section | calls | device ms | TFLOP | TFLOP/s |\n|---|---|---|---|---|---|\n");
  for (const sim::PassKind pass : {sim::PassKind::forward, sim::PassKind::backward}) {
    const sim::PassPlan& pp = pass == sim::PassKind::forward ? plan.forward : plan.backward;
    const double per_pair = pass == sim::PassKind::forward ? 2.0 * (spec.dim_qk + spec.dim_v)
                                                           : 2.0 * (3.0 * spec.dim_qk + 2.0 * spec.dim_v);
    for (const sim::StepSection sec : {sim::StepSection::diagonal, sim::StepSection::lower, sim::StepSection::upper,
                                       sim::StepSection::all}) {
      const auto it = options.phases->phases.find(gpu::attention_phase(pass, sec));
      if (it == options.phases->phases.end()) continue;
      double work = 0;
      for (const sim::Tile& t : pp.tiles)
        if (t.section == sec) work += static_cast<double>(sim::tile_work(t));
      const double tflop = work * per_pair / 1e12;
      std::printf("| %s | %s | %lld | %.3f | %.3f | %.1f |\n", pass == sim::PassKind::forward ? "forward" : "backward",
                  std::string(sim::section_name(sec)).c_str(), static_cast<long long>(it->second.calls), it->second.ms,
                  tflop, tflop / (it->second.ms * 1e-3));
    }
  }
}

// One forward + backward run with the timeline: the Chrome trace to `path` (through a temporary file, so a failed
// write leaves an existing file as it was) and the device-wide busy times of each stream kind.
void print_timeline(const sim::Plan& plan, const sim::CaseInputs& in, gpu::CpGpuOptions options,
                    const std::string& path) {
  options.timeline = std::make_shared<gpu::Timeline>();
  warm_then_run(plan, in, options, [&] { options.timeline->spans.clear(); });
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << gpu::chrome_trace(options.timeline->spans).dump() << "\n";
    if (!f) {
      std::fprintf(stderr, "bench_cp_local: --timeline %s: cannot write %s\n", path.c_str(), tmp.c_str());
      std::exit(2);
    }
  }
  std::error_code error;
  std::filesystem::rename(tmp, path, error);
  if (error) {
    std::fprintf(stderr, "bench_cp_local: --timeline %s: cannot rename %s to it: %s\n", path.c_str(), tmp.c_str(),
                 error.message().c_str());
    std::exit(2);
  }
  const gpu::TimelineSummary t = gpu::summarize(options.timeline->spans);
  const double run = t.end_ms - t.begin_ms;
  std::printf("\ntimeline of one run (%zu spans, %s): %.3f ms from the first operation to the last\n",
              options.timeline->spans.size(), path.c_str(), run);
  std::printf("| streams (all ranks) | busy ms | share of the run |\n|---|---|---|\n");
  for (const auto& [kind, ms] : t.busy_ms) std::printf("| %s | %.3f | %.0f%% |\n", kind.c_str(), ms, 100 * ms / run);
  for (const auto& [pair, ms] : t.overlap_ms)
    std::printf("| %s and %s at once | %.3f | %.0f%% |\n", pair.first.c_str(), pair.second.c_str(), ms, 100 * ms / run);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a log even if a guard stops the run
  int W = 4, heads = 16, dim = 128, reps = 10, scale = 1;
  int64_t tokens = 32768;
  std::string comm = "p2p";
  bool phases = false;
  // How the CP path schedules its backward accumulation (--aside, --sum, --mode, --in-place, --last-dtype): the
  // summing backward on, as in verify --backend local. --mode is the non-CP path's too.
  gpu::CpGpuOptions schedule;
  schedule.sum_in_backward = true;
  std::string once;  // "cp" or "noncp": one untimed forward + backward of that path, then exit (for a profiler)
  std::string timeline_file;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--cp-size") W = std::stoi(v);
    else if (a == "--heads") heads = std::stoi(v);
    else if (a == "--dim") dim = std::stoi(v);
    else if (a == "--tokens") tokens = std::stoll(v);
    else if (a == "--comm") comm = v;
    else if (a == "--reps") reps = std::stoi(v);
    else if (a == "--phases") phases = v == "1";
    else if (a == "--once" && (v == "cp" || v == "noncp")) once = v;
    else if (a == "--aside" && (v == "0" || v == "1")) schedule.accumulate_aside = v == "1";
    else if (a == "--sum" && (v == "0" || v == "1")) schedule.sum_in_backward = v == "1";
    else if (a == "--timeline" && !v.empty()) timeline_file = v;
    else if (a == "--mode" && (v == "atomic" || v == "deterministic"))
      schedule.mode = v == "atomic" ? gpu::BackwardMode::atomic : gpu::BackwardMode::deterministic;
    else if (a == "--scale" && std::atoi(v.c_str()) >= 1) scale = std::atoi(v.c_str());
    else if (a == "--in-place" && (v == "0" || v == "1")) schedule.read_halves_in_place = v == "1";
    else if (a == "--last-dtype" && (v == "0" || v == "1")) schedule.last_sum_in_dtype = v == "1";
    else {
      std::fprintf(stderr, "usage: bench_cp_local [--cp-size W] [--heads h] [--dim d] [--tokens t] [--comm c] [--reps n] [--phases 0|1] [--once cp|noncp] [--aside 0|1] [--sum 0|1] [--timeline FILE] [--mode atomic|deterministic] [--scale n] [--in-place 0|1] [--last-dtype 0|1]\n");
      return 2;
    }
  }
  if (gpu::cuda_device_count() == 0) {
    std::fprintf(stderr, "bench_cp_local: no CUDA device\n");
    return 2;
  }
  const sim::CaseSpec s = bench::causal_varlen_case(varlen_lengths(tokens, scale), W, sim::parse_comm(comm), heads, dim);
  const sim::Plan plan = sim::make_plan(s);
  const sim::CaseInputs in = sim::make_case_inputs(s);
  const ThdLayout lay = sim::layout(s);

  // Non-CP: one call over the whole batch, plans built once.
  const AttentionCall call = non_cp_call(lay, sim::mask_window(s), sim::softmax_scale(s));
  gpu::AttentionPlan full;
  check(full.build(call, {DType::bf16, heads, heads, dim, dim}), "plan");
  void *q = upload(in.q), *k = upload(in.k), *v = upload(in.v), *dout = upload(in.dout);
  void *o, *dq, *dk, *dv;
  float* lse;
  const size_t rows_q = static_cast<size_t>(in.q.rows), rows_kv = static_cast<size_t>(in.k.rows);
  check(cudaMalloc(&o, rows_q * heads * dim * 2), "cudaMalloc");
  check(cudaMalloc(&dq, rows_q * heads * dim * 2), "cudaMalloc");
  check(cudaMalloc(&dk, rows_kv * heads * dim * 2), "cudaMalloc");
  check(cudaMalloc(&dv, rows_kv * heads * dim * 2), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&lse), rows_q * heads * 4), "cudaMalloc");
  if (once == "noncp") {
    check(gpu::attention_forward(full, {q, k, v, o, lse}), "forward");
    check(gpu::attention_backward(full, {q, k, v, o, dout, lse, dq, dk, dv, {}, {}, {}}, schedule.mode), "backward");
    check(cudaDeviceSynchronize(), "non-CP run");
    std::printf("one non-CP forward + backward done\n");
    return 0;
  }
  if (once == "cp") {
    gpu::LocalCpExecutor executor(plan, in, DType::bf16, schedule);
    executor.run(false);
    std::printf("one local CP %s W=%d forward + backward done\n", comm.c_str(), W);
    return 0;
  }
  const double non_cp = median_ms(
      [&] {
        check(gpu::attention_forward(full, {q, k, v, o, lse}), "forward");
        check(gpu::attention_backward(full, {q, k, v, o, dout, lse, dq, dk, dv, {}, {}, {}}, schedule.mode), "backward");
      },
      reps);

  gpu::LocalCpExecutor executor(plan, in, DType::bf16, schedule);
  const double cp = median_ms([&] { executor.run(false); }, reps);
  gpu::CpGpuOptions fwd_only;
  fwd_only.backward = false;
  gpu::LocalCpExecutor executor_fwd(plan, in, DType::bf16, fwd_only);
  const double cp_fwd = median_ms([&] { executor_fwd.run(false); }, reps);
  const double non_cp_fwd = median_ms([&] { check(gpu::attention_forward(full, {q, k, v, o, lse}), "forward"); }, reps);

  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s; case: %lld tokens in %zu sequences (%d..%d), causal, bf16, h=%d, d=%d, %s W=%d; %s "
              "backward; median of %d; halves %s; last sums %s; accumulation %s\n",
              prop.name, static_cast<long long>(tokens), s.seqlens_q.size(), 512 * scale, 4096 * scale, heads, dim,
              comm.c_str(), W, schedule.mode == gpu::BackwardMode::atomic ? "atomic" : "deterministic", reps,
              schedule.read_halves_in_place ? "read in place" : "gathered (--in-place 0)",
              schedule.last_sum_in_dtype ? "in the dtype" : "float32, then converted (--last-dtype 0)",
              schedule.sum_in_backward    ? (schedule.accumulate_aside
                                                 ? "in the attention kernels (--sum 1), the rest on its own stream (--aside 1)"
                                                 : "in the attention kernels (--sum 1)")
              : schedule.accumulate_aside ? "on its own stream (--aside 1)"
                                          : "in order on the compute stream");
  std::printf("forward kernel: %s\n",
              gpu::forward_kernel_description({DType::bf16, heads, heads, dim, dim}).c_str());
  std::printf("| path | forward ms | forward + backward ms | ratio (fwd+bwd) |\n|---|---|---|---|\n");
  std::printf("| non-CP GPU (one call) | %.3f | %.3f | 1.00 |\n", non_cp_fwd, non_cp);
  std::printf("| local CP %s W=%d (one GPU) | %.3f | %.3f | %.2f |\n", comm.c_str(), W, cp_fwd, cp, cp / non_cp);
  if (phases) print_phases(s, plan, in, copy_rate_gbs(), schedule);
  if (!timeline_file.empty()) print_timeline(plan, in, schedule, timeline_file);
  return 0;
}
