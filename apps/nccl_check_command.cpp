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
  RankLaunchOptions launch;
};

#if CPGOLD_HAVE_NCCL

int run_nccl_check(const NcclCheckArgs& args) {
  const gpu::ExchangeFault fault = gpu::parse_exchange_fault(args.inject_failure);
  const gpu::ExchangeCheckRun run{args.a2a_size, fault, args.inject_mismatch};
  return gpu::run_ranks(rank_launch(args.launch), [&](gpu::RankContext& context) {
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

int run_nccl_check(const NcclCheckArgs&) {
  fail_not_built("nccl-check", "NCCL", "no CUDA, no NCCL or no GPU", "they were found");
}

#endif

void add_nccl_check_options(CLI::App& sub, NcclCheckArgs& args) {
  sub.add_option("--a2a-size", args.a2a_size, "ranks per a2a group for the a2a+p2p exchanges (default 2)");
  sub.add_option("--inject-failure", args.inject_failure,
                 "self-test of the fault path: RANK:KIND (exception, cuda, input) fails that rank before the all-gather");
  sub.add_option("--inject-mismatch", args.inject_mismatch,
                 "self-test of the case agreement: that rank describes another case");
  add_rank_launch_options(sub, args.launch);
}

const RegisterCommand registered("nccl-check",
                                 "coded values through every NCCL exchange of the CP comm types, checked bit for bit",
                                 add_nccl_check_options, run_nccl_check);

}  // namespace
}  // namespace cpgold::app
