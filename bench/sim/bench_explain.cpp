// explain on large layouts: time and peak memory (maxrss) of the summary (partition only) and of the full plan
// rendering, each measured in its own child process so that every maxrss belongs to one measurement.
// Usage: bench_explain [sequences=10000] [cp_size=64]
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "bench/bench_clock.hpp"
#include "sim/explain/explain.hpp"
#include "sim/explain/explain_summary.hpp"
#include "sim/plan/plan.hpp"

using namespace cpgold;
using namespace cpgold::sim;

namespace {

CaseSpec layout_of(int sequences, int length, int cp_size) {
  CaseSpec spec;
  spec.seqlens_q.assign(static_cast<size_t>(sequences), length);
  spec.causal = true;
  spec.cp_size = cp_size;
  validate_case(spec);
  return spec;
}

// Runs `work` in a child; prints wall seconds (measured in the child) and the child's maxrss.
void measure(const std::string& what, const CaseSpec& spec, const std::function<size_t()>& work) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) std::abort();
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(pipe_fds[0]);
    const auto t0 = std::chrono::steady_clock::now();
    const size_t bytes = work();
    const double seconds = bench::seconds_since(t0);
    char line[128];
    const int n = std::snprintf(line, sizeof line, "%.3f %zu", seconds, bytes);
    if (::write(pipe_fds[1], line, static_cast<size_t>(n)) != n) ::_exit(1);
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  char line[128] = {};
  const ssize_t got = ::read(pipe_fds[0], line, sizeof line - 1);
  ::close(pipe_fds[0]);
  int status = 0;
  rusage usage{};
  ::wait4(child, &status, 0, &usage);
  double seconds = -1;
  size_t bytes = 0;
  if (got > 0) std::sscanf(line, "%lf %zu", &seconds, &bytes);
  std::printf("%-28s %7zu %5d %12lld %9.3f %10.1f %12zu\n", what.c_str(), spec.seqlens_q.size(), spec.cp_size,
              static_cast<long long>(plan_units(spec)), seconds, usage.ru_maxrss / 1024.0, bytes);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int sequences = argc > 1 ? std::atoi(argv[1]) : 10000;
  const int cp_size = argc > 2 ? std::atoi(argv[2]) : 64;
  std::printf("explain of causal layouts of 100-token sequences (load %s)\n", bench::load_average().c_str());
  std::printf("%-28s %7s %5s %12s %9s %10s %12s\n", "rendering", "seqs", "W", "W*W*seqs", "seconds", "maxrss MB",
              "output bytes");
  const CaseSpec big = layout_of(sequences, 100, cp_size);
  measure("summary text+svg+json", big, [&] {
    const LayoutSummary s = summarize_layout(big);
    return summary_text(big, s).size() + summary_svg(big, s).size() + summary_json(big, s).dump().size();
  });
  for (int n : {125, 250, 500}) {
    const CaseSpec spec = layout_of(n, 100, cp_size);
    measure("full plan + text", spec, [&] {
      const Plan plan = make_plan(spec);
      return explain_text(spec, plan).size();
    });
  }
  for (int w : {32, 64, 128}) {
    const CaseSpec spec = layout_of(1, 10, w);
    measure("full plan + text + json", spec, [&] {
      const Plan plan = make_plan(spec);
      return explain_text(spec, plan).size() + explain_json(spec, plan).dump().size();
    });
  }
  return 0;
}
