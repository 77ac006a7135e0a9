// The GPU CP executors with W virtual ranks on one device (gpu/cp/cp_executor.hpp) through `verify --backend local`'s
// library entry: every GPU-capable case of the quick, edge and te suites (NaN-filled pads) passes per rank and
// gathered, forward and backward, in both backward modes; traced cases pass per step; the checker's self-test
// (--inject) is caught and located at its rank and step for every comm type; the deterministic mode repeats bit for
// bit; a faulty schedule fails with a timeout naming rank and operation instead of hanging.
// Without a GPU every case prints "SKIPPED: no CUDA device" (CTest reports it as skipped).
#include <doctest/doctest.h>

#include <unistd.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "check/engine.hpp"
#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "fixtures/golden/suites.hpp"
#include "gpu/comm/communicator.hpp"
#include "gpu/comm/local_communicator.hpp"
#include "gpu/cp/cp_executor.hpp"
#include "gpu/verify/fixture_verify.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/program/cp_program.hpp"
#include "tests/gpu/require_device.hpp"

using namespace cpgold;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("cpgold-cp-local-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

// Writes the fixture of `spec` (NaN pads) and returns its path.
std::string make_fixture(const TempDir& dir, const std::string& name, sim::CaseSpec spec, bool trace) {
  spec.pad_fill = sim::PadFill::nan;
  const std::string path = (dir.path / (name + (trace ? "_trace" : "") + ".h5")).string();
  fx::write_fixture(fx::generate(spec, fx::GenerateOptions{.trace = trace}), path, fx::WriteOptions{.force = true});
  return path;
}

std::string first_failure(const fx::CheckReport& report) {
  for (const auto& r : report.results)
    if (!r.ok()) return r.tensor + " rank " + std::to_string(r.rank) + " step " + std::to_string(r.step);
  return "none";
}

void verify_suite(const std::string& suite, gpu::BackwardMode mode) {
  TempDir dir;
  int checked = 0;
  for (const fx::SuiteCase& c : fx::suite_cases(suite)) {
    if (c.cpu_only || !fx::inside_gpu_table(c.spec)) continue;
    CAPTURE(c.name);
    const std::string fixture = make_fixture(dir, c.name, c.spec, false);
    const gpu::FixtureVerification v =
        gpu::verify_fixture_local(fixture, mode, (dir.path / (c.name + ".cand.h5")).string());
    if (v.verdict == gpu::FixtureVerdict::unsupported) {
      MESSAGE("unsupported: " << c.name << ": " << v.unsupported_reason);
      continue;
    }
    REQUIRE(v.report.has_value());
    INFO(fx::render_text(*v.report));
    CHECK_MESSAGE(v.verdict == gpu::FixtureVerdict::pass, first_failure(*v.report));
    int per_rank = 0;
    for (const auto& r : v.report->results) per_rank += r.rank >= 0;
    CHECK(per_rank >= 5 * c.spec.cp_size);  // every rank's five outputs were checked
    ++checked;
  }
  MESSAGE(suite << ": " << checked << " cases verified");
  CHECK(checked > 0);
}

// Same shape and the same bits (float32 holding dtype values; empty tensors compare equal).
bool same(const Tensor3<float>& a, const Tensor3<float>& b) {
  return a.values.size() == b.values.size() &&
         (a.values.empty() || std::memcmp(a.values.data(), b.values.data(), a.values.size() * 4) == 0);
}

// Every rank's O, dQ, dK and dV of two runs have the same bits (dQ left out with with_dq false: atomic-mode dQ).
void check_same_outputs(const sim::CpRun<float>& want, const sim::CpRun<float>& got, bool with_dq = true) {
  REQUIRE(got.ranks.size() == want.ranks.size());
  for (size_t r = 0; r < want.ranks.size(); ++r) {
    CAPTURE(r);
    const auto& a = want.ranks[r];
    const auto& b = got.ranks[r];
    CHECK(same(a.o, b.o));
    if (with_dq) CHECK(same(a.dq, b.dq));
    CHECK(same(a.dk, b.dk));
    CHECK(same(a.dv, b.dv));
  }
}

// The deterministic backward, all else as it comes: the schedule whose bits the other options must give.
gpu::CpGpuOptions deterministic_options() {
  gpu::CpGpuOptions options;
  options.mode = gpu::BackwardMode::deterministic;
  return options;
}

// Turns on the phase breakdown, whose serialised operations may take longer than the default timeout allows.
void add_phase_breakdown(gpu::CpGpuOptions& options) {
  options.phases = std::make_shared<gpu::PhaseTimes>();
  options.timeout = std::chrono::milliseconds(20000);
}

// Calls of one phase in a PhaseTimes (0 if it never ran).
int64_t phase_calls(const gpu::PhaseTimes& times, const std::string& name) {
  const auto it = times.phases.find(name);
  return it == times.phases.end() ? 0 : it->second.calls;
}

// Two runs of a case under `options` with the phase breakdown on, the switch `flag` off ([0]) and on ([1]): their
// outputs and the calls of `phase` in each.
struct OffAndOn {
  sim::CpRun<float> runs[2];
  size_t calls[2] = {0, 0};
};
OffAndOn run_off_and_on(const sim::Plan& plan, const sim::CaseInputs& inputs, DType dtype, gpu::CpGpuOptions options,
                        bool gpu::CpGpuOptions::*flag, const std::string& phase) {
  OffAndOn out;
  for (const bool on : {false, true}) {
    options.*flag = on;
    add_phase_breakdown(options);
    out.runs[on] = gpu::LocalCpExecutor(plan, inputs, dtype, options).run(true);
    out.calls[on] = static_cast<size_t>(phase_calls(*options.phases, phase));
  }
  return out;
}

// The first quick case of each comm type inside the GPU table.
std::vector<fx::SuiteCase> one_case_per_comm() {
  std::vector<fx::SuiteCase> out;
  for (sim::CommType comm : {sim::CommType::p2p, sim::CommType::a2a, sim::CommType::all_gather, sim::CommType::a2a_p2p})
    for (const std::string suite : {"quick", "edge"}) {
      bool found = false;
      for (const fx::SuiteCase& c : fx::suite_cases(suite))
        if (!c.cpu_only && fx::inside_gpu_table(c.spec) && c.spec.comm == comm && c.spec.cp_size >= 2) {
          out.push_back(c);
          found = true;
          break;
        }
      if (found) break;
    }
  return out;
}

// body(c, plan, inputs) on each case of one_case_per_comm, with its Plan and inputs.
template <class Body>
void for_one_case_per_comm(Body&& body) {
  for (const fx::SuiteCase& c : one_case_per_comm()) {
    CAPTURE(c.name);
    body(c, sim::make_plan(c.spec), sim::make_case_inputs(c.spec));
  }
}

const int kEveryCase = std::numeric_limits<int>::max();

// body(c, plan, inputs) on the cases of the quick and edge suites inside the GPU table that `wanted` takes, at most
// `per_suite` of each suite; at least 4 in all. Returns how many.
template <class Wanted, class Body>
int sweep_quick_and_edge(Wanted&& wanted, int per_suite, Body&& body) {
  int cases = 0;
  for (const std::string suite : {"quick", "edge"}) {
    int taken = 0;
    for (const fx::SuiteCase& c : fx::suite_cases(suite)) {
      if (c.cpu_only || !fx::inside_gpu_table(c.spec) || !wanted(c.spec) || taken == per_suite) continue;
      ++taken;
      ++cases;
      CAPTURE(c.name);
      body(c, sim::make_plan(c.spec), sim::make_case_inputs(c.spec));
    }
  }
  CHECK(cases >= 4);
  return cases;
}

}  // namespace

