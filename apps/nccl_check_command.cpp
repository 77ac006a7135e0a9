// `cpgold nccl-check [--a2a-size A] [launch options] [--inject-failure RANK:KIND] [--inject-mismatch RANK]`:
// pushes coded-value tensors through every NCCL exchange of the CP comm types on W GPUs and checks each element
// against the expected global row (gpu/verify/nccl_exchange_check.hpp). Rank 0 prints one table and one verdict line.
// The --inject options are a self-test of the fault path: a rank that throws, hits a CUDA error or reports bad
// input, or that was given another case; every rank must then exit non-zero naming the cause within --timeout.
// Exit codes: 0 every element arrived where it belongs; 1 a wrong element; 2 bad input (a case mismatch too);
// 3 a rank failed (this rank's error names the failing rank).
#include <cstdio>
#include <memory>
#include <string>

#include "apps/command_registry.hpp"
#include "apps/rank_launch_options.hpp"
#include "reference/input_error.hpp"

#if CPGOLD_HAVE_NCCL
#include "gpu/comm/nccl_communicator.hpp"
#include "gpu/comm/nccl_ranks.hpp"
#include "gpu/verify/nccl_exchange_check.hpp"
#endif

namespace cpgold::app {
namespace {

struct NcclCheckArgs {
  int a2a_size = 2;
  std::string inject_failure;  // RANK:KIND
  int inject_mismatch = -1;
};

#if CPGOLD_HAVE_NCCL

int run_nccl_check(const NcclCheckArgs& args, const RankLaunchOptions& options) {
  const gpu::ExchangeFault fault = gpu::parse_exchange_fault(args.inject_failure);
  gpu::RankLaunch launch{options.launch, options.ranks,  options.rendezvous,         options.rank,
                         options.world_size, options.device, gpu::Seconds(options.timeout_s)};
  const gpu::ExchangeCheckRun run{args.a2a_size, fault, args.inject_mismatch};
  return gpu::run_ranks(launch, [&](gpu::RankContext& context) {
    const gpu::ExchangeVerdict verdict = gpu::run_exchange_check(context, run);
    if (context.channel.rank() == 0) {
      std::printf("nccl-check: NCCL %s, %d ranks (%s), a2a_size %d, coded 64-bit values (origin rank, global row, head, dim)\n",
                  gpu::nccl_version().c_str(), context.channel.size(), context.channel.transport().c_str(), args.a2a_size);
      std::printf("rank exchange                                   elements    wrong  first wrong\n%s", verdict.table.c_str());
      std::printf("VERDICT nccl-check W=%d: %s (%lld exchanges, %lld elements, %lld wrong)\n", context.channel.size(),
                  verdict.pass() ? "PASS" : "FAIL", static_cast<long long>(verdict.exchanges),
                  static_cast<long long>(verdict.elements), static_cast<long long>(verdict.wrong));
      std::fflush(stdout);
    }
    return verdict.pass() ? kExitPass : kExitFail;
  });
}

#else

int run_nccl_check(const NcclCheckArgs&, const RankLaunchOptions&) {
  fail_input("nccl-check", "this cpgold was built without NCCL (no CUDA, no NCCL or no GPU at configure time; "
                       "build/bin/cpgold-gpu has it where they were found, or configure with -DCPGOLD_ENABLE_CUDA=ON)");
}

#endif

const RegisterCommand registered("nccl-check", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand("nccl-check", "coded values through every NCCL exchange of the CP comm types, checked bit for bit");
  auto args = std::make_shared<NcclCheckArgs>();
  auto launch = std::make_shared<RankLaunchOptions>();
  sub->add_option("--a2a-size", args->a2a_size, "ranks per a2a group for the a2a+p2p exchanges (default 2)");
  sub->add_option("--inject-failure", args->inject_failure,
                  "self-test of the fault path: RANK:KIND (exception, cuda, input) fails that rank before the all-gather");
  sub->add_option("--inject-mismatch", args->inject_mismatch,
                  "self-test of the case agreement: that rank describes another case");
  add_rank_launch_options(sub, launch);
  return [=] { return run_nccl_check(*args, *launch); };
});

}  // namespace
}  // namespace cpgold::app
