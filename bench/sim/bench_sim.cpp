// Simulated CP (float64 oracle, p2p ring of W simulated ranks) against the plain float64 reference on the same case:
// the time ratio is the overhead of the simulation (sharding, read_half copies, per-step merges, message copies).
// Prints one table; numbers go to lab/records/perf.md under "## sim".
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>

#include "bench/bench_clock.hpp"
#include "reference/attention.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/program/executor.hpp"

using namespace cpgold;
using namespace cpgold::sim;

using namespace cpgold::bench;

namespace {
// One path the table times: its name and one forward + backward run.
struct Path {
  const char* name;
  std::function<void()> run;
};

std::vector<int32_t> parse_list(const std::string& text) {
  std::vector<int32_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  std::string lengths = "1500,700,1100,400", comm = "p2p", mask = "causal";
  int W = 4, heads = 8, dim = 64, reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--lengths") lengths = v;
    else if (a == "--cp-size") W = std::stoi(v);
    else if (a == "--heads") heads = std::stoi(v);
    else if (a == "--dim") dim = std::stoi(v);
    else if (a == "--comm") comm = v;
    else if (a == "--mask") mask = v;
    else if (a == "--reps") reps = std::stoi(v);
    else {
      std::fprintf(stderr, "usage: bench_sim [--lengths a,b,..] [--cp-size W] [--heads h] [--dim d] [--comm c] [--mask m] [--reps n]\n");
      return 2;
    }
  }
  CaseSpec s;
  s.seqlens_q = parse_list(lengths);
  s.cp_size = W;
  s.comm = parse_comm(comm);
  s.causal = mask == "causal";
  s.window = normalize_window(s.causal, {});
  s.heads_q = heads;
  s.dim_qk = dim;
  s.dtype = DType::fp32;
  s.a2a_size = 2;
  const Plan plan = make_plan(s);
  const CaseInputs in = make_case_inputs(s);
  // The reference: one attention call over the whole layout, on float64 copies of the inputs made before the timing.
  const AttentionCall call = non_cp_call(layout(s), mask_window(s), softmax_scale(s));
  const auto q = tensor_cast<double>(in.q), k = tensor_cast<double>(in.k), v = tensor_cast<double>(in.v),
             dout = tensor_cast<double>(in.dout);
  const Path paths[3] = {
      {"reference (non-CP)",
       [&] {
         const auto f = attention_forward(call, q, k, v);
         (void)attention_backward(call, q, k, v, f.o, f.lse, dout);
       }},
      {"simulated CP", [&] { (void)run_cp_oracle(plan, in, {true, false}); }},
      {"simulated CP with sim::Trace", [&] { (void)run_cp_oracle(plan, in, {true, true}); }},
  };

  // Best of `reps` for wall time and CPU time separately, the three paths interleaved so load changes hit all.
  double best[3] = {1e30, 1e30, 1e30}, best_cpu[3] = {1e30, 1e30, 1e30};
  for (int r = 0; r < reps; ++r)
    for (int path = 0; path < 3; ++path) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      paths[path].run();
      best[path] = std::min(best[path], seconds_since(t0));
      best_cpu[path] = std::min(best_cpu[path], cpu_seconds() - c0);
    }
  std::printf("case: %s\n", normalized_json(s).c_str());
  std::printf("best of %d, forward + backward, float64\n", reps);
  std::printf("| path | wall s | wall ratio | CPU s | CPU ratio |\n|---|---|---|---|---|\n");
  for (int path = 0; path < 3; ++path)
    std::printf("| %s%s | %.3f | %.2f | %.3f | %.2f |\n", paths[path].name,
                path ? (" " + comm + " W=" + std::to_string(W)).c_str() : "", best[path], best[path] / best[0],
                best_cpu[path], best_cpu[path] / best_cpu[0]);
  return 0;
}