TEST_CASE("local CP: every GPU-capable quick case passes per rank and gathered (atomic backward)") {
  CPGOLD_REQUIRE_DEVICE();
  verify_suite("quick", gpu::BackwardMode::atomic);
}

TEST_CASE("local CP: every GPU-capable edge case passes (deterministic backward)") {
  CPGOLD_REQUIRE_DEVICE();
  verify_suite("edge", gpu::BackwardMode::deterministic);
}

TEST_CASE("local CP: every GPU-capable te case passes") {
  CPGOLD_REQUIRE_DEVICE();
  verify_suite("te", gpu::BackwardMode::atomic);
}

TEST_CASE("local CP: traced cases pass step by step, --inject is caught and located for every comm type") {
  CPGOLD_REQUIRE_DEVICE();
  TempDir dir;
  const std::vector<fx::SuiteCase> cases = one_case_per_comm();
  CHECK(cases.size() == 4);
  for (const fx::SuiteCase& c : cases) {
    CAPTURE(c.name);
    const std::string fixture = make_fixture(dir, c.name, c.spec, true);
    const std::string cand = (dir.path / (c.name + ".cand.h5")).string();
    const gpu::FixtureVerification clean = gpu::verify_fixture_local(fixture, gpu::BackwardMode::atomic, cand);
    REQUIRE(clean.report.has_value());
    INFO(fx::render_text(*clean.report));
    CHECK_MESSAGE(clean.verdict == gpu::FixtureVerdict::pass, first_failure(*clean.report));
    int steps_checked = 0;
    for (const auto& r : clean.report->results) steps_checked += r.step >= 0;
    CHECK(steps_checked > 0);

    // Corrupt the last rank's partial at its last computed forward step.
    const sim::Plan plan = sim::make_plan(c.spec);
    const int rank = plan.cp_size - 1;
    int step = -1;
    for (int s = 0; s < plan.forward.steps; ++s)
      if (plan.forward.tile(rank, s).computed) step = s;
    REQUIRE(step >= 0);
    const gpu::FixtureVerification bad =
        gpu::verify_fixture_local(fixture, gpu::BackwardMode::atomic, cand, gpu::StepRef{rank, step});
    REQUIRE(bad.report.has_value());
    CHECK(bad.verdict == gpu::FixtureVerdict::fail);
    // Exactly that forward partial fails among the step partials, and the outputs it merges into fail (on the rank
    // holding the corrupted row: for a2a and a2a+p2p the reverse a2a moves it to another rank).
    bool located = false, other_step_failed = false, rank_output_failed = false;
    for (const auto& r : bad.report->results) {
      if (r.step >= 0 && r.pass == "forward" && !r.ok()) {
        if (r.rank == rank && r.step == step) located = true;
        else other_step_failed = true;
      }
      if (r.step < 0 && r.rank >= 0 && !r.ok()) rank_output_failed = true;
    }
    CHECK_MESSAGE(located, first_failure(*bad.report));
    CHECK(!other_step_failed);
    CHECK(rank_output_failed);
  }
}

