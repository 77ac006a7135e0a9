// `cpgold verify FIXTURE... [--dump FILE] [--deterministic]`: runs the GPU non-CP path (gpu/kernels/attention/attention.hpp) on
// each fixture's inputs and checks O, LSE, dQ, dK, dV with the engine of `cpgold check`, printing the same table.
// A fixture outside the GPU capability table is reported UNSUPPORTED with the reason, never passed.
// Exit codes: 0 every fixture passed; 1 a fixture failed or was unsupported; 2 unusable input or no GPU; 5 none failed
// and a fixture of another engine than the CPU reference could not decide (fx::CheckReport::undecided).
// `--dump FILE` (one fixture) writes the GPU outputs as a candidate file that `cpgold check` accepts.
// `--backend local`: runs each fixture's CP comm type with W virtual ranks on one GPU (gpu/cp/cp_executor.hpp) and
// checks every rank's outputs, the gathered outputs and, for traced fixtures, every step's partials.
// `--inject rank,step` (with --backend local): self-test of the checker; corrupts that step's forward partial.
// `--backend nccl`: one GPU per rank (gpu/verify/nccl_verify.hpp), ranks started as threads, by mpirun or through a
// shared folder (apps/rank_launch_options.hpp); every rank checks its own outputs, rank 0 prints one table per fixture.
// `--inject-failure RANK:KIND` / `--inject-mismatch RANK` (with --backend nccl): self-tests of the fault contract.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "apps/rank_launch_options.hpp"
#include "fixtures/storage/output_file.hpp"
#include "reference/input_error.hpp"

#if CPGOLD_HAVE_CUDA
#include "check/engine.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "gpu/verify/fixture_verify.hpp"
#endif
#if CPGOLD_HAVE_NCCL
#include "gpu/cp/cp_executor.hpp"
#include "gpu/verify/nccl_verify.hpp"
#endif

