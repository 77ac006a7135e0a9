// Multi-GPU layer: the rank channel and case agreement on the CPU (threads, shared folder), then the NCCL
// communicator on W GPUs (coded-value exchanges bit for bit; a failing rank and a mismatched case stop every rank
// with an error naming the cause, within the timeout). GPU cases print "SKIPPED: needs N CUDA devices" (or
// "SKIPPED: no CUDA device") where fewer GPUs are present.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu/comm/case_agreement.hpp"
#include "gpu/comm/nccl_ranks.hpp"
#include "gpu/comm/rank_channel.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "gpu/verify/nccl_exchange_check.hpp"
#include "reference/input_error.hpp"

using namespace cpgold;
using namespace cpgold::gpu;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs body(rank, channel) on one thread per rank; returns each rank's error text ("" when it returned normally).
template <class MakeChannel, class Body>
std::vector<std::string> on_threads(int ranks, MakeChannel make_channel, Body body) {
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      std::unique_ptr<RankChannel> channel = make_channel(r);
      try {
        body(r, *channel);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        channel->post_fault({r, e.what()});
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

std::filesystem::path fresh_folder(const char* name) {
  const auto folder = std::filesystem::temp_directory_path() / (std::string("cpgold-test-") + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  return folder;
}

bool skip_unless_devices(int needed) {
  const int count = cuda_device_count();
  if (count == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return true;
  }
  if (count < needed) {
    std::printf("SKIPPED: needs %d CUDA devices\n", needed);
    return true;
  }
  return false;
}

}  // namespace

TEST_CASE("rank channel (threads): all_gather in rank order, a posted fault stops the others naming the rank") {
  ThreadRendezvous rendezvous(3);
  auto make = [&](int r) { return rendezvous.channel(r); };
  std::vector<std::vector<std::string>> seen(3);
  auto errors = on_threads(3, make, [&](int r, RankChannel& c) {
    seen[static_cast<size_t>(r)] = c.all_gather("from " + std::to_string(r), "first exchange", Seconds(10));
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[static_cast<size_t>(r)].empty());
    CHECK(seen[static_cast<size_t>(r)] == std::vector<std::string>{"from 0", "from 1", "from 2"});
  }
  ThreadRendezvous second(3);
  const auto t0 = Clock::now();
  errors = on_threads(3, [&](int r) { return second.channel(r); }, [&](int r, RankChannel& c) {
    if (r == 2) throw std::runtime_error("rank 2: bad input in field x");
    c.all_gather("x", "verdict gather", Seconds(30));
  });
  CHECK(seconds_since(t0) < 5);
  for (int r = 0; r < 2; ++r) {
    INFO(errors[static_cast<size_t>(r)]);
    CHECK(errors[static_cast<size_t>(r)].find("rank 2 failed") != std::string::npos);
    CHECK(errors[static_cast<size_t>(r)].find("bad input in field x") != std::string::npos);
    CHECK(errors[static_cast<size_t>(r)].find("verdict gather") != std::string::npos);
  }
}

TEST_CASE("rank channel: a rank that never comes is named after the timeout, not waited for forever") {
  ThreadRendezvous rendezvous(2);
  auto channel = rendezvous.channel(0);
  const auto t0 = Clock::now();
  try {
    channel->all_gather("x", "case agreement", Seconds(0.3));
    FAIL("all_gather returned without rank 1");
  } catch (const RankFailure& failure) {
    CHECK(failure.failing_rank() == 1);
    CHECK(std::string(failure.what()).find("timed out after 0.3") != std::string::npos);
    CHECK(std::string(failure.what()).find("rank(s) 1") != std::string::npos);
  }
  CHECK(seconds_since(t0) < 3);
}

TEST_CASE("rank channel: a re-posted fault names the rank that failed first, not the messenger") {
  ThreadRendezvous rendezvous(3);
  auto c0 = rendezvous.channel(0), c1 = rendezvous.channel(1), c2 = rendezvous.channel(2);
  c1->post_fault({2, "rank 1 stops: rank 2 failed: out of memory"});  // rank 1 passes rank 2's failure on
  REQUIRE(c0->poll_fault());
  CHECK(c0->poll_fault()->rank == 2);
  c2->post_fault({2, "rank 2: out of memory"});  // the failing rank's own post wins once it arrives
  CHECK(c0->poll_fault()->message == "rank 2: out of memory");
  const std::optional<RankFault> seen_by_2 = c2->poll_fault();  // a rank never reports its own fault back
  CHECK((!seen_by_2 || seen_by_2->rank != 2));
}

TEST_CASE("rank channel (shared folder): exchanges, faults and a folder of an earlier run") {
  const auto folder = fresh_folder("folder");
  std::vector<std::vector<std::string>> seen(2);
  auto make = [&](int r) { return make_folder_channel(folder.string(), r, 2); };
  auto errors = on_threads(2, make, [&](int r, RankChannel& c) {
    seen[static_cast<size_t>(r)] = c.all_gather(std::string(1000, static_cast<char>('a' + r)), "unique id handoff", Seconds(10));
    seen[static_cast<size_t>(r)].push_back(c.all_gather("second", "second", Seconds(10))[1 - r]);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(errors[static_cast<size_t>(r)].empty());
    REQUIRE(seen[static_cast<size_t>(r)].size() == 3);
    CHECK(seen[static_cast<size_t>(r)][0] == std::string(1000, 'a'));
    CHECK(seen[static_cast<size_t>(r)][1] == std::string(1000, 'b'));
    CHECK(seen[static_cast<size_t>(r)][2] == "second");
  }
  // The same folder again: its files would be read as the new run's messages.
  CHECK_THROWS_AS(make_folder_channel(folder.string(), 0, 2), InputError);
  const auto second = fresh_folder("folder-fault");
  const auto t0 = Clock::now();
  errors = on_threads(2, [&](int r) { return make_folder_channel(second.string(), r, 2); }, [&](int r, RankChannel& c) {
    if (r == 1) throw std::runtime_error("rank 1: CUDA error: an illegal memory access");
    c.all_gather("x", "case agreement", Seconds(30));
  });
  CHECK(seconds_since(t0) < 5);
  CHECK(errors[0].find("rank 1 failed") != std::string::npos);
  CHECK(errors[0].find("illegal memory access") != std::string::npos);
  CHECK_THROWS_AS(make_folder_channel(second.string(), 2, 2), InputError);  // rank outside the world
  std::filesystem::remove_all(folder);
  std::filesystem::remove_all(second);
}

TEST_CASE("case agreement: every rank stops with the same error naming each rank's case") {
  ThreadRendezvous rendezvous(3);
  auto errors = on_threads(3, [&](int r) { return rendezvous.channel(r); }, [&](int r, RankChannel& c) {
    agree_on_case(c, r == 1 ? "case B" : "case A", r == 1 ? "b.h5" : "a.h5", Seconds(10));
  });
  for (int r = 0; r < 3; ++r) {
    INFO(errors[static_cast<size_t>(r)]);
    CHECK(errors[static_cast<size_t>(r)].find("different cases") != std::string::npos);
    CHECK(errors[static_cast<size_t>(r)].find("rank 1 ") != std::string::npos);
    CHECK(errors[static_cast<size_t>(r)].find("b.h5") != std::string::npos);
  }
  ThreadRendezvous same(2);
  errors = on_threads(2, [&](int r) { return same.channel(r); }, [&](int, RankChannel& c) {
    agree_on_case(c, "case A", "a.h5", Seconds(10));
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
}

namespace {

struct RankEnds {
  std::mutex mutex;
  std::vector<int> codes;
  std::vector<std::string> errors;
  explicit RankEnds(int n) : codes(static_cast<size_t>(n), -1), errors(static_cast<size_t>(n)) {}
};

RankLaunch thread_launch(int ranks, double timeout_s, RankEnds& ends) {
  RankLaunch launch;
  launch.launch = "threads";
  launch.ranks = ranks;
  launch.timeout = Seconds(timeout_s);
  launch.on_rank_end = [&ends](int rank, int code, const std::string& error) {
    std::lock_guard lock(ends.mutex);
    ends.codes[static_cast<size_t>(rank)] = code;
    ends.errors[static_cast<size_t>(rank)] = error;
  };
  return launch;
}

void check_exchanges_on(int ranks) {
  RankEnds ends(ranks);
  std::vector<ExchangeVerdict> verdicts(static_cast<size_t>(ranks));
  const int code = run_ranks(thread_launch(ranks, 60, ends), [&](RankContext& context) {
    verdicts[static_cast<size_t>(context.channel.rank())] = run_exchange_check(context, {2, {}, -1});
    return verdicts[static_cast<size_t>(context.channel.rank())].pass() ? 0 : 1;
  });
  std::printf("%s", verdicts[0].table.c_str());
  CHECK(code == 0);
  for (const ExchangeVerdict& v : verdicts) {
    CHECK(v.wrong == 0);
    CHECK(v.elements > 0);
  }
  // Every rank ran the rings, all-gather, reduce-scatter and a2a; with W = 4, a2a+p2p too.
  CHECK(verdicts[0].table.find("p2p kv+dkv ring step 0 dkv") != std::string::npos);
  CHECK(verdicts[0].table.find("reduce_scatter") != std::string::npos);
  CHECK(verdicts[0].table.find("a2a reverse") != std::string::npos);
  if (ranks == 4) CHECK(verdicts[0].table.find("a2a+p2p: kv+dkv ring") != std::string::npos);
}

}  // namespace

TEST_CASE("nccl exchanges W=2: coded values arrive where the partition says, bit for bit") {
  if (skip_unless_devices(2)) return;
  check_exchanges_on(2);
}

TEST_CASE("nccl exchanges W=4 (a2a+p2p with a2a_size 2): coded values bit for bit") {
  if (skip_unless_devices(4)) return;
  check_exchanges_on(4);
}

TEST_CASE("nccl faults: a failing rank stops every rank within the timeout, each naming it") {
  if (skip_unless_devices(2)) return;
  const int ranks = std::min(cuda_device_count(), 4);
  for (const char* kind : {"exception", "cuda"}) {
    RankEnds ends(ranks);
    const double timeout_s = 20;
    const auto t0 = Clock::now();
    const int code = run_ranks(thread_launch(ranks, timeout_s, ends), [&](RankContext& context) {
      return run_exchange_check(context, {2, {1, kind}, -1}).pass() ? 0 : 1;
    });
    const double elapsed = seconds_since(t0);
    INFO("kind " << kind << ", " << elapsed << " s");
    CHECK(code == kExitRankFault);
    CHECK(elapsed < timeout_s);
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r << ": " << ends.errors[static_cast<size_t>(r)]);
      CHECK(ends.codes[static_cast<size_t>(r)] == kExitRankFault);
      CHECK(ends.errors[static_cast<size_t>(r)].find(r == 1 ? "injected" : "rank 1 failed") != std::string::npos);
    }
  }
}

TEST_CASE("nccl faults: a rank given another case stops every rank before any collective") {
  if (skip_unless_devices(2)) return;
  RankEnds ends(2);
  const int code = run_ranks(thread_launch(2, 20, ends), [&](RankContext& context) {
    return run_exchange_check(context, {2, {}, 1}).pass() ? 0 : 1;
  });
  CHECK(code == 2);
  for (int r = 0; r < 2; ++r) {
    INFO(ends.errors[static_cast<size_t>(r)]);
    CHECK(ends.codes[static_cast<size_t>(r)] == 2);
    CHECK(ends.errors[static_cast<size_t>(r)].find("different cases") != std::string::npos);
  }
}

// --- per-rank checks on the rank that ran, one combined table on rank 0 (CPU: the CP peer stands in for a rank) --

#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "gpu/verify/rank_check.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/plan/plan.hpp"

TEST_CASE("rank check: each rank checks its own outputs, rank 0's table has every rank's rows and one verdict") {
  const auto folder = fresh_folder("rank-check");
  std::filesystem::create_directories(folder);
  const std::string golden = (folder / "golden.h5").string();
  const sim::CaseSpec spec = sim::parse_case_text(
      R"({"seqlens_q":[13,0,6],"heads_q":2,"heads_kv":1,"dim_qk":16,"mask":"causal","cp_size":2,"comm":"p2p","seed":5})");
  fx::write_fixture(fx::generate(spec), golden);
  const sim::CpRun<float> run = sim::run_cp_peer(sim::make_plan(spec), sim::make_case_inputs(spec), spec.dtype);
  std::vector<RankCheck> checks;
  for (int r = 0; r < 2; ++r) {
    const RankCheck check = check_rank_outputs(golden, r, run.ranks[static_cast<size_t>(r)],
                                               (folder / ("rank" + std::to_string(r) + ".h5")).string());
    CHECK(check.pass);
    CHECK(check.rows.find("o@r" + std::to_string(r)) != std::string::npos);
    CHECK(check.rows.find("@r" + std::to_string(1 - r)) == std::string::npos);  // only its own tensors
    checks.push_back(deserialise_rank_check(serialise(check)));
    CHECK(checks.back().rows == check.rows);
  }
  std::string table = combined_report(golden, checks);
  CHECK(table.find("dv@r0") != std::string::npos);
  CHECK(table.find("dv@r1") != std::string::npos);
  CHECK(table.find("verdict: PASS") != std::string::npos);
  // One wrong element of rank 1's dK: rank 1 fails and names it, the combined verdict fails.
  sim::RankOutputs<float> wrong = run.ranks[1];
  wrong.dk.values[3] += 1.0f;
  const RankCheck bad = check_rank_outputs(golden, 1, wrong, (folder / "bad.h5").string());
  CHECK_FALSE(bad.pass);
  checks[1] = deserialise_rank_check(serialise(bad));
  CHECK_FALSE(checks[1].pass);
  table = combined_report(golden, checks);
  INFO(table);
  CHECK(table.find("verdict: FAIL") != std::string::npos);
  CHECK(table.find("rank 1:") != std::string::npos);
  CHECK(table.find("worst element") != std::string::npos);
  std::filesystem::remove_all(folder);
}

TEST_CASE("rank check: a rank holding only padding passes on exact zeros, and a run that compares nothing fails") {
  const auto folder = fresh_folder("rank-check-pad");
  std::filesystem::create_directories(folder);
  const std::string golden = (folder / "golden.h5").string();
  // One token, W = 2: the sequence is padded to 4 rows, rank 0 holds chunks 0 and 3 (the token and a pad row),
  // rank 1 holds chunks 1 and 2, both padding.
  const sim::CaseSpec spec = sim::parse_case_text(
      R"({"seqlens_q":[1],"heads_q":1,"dim_qk":16,"cp_size":2,"comm":"p2p","pad_fill":"nan","seed":7})");
  fx::write_fixture(fx::generate(spec), golden);
  const sim::CpRun<float> run = sim::run_cp_peer(sim::make_plan(spec), sim::make_case_inputs(spec), spec.dtype);
  std::vector<RankCheck> checks;
  for (int r = 0; r < 2; ++r)
    checks.push_back(deserialise_rank_check(serialise(check_rank_outputs(
        golden, r, run.ranks[static_cast<size_t>(r)], (folder / ("rank" + std::to_string(r) + ".h5")).string()))));
  CHECK(checks[0].pass);
  CHECK(checks[0].compared > 0);
  CHECK(checks[1].pass);
  CHECK(checks[1].compared == 0);
  CHECK(combined_pass(checks));
  std::string table = combined_report(golden, checks);
  INFO(table);
  CHECK(table.find("rank 1 holds only padding") != std::string::npos);
  CHECK(table.find("verdict: PASS") != std::string::npos);
  // A non-zero value in one of rank 1's pad rows is an exact-class violation: rank 1 fails, and so does the run.
  sim::RankOutputs<float> leak = run.ranks[1];
  leak.o.values[0] = 0.5f;
  checks[1] = deserialise_rank_check(serialise(check_rank_outputs(golden, 1, leak, (folder / "leak.h5").string())));
  CHECK_FALSE(checks[1].pass);
  CHECK_FALSE(combined_pass(checks));
  // Ranks that all compared nothing prove nothing: the combined verdict fails and says why.
  RankCheck empty0 = checks[0], empty1 = checks[0];
  empty0.compared = empty1.compared = 0;
  empty1.rank = 1;
  CHECK_FALSE(combined_pass({empty0, empty1}));
  table = combined_report(golden, {empty0, empty1});
  CHECK(table.find("no element was compared on any rank") != std::string::npos);
  CHECK(table.find("verdict: FAIL") != std::string::npos);
  CHECK_FALSE(combined_pass({}));
  std::filesystem::remove_all(folder);
}

// --- the CP program over NCCL: each comm type on 2 (and 4) GPUs, every rank checked against /ranks/<r> ----------

#include "gpu/cp/cp_executor.hpp"
#include "gpu/verify/nccl_verify.hpp"

namespace {

void verify_on_gpus(int ranks, const std::vector<std::string>& cases) {
  const auto folder = fresh_folder(("nccl-cp-w" + std::to_string(ranks)).c_str());
  std::filesystem::create_directories(folder);
  std::vector<std::string> fixtures;
  for (size_t i = 0; i < cases.size(); ++i) {
    fixtures.push_back((folder / ("case" + std::to_string(i) + ".h5")).string());
    fx::write_fixture(fx::generate(sim::parse_case_text(cases[i])), fixtures.back());
  }
  RankEnds ends(ranks);
  RankLaunch launch = thread_launch(ranks, 60, ends);
  const int code = verify_fixtures_nccl(fixtures, {}, launch,
                                        [](const sim::Plan& plan, const sim::CaseInputs& inputs, int rank,
                                           Communicator& comm, DType dtype, BackwardMode mode) {
                                          CpGpuOptions options;
                                          options.mode = mode;
                                          return run_cp_rank(plan, inputs, dtype, comm, options).outputs;
                                        });
  for (int r = 0; r < ranks; ++r) INFO("rank " << r << ": " << ends.errors[static_cast<size_t>(r)]);
  CHECK(code == 0);
  std::filesystem::remove_all(folder);
}

}  // namespace

TEST_CASE("nccl CP W=2: p2p, a2a and all_gather pass on every rank, forward and backward") {
  if (skip_unless_devices(2)) return;
  verify_on_gpus(2, {
      R"({"seqlens_q":[113,0,203,9],"heads_q":4,"heads_kv":2,"dim_qk":64,"mask":"causal","cp_size":2,"comm":"p2p","seed":11,"pad_fill":"nan"})",
      R"({"seqlens_q":[77,130],"heads_q":4,"heads_kv":2,"dim_qk":128,"mask":"causal","cp_size":2,"comm":"a2a","seed":12})",
      R"({"seqlens_q":[64,1,150],"heads_q":2,"heads_kv":1,"dim_qk":128,"dtype":"fp16","mask":"causal","window":[32,0],"cp_size":2,"comm":"all_gather","seed":13})",
  });
}

TEST_CASE("nccl CP W=4: p2p, a2a, all_gather and a2a+p2p (a2a_size 2) pass on every rank") {
  if (skip_unless_devices(4)) return;
  verify_on_gpus(4, {
      R"({"seqlens_q":[113,0,203,9],"heads_q":4,"heads_kv":2,"dim_qk":64,"mask":"causal","cp_size":4,"comm":"p2p","seed":21})",
      R"({"seqlens_q":[77,130],"heads_q":4,"heads_kv":4,"dim_qk":128,"mask":"causal","cp_size":4,"comm":"a2a","seed":22})",
      R"({"seqlens_q":[64,1,150],"heads_q":4,"heads_kv":2,"dim_qk":64,"mask":"causal","cp_size":4,"comm":"all_gather","seed":23})",
      R"({"seqlens_q":[211,57],"heads_q":4,"heads_kv":2,"dim_qk":128,"mask":"causal","cp_size":4,"comm":"a2a+p2p","a2a_size":2,"seed":24})",
  });
}

// --- the p2p ring with its exchanges overlapped (separate communication stream): same bits as the single-GPU
// transport, the same bits on reruns in deterministic mode, and the communication time measured on both streams ----

#include <cuda_runtime_api.h>

#include <cstring>

#include "gpu/comm/nccl_communicator.hpp"

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
bool same_bits(const sim::RankOutputs<float>& a, const sim::RankOutputs<float>& b) {
  return same_bits(a.o.values, b.o.values) && same_bits(a.lse.values, b.lse.values) &&
         same_bits(a.dq.values, b.dq.values) && same_bits(a.dk.values, b.dk.values) &&
         same_bits(a.dv.values, b.dv.values);
}

}  // namespace

TEST_CASE("nccl CTA policy: the names round trip, an unknown name is an error naming it") {
  for (NcclCtaPolicy p : {NcclCtaPolicy::nccl_default, NcclCtaPolicy::efficiency, NcclCtaPolicy::zero})
    CHECK(parse_nccl_cta_policy(nccl_cta_policy_name(p)) == p);
  CHECK(std::string(nccl_cta_policy_name(NcclCtaPolicy::nccl_default)) == "default");
  CHECK_THROWS_WITH_AS(parse_nccl_cta_policy("fast"), doctest::Contains("\"fast\""), std::invalid_argument);
}

TEST_CASE("nccl CP W=2 p2p, deterministic backward: the bits of the single-GPU run, on every rerun and under NCCL's efficiency CTA policy") {
  if (skip_unless_devices(2)) return;
  const sim::CaseSpec spec = sim::parse_case_text(
      R"({"seqlens_q":[1024,512,2048,96],"heads_q":8,"heads_kv":4,"dim_qk":128,"mask":"causal","cp_size":2,"comm":"p2p","seed":31})");
  const sim::Plan plan = sim::make_plan(spec);
  const sim::CaseInputs inputs = sim::make_case_inputs(spec);
  CpGpuOptions options;
  options.mode = BackwardMode::deterministic;
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  const sim::CpRun<float> local = run_cp_local(plan, inputs, spec.dtype, options);
  options.time_exchanges = true;
  // Three runs on one communicator with NCCL's default CTA policy, then two on a new one with the efficiency policy
  // (fewer thread blocks for NCCL's kernels: the data must not change; before NCCL 2.27, the default again).
  std::vector<NcclCtaPolicy> schedule(3, NcclCtaPolicy::nccl_default);
  schedule.resize(5, nccl_has_cta_policies() ? NcclCtaPolicy::efficiency : NcclCtaPolicy::nccl_default);
  const int reruns = static_cast<int>(schedule.size());
  std::vector<std::vector<RankRun>> runs(2);
  RankEnds ends(2);
  const int code = run_ranks(thread_launch(2, 60, ends), [&](RankContext& context) {
    CommOptions comm_options;
    comm_options.timeout = std::chrono::seconds(60);
    std::unique_ptr<NcclCommunicator> comm;
    std::unique_ptr<RankCpExecutor> executor;
    for (int i = 0; i < reruns; ++i) {
      if (i == 0 || i == 3) {
        executor.reset();
        comm = NcclCommunicator::create(context.channel, context.device, comm_options, schedule[static_cast<size_t>(i)]);
        executor = std::make_unique<RankCpExecutor>(plan, inputs, spec.dtype, *comm, options);
      }
      runs[static_cast<size_t>(comm->rank())].push_back(executor->run(true));
    }
    return 0;
  });
  for (int r = 0; r < 2; ++r) INFO("rank " << r << ": " << ends.errors[static_cast<size_t>(r)]);
  REQUIRE(code == 0);
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < reruns; ++i) {
      INFO("rank " << r << " run " << i << " (CTA policy " << nccl_cta_policy_name(schedule[static_cast<size_t>(i)]) << ")");
      const RankRun& run = runs[static_cast<size_t>(r)][static_cast<size_t>(i)];
      CHECK(same_bits(run.outputs, local.ranks[static_cast<size_t>(r)]));
      // Forward: one KV shift per step; backward: a KV and a dKV shift per step (the last ones empty).
      CHECK(run.times.exchanges == plan.forward.steps + 2 * plan.backward.steps);
      CHECK(run.times.comm_ms > 0);
      CHECK(run.times.exposed_ms >= 0);
      CHECK(run.times.run_ms > run.times.exposed_ms);
    }
  std::printf("p2p W=2 overlap, rank 0 run 2: run %.3f ms, communication %.3f ms, exposed %.3f ms\n",
              runs[0][2].times.run_ms, runs[0][2].times.comm_ms, runs[0][2].times.exposed_ms);
  std::printf("p2p W=2 overlap, %s CTA policy, rank 0 run 4: run %.3f ms, communication %.3f ms, exposed %.3f ms\n",
              std::string(nccl_cta_policy_name(schedule[4])).c_str(), runs[0][4].times.run_ms, runs[0][4].times.comm_ms,
              runs[0][4].times.exposed_ms);
}