TEST_CASE("local CP: the deterministic backward gives the same bits on 5 reruns, every comm type") {
  CPGOLD_REQUIRE_DEVICE();
  for_one_case_per_comm([&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    gpu::CpGpuOptions options = deterministic_options();
    gpu::LocalCpExecutor executor(plan, inputs, c.spec.dtype, options);
    const sim::CpRun<float> first = executor.run(true);
    for (int rerun = 0; rerun < 4; ++rerun) {
      const sim::CpRun<float> again = executor.run(true);
      for (int r = 0; r < plan.cp_size; ++r) {
        const auto& a = first.ranks[static_cast<size_t>(r)];
        const auto& b = again.ranks[static_cast<size_t>(r)];
        CHECK(std::memcmp(a.o.values.data(), b.o.values.data(), a.o.values.size() * 4) == 0);
        CHECK(std::memcmp(a.lse.values.data(), b.lse.values.data(), a.lse.values.size() * 4) == 0);
        CHECK(std::memcmp(a.dq.values.data(), b.dq.values.data(), a.dq.values.size() * 4) == 0);
        CHECK(std::memcmp(a.dk.values.data(), b.dk.values.data(), a.dk.values.size() * 4) == 0);
        CHECK(std::memcmp(a.dv.values.data(), b.dv.values.data(), a.dv.values.size() * 4) == 0);
      }
    }
  });
}

