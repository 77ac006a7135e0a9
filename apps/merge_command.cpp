// `cpgold merge PART... -o FIXTURE`: the parts of a fixture computed in shards (`cpgold gen CASE --shard I/N -o PART`)
// put together into the fixture, bit for bit the one `cpgold gen CASE -o FIXTURE` writes (fixtures/golden/fixture_part.hpp).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "apps/command_registry.hpp"
#include "fixtures/golden/fixture_part.hpp"
#include "fixtures/golden/generate_admission.hpp"

namespace cpgold::app {
namespace {

struct MergeArgs {
  std::vector<std::string> parts;
  std::string output;
  bool force = false, yes = false;
};

int run_merge(const MergeArgs& args) {
  const auto start = std::chrono::steady_clock::now();
  fx::MergeOptions options;
  options.force = args.force;
  options.yes = args.yes;
  options.log = [](const std::string& line) {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  };
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(start);
  options.progress = [last](int64_t written, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - *last).count() < 5) return;
    *last = now;
    std::fprintf(stderr, "  merge: %.0f%% written\n", total > 0 ? 100.0 * double(written) / double(total) : 0.0);
    std::fflush(stderr);
  };
  const fx::MergeSummary summary = fx::merge_parts(args.parts, args.output, options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("merged %d part(s) into %s: %s, %d datasets in %.1fs\n", summary.parts, summary.written.path.c_str(),
              fx::human_bytes(double(summary.written.bytes)).c_str(), summary.written.datasets, seconds);
  return kExitPass;
}

const RegisterCommand registered("merge", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand(
      "merge", "put the parts of a fixture computed in shards (gen --shard I/N) together into the fixture");
  auto args = std::make_shared<MergeArgs>();
  sub->add_option("parts", args->parts, "the part files (all N of one case, in any order)")->required();
  sub->add_option("-o,--output", args->output, "the fixture to write")->required();
  sub->add_flag("--force", args->force, "replace an existing fixture (a regular file only)");
  sub->add_flag("--yes", args->yes, "go ahead although the memory estimate exceeds what is available");
  return [=] { return run_merge(*args); };
});

}  // namespace
}  // namespace cpgold::app