namespace cpgold::app {
namespace {

struct VerifyArgs {
  std::vector<std::string> fixtures;
  std::string dump;
  bool force = false;  // --dump may replace an existing regular file
  std::string format = "text";
  bool deterministic = false;
  std::string backend;  // empty: the non-CP path; "local": CP with W ranks on one GPU
  std::string inject;   // "rank,step"
  std::string inject_failure;  // --backend nccl: "RANK:KIND"
  int inject_mismatch = -1;    // --backend nccl
  RankLaunchOptions launch;    // --backend nccl
};

#if CPGOLD_HAVE_CUDA
std::optional<gpu::StepRef> parse_inject(const std::string& text) {
  if (text.empty()) return std::nullopt;
  const size_t comma = text.find(',');
  gpu::StepRef ref;
  try {
    if (comma == std::string::npos) throw std::invalid_argument("no comma");
    size_t used = 0;
    ref.rank = std::stoi(text.substr(0, comma), &used);
    if (used != comma) throw std::invalid_argument("rank");
    const std::string step = text.substr(comma + 1);
    ref.step = std::stoi(step, &used);
    if (used != step.size()) throw std::invalid_argument("step");
  } catch (const std::exception&) {
    fail_input("--inject", "expected RANK,STEP (two integers), got \"", text, "\"");
  }
  return ref;
}
#endif

#if CPGOLD_HAVE_CUDA

gpu::FixtureVerdict verify_one(const std::string& path, const VerifyArgs& args, const std::string& dump_path) {
  const gpu::BackwardMode mode = args.deterministic ? gpu::BackwardMode::deterministic : gpu::BackwardMode::atomic;
  const gpu::FixtureVerification result =
      args.backend == "local" ? gpu::verify_fixture_local(path, mode, dump_path, parse_inject(args.inject))
                              : gpu::verify_fixture(path, mode, dump_path);
  if (result.verdict == gpu::FixtureVerdict::unsupported) {
    std::cout << "fixture    " << path << "\nUNSUPPORTED on the GPU: " << result.unsupported_reason << "\n\n";
    return result.verdict;
  }
  // The forward kernel of the GPU run (docs/gpu-kernels.md, "Forward kernels"); on stderr with --format json.
  if (!result.forward_kernel.empty())
    (args.format == "json" ? std::cerr : std::cout) << "forward kernel: " << result.forward_kernel << "\n";
  // The backward kernel (docs/gpu-kernels.md, "Backward kernels"), likewise.
  if (!result.backward_kernel.empty())
    (args.format == "json" ? std::cerr : std::cout) << "backward kernel: " << result.backward_kernel << "\n";
  if (args.format == "json") std::cout << json_text(fx::to_json(*result.report));
  else std::cout << fx::render_text(*result.report) << "\n";
  return result.verdict;
}

#if CPGOLD_HAVE_NCCL
int run_verify_nccl(const VerifyArgs& args) {
  if (args.format != "text") fail_input("--format", "--backend nccl prints text (rank 0's combined table)");
  if (!args.dump.empty()) fail_input("--dump", "not with --backend nccl: every rank checks its own outputs");
  if (!args.inject.empty()) fail_input("--inject", "needs --backend local");
  gpu::NcclVerifyOptions options;
  options.mode = args.deterministic ? gpu::BackwardMode::deterministic : gpu::BackwardMode::atomic;
  options.inject_failure = gpu::parse_exchange_fault(args.inject_failure);
  options.inject_mismatch = args.inject_mismatch;
  return gpu::verify_fixtures_nccl(args.fixtures, options, rank_launch(args.launch),
                                   [](const sim::Plan& plan, const sim::CaseInputs& inputs, int rank,
                                      gpu::Communicator& comm, DType dtype, gpu::BackwardMode mode) {
                                     gpu::CpGpuOptions cp;
                                     cp.mode = mode;
                                     return gpu::run_cp_rank(plan, inputs, dtype, comm, cp).outputs;
                                   });
}
#endif

int run_verify(const VerifyArgs& args) {
  if (args.format != "text" && args.format != "json") fail_input("--format", "expected text or json, got \"", args.format, "\"");
  if (!args.dump.empty() && args.fixtures.size() != 1)
    fail_input("--dump", "writes the outputs of one fixture; got ", args.fixtures.size(), " fixtures");
  if (args.force && args.dump.empty()) fail_input("--force", "replaces the --dump file only: give --dump FILE");
  // The dump's destination by gen's rules, before any work (fx::check_destination).
  if (!args.dump.empty()) fx::check_destination(args.dump, args.force);
  if (!args.backend.empty() && args.backend != "local" && args.backend != "nccl")
    fail_input("--backend", "expected local or nccl, got \"", args.backend, "\"");
  if ((!args.inject_failure.empty() || args.inject_mismatch >= 0) && args.backend != "nccl")
    fail_input("--inject-failure", "the fault self-tests need --backend nccl");
#if CPGOLD_HAVE_NCCL
  if (args.backend == "nccl") return run_verify_nccl(args);
#else
  if (args.backend == "nccl") fail_input("--backend", "nccl: this cpgold was built without NCCL");
#endif
  if (!args.inject.empty() && args.backend != "local") fail_input("--inject", "needs --backend local");
  parse_inject(args.inject);
  if (gpu::cuda_device_count() == 0) fail_input("verify", "no CUDA device (the GPU path needs one)");
  gpu::VerdictCounts counts;
  namespace fs = std::filesystem;
  // Candidates the check reads back go to a private folder of this process (mkdtemp: nothing of another user's is
  // followed or replaced); --dump goes through a hidden temporary file moved into place at the end.
  std::string scratch = (fs::temp_directory_path() / "cpgold-verify-XXXXXX").string();
  if (!::mkdtemp(scratch.data())) fail_input(scratch, "cannot create a temporary folder (", std::strerror(errno), ")");
  struct RemoveScratch {
    std::string path;
    ~RemoveScratch() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } remove_scratch{scratch};
  for (const std::string& path : args.fixtures) {
    std::optional<fx::PartialFile> partial;
    if (!args.dump.empty()) partial.emplace(args.dump, args.force);
    const std::string dump = partial ? partial->path() : (fs::path(scratch) / "candidate.h5").string();
    const gpu::FixtureVerdict verdict = verify_one(path, args, dump);
    if (partial) partial->commit();
    else fs::remove(dump);
    counts.add(verdict);
  }
  std::printf("verify: %s; %s; backward mode %s)\n", counts.summary(args.fixtures.size()).c_str(),
              args.backend == "local" ? "CP, W ranks on one GPU" : "non-CP GPU path",
              args.deterministic ? "deterministic" : "atomic");
  return counts.exit_code();
}

#else

int run_verify(const VerifyArgs&) {
  fail_not_built("verify", "the GPU layer", "no nvcc, or no GPU found,", "nvcc was found");
}

#endif

void add_verify_options(CLI::App& sub, VerifyArgs& args) {
  sub.add_option("fixtures", args.fixtures, "FIXTURE... (golden HDF5 files)")->required();
  sub.add_option("--dump", args.dump, "write the GPU outputs as a candidate file (one fixture)");
  sub.add_flag("--force", args.force, "with --dump: replace an existing file (a regular file only)");
  sub.add_option("--format", args.format, "text or json");
  sub.add_flag("--deterministic", args.deterministic, "bitwise reproducible backward (dQ by a separate pass)");
  sub.add_option("--backend", args.backend,
                 "local: run the fixture's CP comm type with W ranks on one GPU and check ranks and steps; "
                 "nccl: one GPU per rank through NCCL, every rank checks its own outputs");
  sub.add_option("--inject", args.inject,
                 "RANK,STEP (with --backend local): self-test of the checker, corrupts that forward partial");
  sub.add_option("--inject-failure", args.inject_failure,
                 "RANK:KIND (with --backend nccl; KIND exception, cuda, input): self-test, that rank fails before its first exchange");
  sub.add_option("--inject-mismatch", args.inject_mismatch,
                 "RANK (with --backend nccl): self-test, that rank describes another case");
  add_rank_launch_options(sub, args.launch);
}

const RegisterCommand registered("verify", "run the GPU non-CP path on fixtures and check it like `cpgold check`",
                                 add_verify_options, run_verify);

}  // namespace
}  // namespace cpgold::app