// CpGpuOptions::accumulate_aside changes the schedule only: the accumulation of the backward partials moves to a
// third stream per rank, ordered by events where the compute and communication streams touch its buffers. The same
// bits as the in-order schedule (deterministic backward) for every comm type, plain, traced (the trace reads the
// accumulators in flight between steps) and under the phase breakdown; repeated runs of one executor (the pool
// reuses blocks freed on the accumulation stream) stay equal too.
TEST_CASE("local CP: accumulating on its own stream gives the in-order bits, every comm type") {
  CPGOLD_REQUIRE_DEVICE();
  for_one_case_per_comm([&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    sim::CpRun<float> in_order_plain;  // the untraced in-order run, also the reference of the phase breakdown below
    for (const bool traced : {false, true}) {
      CAPTURE(traced);
      gpu::CpGpuOptions in_order = deterministic_options();
      in_order.record_trace = traced;
      gpu::CpGpuOptions aside = in_order;
      aside.accumulate_aside = true;
      const sim::CpRun<float> want = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, in_order).run(true);
      if (!traced) in_order_plain = want;
      gpu::LocalCpExecutor executor(plan, inputs, c.spec.dtype, aside);
      for (int run = 0; run < 3; ++run) {
        CAPTURE(run);
        const sim::CpRun<float> got = executor.run(true);
        check_same_outputs(want, got);
        REQUIRE(got.trace.backward.size() == want.trace.backward.size());
        for (size_t i = 0; i < want.trace.backward.size(); ++i) {
          const auto& a = want.trace.backward[i];
          const auto& b = got.trace.backward[i];
          CHECK(same(a.dq, b.dq));
          CHECK(same(a.dk_in_flight, b.dk_in_flight));
          CHECK(same(a.dv_in_flight, b.dv_in_flight));
        }
      }
    }
    gpu::CpGpuOptions timed = deterministic_options();
    timed.accumulate_aside = true;
    add_phase_breakdown(timed);
    const sim::CpRun<float> got = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, timed).run(true);
    for (int r = 0; r < plan.cp_size; ++r) {
      CHECK(same(in_order_plain.ranks[static_cast<size_t>(r)].dq, got.ranks[static_cast<size_t>(r)].dq));
      CHECK(same(in_order_plain.ranks[static_cast<size_t>(r)].dk, got.ranks[static_cast<size_t>(r)].dk));
    }
    CHECK(timed.phases->phases.count("scatter_add") == 1);
  });
}

// CpGpuOptions::sum_in_backward: the ring steps' attention backward adds dQ, dK, dV into the rank's float32 sums
// itself. The bits of backward + scatter_add (deterministic backward) for every comm type, alone and with the
// accumulation stream, over repeated runs of one executor; the phase breakdown shows that no ring step ran a
// scatter_add (all_gather keeps its own accumulation); a traced run ignores the option and keeps its partials.
TEST_CASE("local CP: summing inside the backward kernels gives the bits of backward + scatter_add, every comm type") {
  CPGOLD_REQUIRE_DEVICE();
  for_one_case_per_comm([&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    gpu::CpGpuOptions in_order = deterministic_options();
    const sim::CpRun<float> want = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, in_order).run(true);
    gpu::CpGpuOptions summing = in_order;
    summing.sum_in_backward = true;
    for (const bool aside : {false, true}) {
      CAPTURE(aside);
      summing.accumulate_aside = aside;
      gpu::LocalCpExecutor executor(plan, inputs, c.spec.dtype, summing);
      for (int run = 0; run < 3; ++run) {
        CAPTURE(run);
        const sim::CpRun<float> got = executor.run(true);
        check_same_outputs(want, got);
      }
    }
    gpu::CpGpuOptions timed = in_order;
    timed.sum_in_backward = true;
    add_phase_breakdown(timed);
    const sim::CpRun<float> got = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, timed).run(true);
    for (int r = 0; r < plan.cp_size; ++r)
      CHECK(same(want.ranks[static_cast<size_t>(r)].dk, got.ranks[static_cast<size_t>(r)].dk));
    CHECK(timed.phases->phases.count("scatter_add") == (c.spec.comm == sim::CommType::all_gather ? 1u : 0u));
    gpu::CpGpuOptions traced = in_order;
    traced.sum_in_backward = true;
    traced.record_trace = true;
    const sim::CpRun<float> with_trace = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, traced).run(true);
    CHECK(with_trace.trace.backward.size() >= static_cast<size_t>(plan.cp_size));
    for (int r = 0; r < plan.cp_size; ++r)
      CHECK(same(want.ranks[static_cast<size_t>(r)].dq, with_trace.ranks[static_cast<size_t>(r)].dq));
  });
}

