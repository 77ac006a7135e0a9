// `cpgold verify FIXTURE... [--dump FILE] [--deterministic]`: runs the GPU non-CP path (gpu/attention.hpp) on each
// fixture's inputs and checks O, LSE, dQ, dK, dV with the engine of `cpgold check`, printing the same table.
// A fixture outside the GPU capability table is reported UNSUPPORTED with the reason, never passed.
// Exit codes: 0 every fixture passed; 1 a fixture failed or was unsupported; 2 unusable input or no GPU.
// `--dump FILE` (one fixture) writes the GPU outputs as a candidate file that `cpgold check` accepts.
#include <cstdio>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/command_registry.hpp"
#include "reference/input_error.hpp"

#if CPGOLD_HAVE_CUDA
#include "fixtures/check.hpp"
#include "gpu/attention.hpp"
#include "gpu/fixture_verify.hpp"
#endif

namespace cpgold::app {
namespace {

struct VerifyArgs {
  std::vector<std::string> fixtures;
  std::string dump;
  std::string format = "text";
  bool deterministic = false;
};

#if CPGOLD_HAVE_CUDA

gpu::FixtureVerdict verify_one(const std::string& path, const VerifyArgs& args, const std::string& dump_path) {
  const gpu::FixtureVerification result = gpu::verify_fixture(
      path, args.deterministic ? gpu::BackwardMode::deterministic : gpu::BackwardMode::atomic, dump_path);
  if (result.verdict == gpu::FixtureVerdict::unsupported) {
    std::cout << "fixture    " << path << "\nUNSUPPORTED on the GPU: " << result.unsupported_reason << "\n\n";
    return result.verdict;
  }
  if (args.format == "json") std::cout << fx::to_json(*result.report).dump(2) << "\n";
  else std::cout << fx::render_text(*result.report) << "\n";
  return result.verdict;
}

int run_verify(const VerifyArgs& args) {
  if (args.format != "text" && args.format != "json") fail_input("--format", "expected text or json, got \"", args.format, "\"");
  if (!args.dump.empty() && args.fixtures.size() != 1)
    fail_input("--dump", "writes the outputs of one fixture; got ", args.fixtures.size(), " fixtures");
  if (gpu::cuda_device_count() == 0) fail_input("verify", "no CUDA device (the GPU path needs one)");
  int passed = 0, failed = 0, unsupported = 0;
  namespace fs = std::filesystem;
  for (const std::string& path : args.fixtures) {
    std::string dump = args.dump;
    bool temporary = false;
    if (dump.empty()) {
      dump = (fs::temp_directory_path() / ("cpgold-verify-" + std::to_string(::getpid()) + ".h5")).string();
      temporary = true;
    }
    gpu::FixtureVerdict verdict;
    try {
      verdict = verify_one(path, args, dump);
    } catch (...) {
      if (temporary) fs::remove(dump);
      throw;
    }
    if (temporary) fs::remove(dump);
    (verdict == gpu::FixtureVerdict::pass ? passed : verdict == gpu::FixtureVerdict::fail ? failed : unsupported) += 1;
  }
  std::printf("verify: %d passed, %d failed, %d unsupported (of %zu fixtures; backward mode %s)\n", passed, failed,
              unsupported, args.fixtures.size(), args.deterministic ? "deterministic" : "atomic");
  return failed == 0 && unsupported == 0 ? kExitPass : kExitFail;
}

#else

int run_verify(const VerifyArgs&) {
  fail_input("verify", "this cpgold was built without CUDA (no nvcc at configure time)");
}

#endif

const RegisterCommand registered("verify", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand("verify", "run the GPU non-CP path on fixtures and check it like `cpgold check`");
  auto args = std::make_shared<VerifyArgs>();
  sub->add_option("fixtures", args->fixtures, "FIXTURE... (golden HDF5 files)")->required();
  sub->add_option("--dump", args->dump, "write the GPU outputs as a candidate file (one fixture)");
  sub->add_option("--format", args->format, "text or json");
  sub->add_flag("--deterministic", args->deterministic, "bitwise reproducible backward (dQ by a separate pass)");
  return [=] { return run_verify(*args); };
});

}  // namespace
}  // namespace cpgold::app
