// CP over NCCL on the GPUs of one host (one process, one thread per GPU, like `verify --backend nccl`'s threads
// launch): per-GPU attention TFLOP/s and CP efficiency at a fixed number of tokens per rank, for W = 2, 4, ... up to
// the visible GPUs. The W-rank batch holds W x tokens-per-rank tokens of the benchmarks' varlen length cycle (times
// --seq-scale: 1 gives sequences of 512..4096 tokens, 4 gives 2048..16384); the reference is one GPU running that
// whole batch in one non-CP attention call, divided by W (1/W of the work); CP efficiency = reference / the slowest
// rank's time. Times are CUDA events per rank: a run's time on its compute stream, the exchanges' time on the
// communication stream, and the compute stream's waits for exchanges (the exposed communication; the rest of the
// communication time was hidden behind compute). Median over reps of the slowest rank (after warm-ups, ranks lined
// up by a host barrier before each rep). Next to the numbers: the per-GPU bf16 dense peak and the NVLink ring-shift
// bandwidth measured in the same run with a plain send/recv. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, set by
// NcclCommunicator::create before NCCL starts). Prints one table for lab/records/perf.md.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/gpu/varlen_lengths.hpp"
#include "gpu/comm/local_communicator.hpp"
#include "gpu/comm/nccl_communicator.hpp"
#include "gpu/comm/nccl_ranks.hpp"
#include "gpu/cp/cp_executor.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "reference/attention_call.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/plan/plan.hpp"

using namespace cpgold;
using bench::varlen_lengths;

namespace {

constexpr double kBf16DensePeakTflops = 989.0;  // H100 / H200 SXM specification, per GPU, dense bf16

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(const gpu::Outcome& o, const char* what) {
  if (!o.ok()) throw std::runtime_error(std::string(what) + ": " + std::string(gpu::status_name(o.status)) + " " + o.message);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Attention FLOPs of a causal batch as lab/records/perf.md counts them: 2 * s * (s / 2) * (d_qk + d_v) * H per sequence
// forward, 2.5x that backward.
double causal_flops(const std::vector<int32_t>& lens, int heads, int dim, bool backward) {
  double f = 0;
  for (int32_t s : lens) f += 2.0 * s * (s / 2.0) * (2.0 * dim) * heads;
  return backward ? 3.5 * f : f;
}

// Inputs of bf16-exact values from a cheap hash, filled on all cores (sim::make_case_inputs is single-threaded and
// the timing does not depend on the values).
Tensor3<float> bench_tensor(int64_t rows, int heads, int dim, uint64_t salt) {
  Tensor3<float> t(rows, heads, dim);
  const size_t n = t.values.size();
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (size_t i = n * w / workers; i < n * (w + 1) / workers; ++i) {
        uint64_t x = (i + salt) * 0x9E3779B97F4A7C15ull;
        x ^= x >> 29;
        x *= 0xBF58476D1CE4E5B9ull;
        t.values[i] = static_cast<float>(static_cast<int>((x >> 56) & 0xff) - 128) / 128.0f;  // exact in bf16
      }
    });
  for (auto& th : pool) th.join();
  return t;
}
sim::CaseInputs bench_inputs(const sim::CaseSpec& s) {
  const ThdLayout l = sim::layout(s);
  return {bench_tensor(l.q.total_rows, s.heads_q, s.dim_qk, 1), bench_tensor(l.kv.total_rows, s.heads_q, s.dim_qk, 2),
          bench_tensor(l.kv.total_rows, s.heads_q, s.dim_v, 3), bench_tensor(l.q.total_rows, s.heads_q, s.dim_v, 4)};
}