// CpGpuOptions::last_sum_in_dtype: the summing backward's last step over a whole side writes the finished dQ (dK, dV)
// in the dtype (RowSum::result) instead of the float32 sum that finalize then converts. p2p ring cases of quick and
// edge (causal and not, W = 1 included), deterministic backward: every rank's dQ, dK, dV have the bits of converting
// afterwards, and the only conversions left (the "convert" phase; the float32 path converts all three) are those of
// sums whose last step reads a half.
TEST_CASE("local CP: the last summing step writes the dtype, with the bits of converting afterwards") {
  CPGOLD_REQUIRE_DEVICE();
  int whole = 0;
  const auto p2p = [](const sim::CaseSpec& spec) { return spec.comm == sim::CommType::p2p; };
  const auto compare = [&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    gpu::CpGpuOptions options = deterministic_options();
    options.sum_in_backward = true;
    const OffAndOn last_dtype =
        run_off_and_on(plan, inputs, c.spec.dtype, options, &gpu::CpGpuOptions::last_sum_in_dtype, "convert");
    // Conversions left: a sum whose last step reads only a half of its side (Q and KV geometries that differ
    // select chunks by visibility, so the last step may be a half) ends in float32 and is converted.
    size_t left = 0;
    for (int r = 0; r < plan.cp_size; ++r) {
      const sim::Tile* last = nullptr;
      for (int i = 0; i < plan.backward.steps; ++i)
        if (plan.backward.tile(r, i).computed) last = &plan.backward.tile(r, i);
      if (last == nullptr) continue;
      left += last->q_half != sim::HalfSelect::full ? 1 : 0;
      left += last->step != plan.backward.steps - 1 || last->kv_half != sim::HalfSelect::full ? 2 : 0;
    }
    check_same_outputs(last_dtype.runs[0], last_dtype.runs[1]);
    CHECK(last_dtype.calls[0] == 3u * static_cast<size_t>(plan.cp_size));
    CHECK(last_dtype.calls[1] == left);
    whole += left == 0 ? 1 : 0;
  };
  const int cases = sweep_quick_and_edge(p2p, kEveryCase, compare);
  CHECK(whole >= 4);
  MESSAGE("VERDICT last summing step in the dtype: " << cases << " p2p cases (" << whole
                                                     << " with no conversion left), same bits as converting afterwards");
}

// Ring steps reading a half of the rank's tensors: with read_halves_in_place the K/V half is read where it lies
// (forward, and the summing backward with the delta of one pass over the rank's O and dO), otherwise gathered into a
// step tensor first. Causal ring cases of quick and edge (padding, GQA, zero-length sequences among them), both
// backward modes: every rank's O, dQ, dK, dV have the gathered path's bits (dQ of the atomic mode aside: its float
// atomics may add in another order from run to run), and the in-place runs gather fewer tensors.
TEST_CASE("local CP: reading the K/V halves in place gives the bits of gathering them") {
  CPGOLD_REQUIRE_DEVICE();
  int with_halves = 0;
  const auto causal_ring = [](const sim::CaseSpec& spec) {
    return spec.causal && spec.cp_size >= 2 && (spec.comm == sim::CommType::p2p || spec.comm == sim::CommType::a2a_p2p);
  };
  const auto compare = [&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    bool halves = false;
    for (const sim::Tile& t : plan.forward.tiles) halves |= t.computed && t.kv_half != sim::HalfSelect::full;
    with_halves += halves;
    for (const gpu::BackwardMode mode : {gpu::BackwardMode::deterministic, gpu::BackwardMode::atomic}) {
      CAPTURE(static_cast<int>(mode));
      for (const bool sum : {false, true}) {
        CAPTURE(sum);
        gpu::CpGpuOptions options;
        options.mode = mode;
        options.sum_in_backward = sum;
        const OffAndOn in_place =
            run_off_and_on(plan, inputs, c.spec.dtype, options, &gpu::CpGpuOptions::read_halves_in_place, "gather");
        check_same_outputs(in_place.runs[0], in_place.runs[1], mode == gpu::BackwardMode::deterministic);
        if (halves) CHECK(in_place.calls[1] < in_place.calls[0]);
      }
    }
  };
  const int cases = sweep_quick_and_edge(causal_ring, 5, compare);
  CHECK(with_halves >= 2);
  MESSAGE("VERDICT K/V halves in place: " << cases << " causal ring cases (" << with_halves
                                          << " with half steps), same bits as gathering");
}

