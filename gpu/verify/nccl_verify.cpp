// verify_fixture_on_rank: agree, run this rank, check it here, one report on rank 0 (see the header).
#include "gpu/verify/nccl_verify.hpp"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <sstream>

#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "gpu/comm/case_agreement.hpp"
#include "gpu/comm/nccl_communicator.hpp"
#include "gpu/verify/rank_check.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::gpu {
namespace {

// HDF5 as Debian and most distributions build it is not thread-safe: the ranks of a threads launch take turns
// at every file access (reading the fixture, writing and checking the candidate); their GPU work overlaps.
std::mutex hdf5_mutex;

// Rank 0 prints; every rank learns the verdict. reason: why the fixture is unsupported ("" when it ran).
void print_unsupported(int rank, const std::string& path, const std::string& reason) {
  if (rank != 0) return;
  std::printf("fixture    %s\nUNSUPPORTED on the GPU: %s\n\n", path.c_str(), reason.c_str());
  std::fflush(stdout);
}

// FNV-1a over the bits of O, LSE, dQ, dK and dV in that order: equal digests on a rerun mean the same bits.
uint64_t outputs_digest(const sim::RankOutputs<float>& out) {
  uint64_t h = 1469598103934665603ull;
  auto add = [&](const std::vector<float>& values) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
    for (size_t i = 0; i < values.size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  };
  add(out.o.values);
  add(out.lse.values);
  add(out.dq.values);
  add(out.dk.values);
  add(out.dv.values);
  return h;
}

}  // namespace

FixtureVerdict verify_fixture_on_rank(RankContext& context, Communicator& comm, const std::string& fixture_path,
                                      const NcclVerifyOptions& options, const RankRunner& run) {
  RankChannel& channel = context.channel;
  const int rank = channel.rank(), world = channel.size();
  // Read under the lock, the file closed before it is released.
  auto [fixture, inputs] = [&] {
    std::lock_guard lock(hdf5_mutex);
    const fx::h5::Reader reader(fixture_path);
    fx::FixtureFile file = fx::open_fixture(reader, fx::OpenOptions{false});
    sim::CaseInputs tensors = read_fixture_inputs(reader);
    return std::make_pair(std::move(file), std::move(tensors));
  }();
  // Everything the ranks must share: the case (layout, heads, dims, mask, comm type, W, seed), the run's options.
  std::ostringstream description;
  description << fixture.case_json << " | backend nccl, " << world << " ranks, backward "
              << (options.mode == BackwardMode::deterministic ? "deterministic" : "atomic");
  if (rank == options.inject_mismatch) description << " (self-test: a different case on this rank)";
  agree_on_case(channel, description.str(), fixture_path + (rank == options.inject_mismatch ? " (altered)" : ""),
                context.timeout);

  const sim::CaseSpec& spec = fixture.spec;
  AttentionShape shape{spec.dtype, spec.heads_q, sim::heads_kv(spec), spec.dim_qk, sim::dim_v(spec)};
  if (const Outcome cap = check_capability(shape); !cap.ok()) {
    print_unsupported(rank, fixture_path, std::string(status_name(cap.status)) + ": " + cap.message);
    return FixtureVerdict::unsupported;
  }
  if (fixture.plan.cp_size != world) {
    print_unsupported(rank, fixture_path, "cp_size " + std::to_string(fixture.plan.cp_size) + " needs as many ranks; this run has " +
                                              std::to_string(world));
    return FixtureVerdict::unsupported;
  }
  inject_fault(options.inject_failure, rank);  // self-test: before the first exchange of the run
  const sim::RankOutputs<float> outputs = run(fixture.plan, inputs, rank, comm, spec.dtype, options.mode);

  namespace fs = std::filesystem;
  const fs::path candidate = fs::temp_directory_path() /
                             ("cpgold-verify-nccl-" + std::to_string(::getpid()) + "-r" + std::to_string(rank) + ".h5");
  RankCheck check;
  try {
    std::lock_guard lock(hdf5_mutex);
    check = check_rank_outputs(fixture_path, rank, outputs, candidate.string());
  } catch (...) {
    fs::remove(candidate);
    throw;
  }
  fs::remove(candidate);
  const std::vector<std::string> all = channel.all_gather(serialise(check), "verdict gather", context.timeout);
  std::vector<RankCheck> checks;
  for (const std::string& bytes : all) checks.push_back(deserialise_rank_check(bytes));
  const bool pass = combined_pass(checks);
  char mine[32];
  std::snprintf(mine, sizeof(mine), "%016llx", static_cast<unsigned long long>(outputs_digest(outputs)));
  const std::vector<std::string> digests = channel.all_gather(mine, "output digest gather", context.timeout);
  if (rank == 0) {
    std::string line = "outputs digest (FNV-1a of the bits of O, LSE, dQ, dK, dV):";
    for (size_t r = 0; r < digests.size(); ++r) line += " rank " + std::to_string(r) + " " + digests[r];
    std::printf("%s\n%s\n", combined_report(fixture_path, checks).c_str(), line.c_str());
    std::fflush(stdout);
  }
  return pass ? FixtureVerdict::pass : combined_undecided(checks) ? FixtureVerdict::undecided : FixtureVerdict::fail;
}

int verify_fixtures_nccl(const std::vector<std::string>& fixtures, const NcclVerifyOptions& options,
                         const RankLaunch& launch, const RankRunner& run) {
  return run_ranks(launch, [&](RankContext& context) {
    CommOptions comm_options;
    comm_options.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(context.timeout);
    std::unique_ptr<NcclCommunicator> comm = NcclCommunicator::create(context.channel, context.device, comm_options);
    VerdictCounts counts;
    for (const std::string& path : fixtures) counts.add(verify_fixture_on_rank(context, *comm, path, options, run));
    if (context.channel.rank() == 0) {
      std::printf("verify: %s; backend nccl, %d ranks (%s), NCCL %s; backward mode %s)\n",
                  counts.summary(fixtures.size()).c_str(), context.channel.size(),
                  context.channel.transport().c_str(), nccl_version().c_str(),
                  options.mode == BackwardMode::deterministic ? "deterministic" : "atomic");
      std::fflush(stdout);
    }
    return counts.exit_code();
  });
}

}  // namespace cpgold::gpu