void* upload_bf16(const Tensor3<float>& x) {
  std::vector<uint16_t> bits(x.values.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &x.values[i], 4);
    bits[i] = static_cast<uint16_t>(b >> 16);  // bf16-exact values: the top half is the value
  }
  void* d = nullptr;
  check(cudaMalloc(&d, bits.size() * 2), "cudaMalloc");
  check(cudaMemcpy(d, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
  return d;
}

// Median device time (CUDA events) of f() on `stream` after warm-ups.
template <class F>
double event_median_ms(cudaStream_t stream, int warmups, int reps, F&& f) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < warmups; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(a, stream), "cudaEventRecord");
    f();
    check(cudaEventRecord(b, stream), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

// One GPU, one non-CP attention call over the batch (the reference: 1/W of the W-rank work). {forward, fwd + bwd}.
std::pair<double, double> single_gpu_ms(const sim::CaseSpec& s, int warmups, int reps) {
  const sim::CaseInputs in = bench_inputs(s);
  const AttentionCall call = non_cp_call(sim::layout(s), sim::mask_window(s), sim::softmax_scale(s));
  gpu::AttentionPlan plan;
  check(plan.build(call, {DType::bf16, s.heads_q, s.heads_q, s.dim_qk, s.dim_v}), "plan");
  void *q = upload_bf16(in.q), *k = upload_bf16(in.k), *v = upload_bf16(in.v), *dout = upload_bf16(in.dout);
  void *o, *dq, *dk, *dv;
  float* lse;
  const size_t elems = in.q.values.size();
  check(cudaMalloc(&o, elems * 2), "cudaMalloc");
  check(cudaMalloc(&dq, elems * 2), "cudaMalloc");
  check(cudaMalloc(&dk, elems * 2), "cudaMalloc");
  check(cudaMalloc(&dv, elems * 2), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&lse), static_cast<size_t>(in.q.rows) * s.heads_q * 4), "cudaMalloc");
  check(cudaDeviceSynchronize(), "uploads");  // pageable uploads may land after cudaMemcpy returns
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const double fwd = event_median_ms(stream, warmups, reps, [&] {
    check(gpu::attention_forward(plan, {q, k, v, o, lse}, stream), "forward");
  });
  const double both = event_median_ms(stream, warmups, reps, [&] {
    check(gpu::attention_forward(plan, {q, k, v, o, lse}, stream), "forward");
    check(gpu::attention_backward(plan, {q, k, v, o, dout, lse, dq, dk, dv, {}, {}, {}}, gpu::BackwardMode::atomic, stream), "backward");
  });
  for (void* p : {q, k, v, dout, o, dq, dk, dv, static_cast<void*>(lse)}) cudaFree(p);
  cudaStreamDestroy(stream);
  return {fwd, both};
}

// What one configuration measured: per rep, the slowest rank's run and the ranks' mean exchange times.
struct Measured {
  double slowest_ms = 0, comm_ms = 0, exposed_ms = 0;
};
Measured summarise(const std::vector<std::vector<gpu::RankTimes>>& per_rank) {
  const size_t reps = per_rank[0].size();
  std::vector<double> slowest, comm, exposed;
  for (size_t i = 0; i < reps; ++i) {
    double s = 0, c = 0, e = 0;
    for (const auto& r : per_rank) {
      s = std::max(s, r[i].run_ms);
      c += r[i].comm_ms / static_cast<double>(per_rank.size());
      e += r[i].exposed_ms / static_cast<double>(per_rank.size());
    }
    slowest.push_back(s);
    comm.push_back(c);
    exposed.push_back(e);
  }
  return {median(slowest), median(comm), median(exposed)};
}

// The CP program with W = 1 (no exchange) on GPU 0: the program's own cost over one attention call.
Measured program_w1(const sim::CaseSpec& s, bool backward, int warmups, int reps) {
  const sim::Plan plan = sim::make_plan(s);
  const sim::CaseInputs in = bench_inputs(s);
  auto comms = gpu::make_local_communicators(1);
  gpu::CpGpuOptions options;
  options.backward = backward;
  options.time_exchanges = true;
  gpu::RankCpExecutor ex(plan, in, DType::bf16, *comms[0], options);
  for (int i = 0; i < warmups; ++i) ex.run(false);
  std::vector<std::vector<gpu::RankTimes>> times(1);
  for (int i = 0; i < reps; ++i) times[0].push_back(ex.run(false).times);
  return summarise(times);
}