// The timeline (CpGpuOptions::timeline, bench_cp_local --timeline) brackets every operation with events and nothing
// else: the outputs are the plain run's; every attention call of every rank has a span on the compute stream; the
// spans are ordered in time; the accumulation stream shows up exactly when accumulate_aside puts work there.
TEST_CASE("local CP: the timeline records every attention call of every rank and changes no output") {
  CPGOLD_REQUIRE_DEVICE();
  for_one_case_per_comm([&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    int64_t attention_calls = 0;
    for (const sim::PassPlan* pp : {&plan.forward, &plan.backward})
      for (const sim::Tile& t : pp->tiles) attention_calls += t.computed;
    gpu::CpGpuOptions plain = deterministic_options();
    const sim::CpRun<float> want = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, plain).run(true);
    for (const bool aside : {false, true}) {
      CAPTURE(aside);
      gpu::CpGpuOptions options = plain;
      options.accumulate_aside = aside;
      options.timeline = std::make_shared<gpu::Timeline>();
      const sim::CpRun<float> got = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, options).run(true);
      for (int r = 0; r < plan.cp_size; ++r) {
        const auto& a = want.ranks[static_cast<size_t>(r)];
        const auto& b = got.ranks[static_cast<size_t>(r)];
        CHECK(same(a.o, b.o));
        CHECK(same(a.dq, b.dq));
        CHECK(same(a.dk, b.dk));
      }
      int64_t attention_spans = 0, accumulate_spans = 0, exchange_spans = 0;
      std::vector<int> ranks_seen(static_cast<size_t>(plan.cp_size), 0);
      for (const gpu::TimelineSpan& x : options.timeline->spans) {
        CHECK(x.end_ms >= x.begin_ms);
        CHECK(x.begin_ms > -0.05);  // the reference is recorded before any rank starts (allow clock jitter)
        REQUIRE((x.rank >= 0 && x.rank < plan.cp_size));
        ranks_seen[static_cast<size_t>(x.rank)] = 1;
        if (x.name.rfind("attention ", 0) == 0) {
          ++attention_spans;
          CHECK(x.stream == "compute");
        }
        accumulate_spans += x.stream == "accumulate";
        exchange_spans += x.stream == "exchange";
      }
      CHECK(attention_spans == attention_calls);
      CHECK((accumulate_spans > 0) == aside);
      if (plan.cp_size > 1) CHECK(exchange_spans > 0);
      for (int r = 0; r < plan.cp_size; ++r) CHECK(ranks_seen[static_cast<size_t>(r)] == 1);
      const gpu::TimelineSummary t = gpu::summarize(options.timeline->spans);
      CHECK(t.busy_ms.at("compute") > 0.0);
      CHECK(t.busy_ms.at("compute") <= t.end_ms - t.begin_ms + 1e-9);
    }
  });
}

// The phase breakdown (bench_cp_local --phases 1) serialises the ranks' operations under one lock while the
// exchanges rendezvous outside it: every comm type completes (a lock held across a rendezvous deadlocked W >= 2),
// gives the same outputs as the untimed run, and files every attention call under its pass and step section.
TEST_CASE("local CP: the phase breakdown completes for every comm type and counts every attention call") {
  CPGOLD_REQUIRE_DEVICE();
  for_one_case_per_comm([&](const fx::SuiteCase& c, const sim::Plan& plan, const sim::CaseInputs& inputs) {
    gpu::CpGpuOptions plain = deterministic_options();
    gpu::CpGpuOptions timed = plain;
    add_phase_breakdown(timed);
    const sim::CpRun<float> want = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, plain).run(true);
    const sim::CpRun<float> got = gpu::LocalCpExecutor(plan, inputs, c.spec.dtype, timed).run(true);
    for (int r = 0; r < plan.cp_size; ++r) {
      const auto& a = want.ranks[static_cast<size_t>(r)];
      const auto& b = got.ranks[static_cast<size_t>(r)];
      CHECK(std::memcmp(a.o.values.data(), b.o.values.data(), a.o.values.size() * 4) == 0);
      CHECK(std::memcmp(a.dk.values.data(), b.dk.values.data(), a.dk.values.size() * 4) == 0);
    }
    for (const sim::PassKind pass : {sim::PassKind::forward, sim::PassKind::backward}) {
      const sim::PassPlan& pp = pass == sim::PassKind::forward ? plan.forward : plan.backward;
      for (const sim::StepSection sec : {sim::StepSection::diagonal, sim::StepSection::lower, sim::StepSection::upper,
                                         sim::StepSection::all}) {
        int64_t calls = 0;
        for (const sim::Tile& t : pp.tiles) calls += t.computed && t.section == sec;
        CAPTURE(gpu::attention_phase(pass, sec));
        CHECK(phase_calls(*timed.phases, gpu::attention_phase(pass, sec)) == calls);
      }
    }
    if (plan.cp_size > 1) CHECK(timed.phases->phases.count("exchange") == 1);
  });
}

TEST_CASE("local communicator: a receive without a matching send times out naming rank and operation") {
  CPGOLD_REQUIRE_DEVICE();
  gpu::CommOptions options;
  options.timeout = std::chrono::milliseconds(300);
  auto comms = gpu::make_local_communicators(2, options);
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        if (r == 0) {
          float* buffer = nullptr;
          cudaMalloc(reinterpret_cast<void**>(&buffer), 64);
          const gpu::RecvFrom recv{1, buffer, 64};
          comms[0]->send_recv({}, {&recv, 1});
          cudaFree(buffer);
        }
        // rank 1 never sends
      } catch (const gpu::CommError& e) {
        errors[static_cast<size_t>(r)] = e.what();
        CHECK(e.rank() == 0);
        CHECK(e.operation() == gpu::CommOp::send_recv);
        CHECK(e.fault() == gpu::CommFault::timeout);
      }
    });
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MESSAGE(errors[0]);
  CHECK(errors[0].find("rank 0") != std::string::npos);
  CHECK(errors[0].find("send_recv") != std::string::npos);
  CHECK(errors[0].find("rank 1") != std::string::npos);
  CHECK(seconds < 5.0);
  // The communicator is aborted afterwards: the next call fails at once.
  CHECK_THROWS_AS(comms[1]->all_gather(nullptr, nullptr, 0), gpu::CommError);
}

TEST_CASE("local communicator: ring shift, all-gather, reduce-scatter (rank order) and all-to-all move the right bytes") {
  CPGOLD_REQUIRE_DEVICE();
  const int W = 4;
  const size_t n = 8;
  auto comms = gpu::make_local_communicators(W);
  std::vector<std::vector<float>> got_ring(W), got_ag(W), got_rs(W), got_a2a(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      gpu::Communicator& c = *comms[static_cast<size_t>(r)];
      auto stream = static_cast<cudaStream_t>(c.stream());
      std::vector<float> mine(n * W);
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<float>(r * 1000 + static_cast<int>(i));
      float *send = nullptr, *recv = nullptr;
      cudaMalloc(reinterpret_cast<void**>(&send), mine.size() * 4);
      cudaMalloc(reinterpret_cast<void**>(&recv), mine.size() * 4);
      cudaMemcpy(send, mine.data(), mine.size() * 4, cudaMemcpyHostToDevice);
      auto read = [&](std::vector<float>& out, size_t count) {
        c.synchronize();
        out.resize(count);
        cudaMemcpy(out.data(), recv, count * 4, cudaMemcpyDeviceToHost);
      };
      const gpu::SendTo s{(r + 1) % W, send, n * 4};
      const gpu::RecvFrom v{(r + W - 1) % W, recv, n * 4};
      c.send_recv({&s, 1}, {&v, 1});
      read(got_ring[static_cast<size_t>(r)], n);
      c.all_gather(send, recv, n * 4);
      read(got_ag[static_cast<size_t>(r)], n * W);
      c.reduce_scatter_sum(send, recv, n);
      read(got_rs[static_cast<size_t>(r)], n);
      c.all_to_all(send, recv, n * 4);
      read(got_a2a[static_cast<size_t>(r)], n * W);
      (void)stream;
      cudaFree(send);
      cudaFree(recv);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < W; ++r) {
    const int prev = (r + W - 1) % W;
    for (size_t i = 0; i < n; ++i) {
      CHECK(got_ring[r][i] == static_cast<float>(prev * 1000 + static_cast<int>(i)));
      float sum = 0.0f;
      for (int x = 0; x < W; ++x) sum += static_cast<float>(x * 1000 + r * static_cast<int>(n) + static_cast<int>(i));
      CHECK(got_rs[r][i] == sum);
      for (int x = 0; x < W; ++x) {
        CHECK(got_ag[r][x * n + i] == static_cast<float>(x * 1000 + static_cast<int>(i)));
        CHECK(got_a2a[r][x * n + i] == static_cast<float>(x * 1000 + r * static_cast<int>(n) + static_cast<int>(i)));
      }
    }
  }
}