// Ring shift of `bytes` per rank (send to the next rank, receive from the previous: the KV ring's pattern) with a
// plain grouped ncclSend/ncclRecv; GB/s per GPU per direction, median of reps.
double ring_shift_gbps(gpu::NcclCommunicator& comm, gpu::RankChannel& channel, size_t bytes, int reps) {
  void *send = nullptr, *recv = nullptr;
  check(cudaMalloc(&send, bytes), "cudaMalloc");
  check(cudaMalloc(&recv, bytes), "cudaMalloc");
  check(cudaMemset(send, 1, bytes), "cudaMemset");
  const int W = comm.size(), r = comm.rank();
  const gpu::SendTo s{(r + 1) % W, send, bytes};
  const gpu::RecvFrom v{(r + W - 1) % W, recv, bytes};
  const auto stream = static_cast<cudaStream_t>(comm.stream());
  std::vector<double> ms;
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < reps + 2; ++i) {
    channel.all_gather("", "bandwidth barrier", gpu::Seconds(60));
    check(cudaEventRecord(a, stream), "cudaEventRecord");
    comm.send_recv({&s, 1}, {&v, 1});
    check(cudaEventRecord(b, stream), "cudaEventRecord");
    comm.synchronize();
    float t = 0;
    check(cudaEventElapsedTime(&t, a, b), "cudaEventElapsedTime");
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(send);
  cudaFree(recv);
  return static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e9;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    const size_t b = s.find(',', a);
    out.push_back(s.substr(a, b == std::string::npos ? std::string::npos : b - a));
    if (b == std::string::npos) break;
    a = b + 1;
  }
  return out;
}

struct Args {
  int gpus = 0, heads = 16, dim = 128, reps = 20, warmups = 3, seq_scale = 1;
  std::vector<int64_t> tokens{8192, 16384, 32768};
  std::vector<std::string> comms{"p2p", "all_gather"};
  size_t bandwidth_bytes = size_t{256} << 20;
  gpu::NcclCtaPolicy cta_policy = gpu::NcclCtaPolicy::nccl_default;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_cp_nccl: %s\nusage: bench_cp_nccl [--gpus N] [--tokens-per-rank 8192,16384,32768] "
               "[--comms p2p,all_gather] [--seq-scale 1] [--heads 16] [--dim 128] [--reps 20] [--warmups 3] "
               "[--bandwidth-mib 256] [--cta-policy default|efficiency|zero]\n",
               why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(k + " needs a value");
    const std::string v = argv[i + 1];
    try {
      if (k == "--gpus") a.gpus = std::stoi(v);
      else if (k == "--heads") a.heads = std::stoi(v);
      else if (k == "--dim") a.dim = std::stoi(v);
      else if (k == "--reps") a.reps = std::stoi(v);
      else if (k == "--warmups") a.warmups = std::stoi(v);
      else if (k == "--seq-scale") a.seq_scale = std::stoi(v);
      else if (k == "--bandwidth-mib") a.bandwidth_bytes = static_cast<size_t>(std::stoll(v)) << 20;
      else if (k == "--comms") a.comms = split_list(v);
      else if (k == "--cta-policy") {
        try {
          a.cta_policy = gpu::parse_nccl_cta_policy(v);
        } catch (const std::invalid_argument& e) {
          usage(std::string("--cta-policy: ") + e.what());
        }
      }
      else if (k == "--tokens-per-rank") {
        a.tokens.clear();
        for (const std::string& t : split_list(v)) a.tokens.push_back(std::stoll(t));
      } else usage("unknown option " + k);
    } catch (const std::invalid_argument&) {
      usage(k + ": not a number: \"" + v + "\"");
    }
  }
  if (a.reps < 1) usage("--reps: must be >= 1, got " + std::to_string(a.reps));
  if (a.seq_scale < 1 || a.seq_scale > 64) usage("--seq-scale: must be in 1..64, got " + std::to_string(a.seq_scale));
  for (const std::string& c : a.comms)
    if (c != "p2p" && c != "all_gather" && c != "a2a" && c != "a2a+p2p") usage("--comms: unknown comm type \"" + c + "\"");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a log even if a guard stops the run
  const Args args = parse(argc, argv);
  const int devices = gpu::cuda_device_count();
  if (devices == 0) {
    std::fprintf(stderr, "bench_cp_nccl: no CUDA device\n");
    return 2;
  }
  const int gpus = args.gpus > 0 ? std::min(args.gpus, devices) : devices;
  std::vector<int> sizes;
  for (int W = 2; W <= gpus; W *= 2) sizes.push_back(W);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %d x %s; NCCL %s, NCCL_NVLS_ENABLE=0, CTA policy %s; causal varlen (lengths cycling %d..%d), "
              "bf16, h=%d, d=%d, atomic backward; median of %d after %d warm-ups\n",
              gpus, prop.name, gpu::nccl_version().c_str(), std::string(gpu::nccl_cta_policy_name(args.cta_policy)).c_str(),
              512 * args.seq_scale, 4096 * args.seq_scale, args.heads, args.dim, args.reps, args.warmups);
  std::printf("physical limits: bf16 dense peak %.0f TFLOP/s per GPU (specification)\n", kBf16DensePeakTflops);

  struct Row {
    int64_t tokens;
    std::string path;
    int W;
    bool backward;
    Measured m;
    double ref_ms;      // one GPU, one call over the W-rank batch, divided by W
    double flops;       // per GPU
    double ring_bytes;  // bytes each rank sends per run
  };
  std::vector<Row> rows;
  std::map<int, double> ring_gbps;
  for (const int64_t tokens : args.tokens) {
    for (const int W : [&] { std::vector<int> all{1}; all.insert(all.end(), sizes.begin(), sizes.end()); return all; }()) {
      const std::vector<int32_t> global = varlen_lengths(tokens * W, args.seq_scale);
      check(cudaSetDevice(0), "cudaSetDevice");
      const sim::CaseSpec one = bench::causal_varlen_case(global, 1, sim::CommType::p2p, args.heads, args.dim);
      const auto [fwd, both] = single_gpu_ms(one, args.warmups, args.reps);
      const double ref[2] = {fwd / W, both / W};
      double flops[2];
      for (int b = 0; b < 2; ++b) flops[b] = causal_flops(global, args.heads, args.dim, b != 0) / W;
      for (int b = 0; b < 2; ++b)
        rows.push_back({tokens, "1 GPU, one call over the W-rank batch, / W", W, b != 0, {ref[b], 0, 0}, ref[b], flops[b], 0});
      if (W == 1) {
        for (int b = 0; b < 2; ++b)
          rows.push_back({tokens, "CP program W=1", 1, b != 0, program_w1(one, b != 0, args.warmups, args.reps), ref[b], flops[b], 0});
        continue;
      }
      const sim::CaseInputs inputs = bench_inputs(bench::causal_varlen_case(global, W, sim::CommType::p2p, args.heads, args.dim));
      std::vector<sim::Plan> plans;
      for (const std::string& c : args.comms) {
        sim::CaseSpec s = bench::causal_varlen_case(global, W, sim::parse_comm(c), args.heads, args.dim);
        s.a2a_size = std::min(W, 2);
        plans.push_back(sim::make_plan(s));
      }
      // [comm][backward][rank][rep]
      std::vector<std::vector<std::vector<std::vector<gpu::RankTimes>>>> times(
          plans.size(), std::vector<std::vector<std::vector<gpu::RankTimes>>>(
                            2, std::vector<std::vector<gpu::RankTimes>>(static_cast<size_t>(W))));
      const bool measure_bandwidth = !ring_gbps.count(W);
      std::vector<double> gbps(static_cast<size_t>(W));
      gpu::RankLaunch launch;
      launch.launch = "threads";
      launch.ranks = W;
      launch.timeout = gpu::Seconds(120);
      const int code = gpu::run_ranks(launch, [&](gpu::RankContext& context) {
        const int r = context.channel.rank();
        gpu::CommOptions comm_options;
        comm_options.timeout = std::chrono::seconds(120);
        auto comm = gpu::NcclCommunicator::create(context.channel, context.device, comm_options, args.cta_policy);
        if (measure_bandwidth)
          gbps[static_cast<size_t>(r)] = ring_shift_gbps(*comm, context.channel, args.bandwidth_bytes, args.reps);
        for (size_t c = 0; c < plans.size(); ++c)
          for (int backward = 0; backward < 2; ++backward) {
            gpu::CpGpuOptions options;
            options.backward = backward != 0;
            options.time_exchanges = true;
            gpu::RankCpExecutor ex(plans[c], inputs, DType::bf16, *comm, options);
            auto& mine = times[c][static_cast<size_t>(backward)][static_cast<size_t>(r)];
            for (int i = 0; i < args.warmups + args.reps; ++i) {
              context.channel.all_gather("", "rep barrier", context.timeout);
              const gpu::RankRun run = ex.run(false);
              if (i >= args.warmups) mine.push_back(run.times);
            }
          }
        return 0;
      });
      if (code != 0) {
        std::fprintf(stderr, "bench_cp_nccl: W=%d failed (exit %d)\n", W, code);
        return code;
      }
      if (measure_bandwidth) ring_gbps[W] = *std::min_element(gbps.begin(), gbps.end());
      for (size_t c = 0; c < plans.size(); ++c)
        for (int backward = 0; backward < 2; ++backward) {
          // Ring bytes per rank: KV (bf16) per step; in the backward also the float32 dKV. all_gather: K and V of
          // every other rank, twice with the backward, plus the dK/dV reduce-scatter in float32.
          const double kv = 2.0 * tokens * args.heads * args.dim * 2;
          const double steps = W - 1;
          double bytes = args.comms[c] == "all_gather" ? steps * kv * (backward ? 2 + 2 : 1)
                                                       : steps * (backward ? kv + kv + 2 * kv : kv);
          rows.push_back({tokens, args.comms[c], W, backward != 0, summarise(times[c][static_cast<size_t>(backward)]),
                          ref[backward], flops[backward], bytes});
        }
    }
  }
  for (const auto& [W, g] : ring_gbps)
    std::printf("physical limits: NVLink ring shift W=%d (plain ncclSend/ncclRecv of %zu MiB per rank, the slowest "
                "rank): %.1f GB/s per GPU per direction\n",
                W, args.bandwidth_bytes >> 20, g);
  std::printf("\n| tokens/rank | path | W | pass | slowest rank ms | TFLOP/s per GPU | share of peak | CP efficiency "
              "(1 GPU ms / W / slowest ms) | exchanges ms | exposed ms | hidden | ring MB/rank | ms at measured NVLink "
              "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    const double tflops = row.flops / (row.m.slowest_ms * 1e-3) / 1e12;
    std::printf("| %lld | %s | %d | %s | %.3f | %.1f | %.1f%% | %.2f |", static_cast<long long>(row.tokens),
                row.path.c_str(), row.W, row.backward ? "fwd+bwd" : "fwd", row.m.slowest_ms, tflops,
                100.0 * tflops / kBf16DensePeakTflops, row.ref_ms / row.m.slowest_ms);
    if (row.ring_bytes > 0) {
      const double hidden = row.m.comm_ms > 0 ? 1.0 - row.m.exposed_ms / row.m.comm_ms : 0.0;
      std::printf(" %.3f | %.3f | %.0f%% | %.0f | %.3f |\n", row.m.comm_ms, row.m.exposed_ms, 100.0 * hidden,
                  row.ring_bytes / 1e6, row.ring_bytes / (ring_gbps[row.W] * 1e9) * 1e3);
    } else {
      std::printf(" - | - | - | - | - |\n");
    }
  }
  return 0;
}
