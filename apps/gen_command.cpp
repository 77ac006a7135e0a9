// `cpgold gen`: a case or a suite to HDF5 fixtures. Size and time estimate before each long case, a progress bar
// with ETA on a terminal (plain lines otherwise), a summary table at the end.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "apps/case_options.hpp"
#include "apps/command_registry.hpp"
#include "fixtures/fixture_writer.hpp"
#include "fixtures/golden_manifest.hpp"
#include "fixtures/suites.hpp"
#include "reference/input_error.hpp"
#include "sim/case_spec.hpp"

namespace cpgold::app {
namespace {

namespace fs = std::filesystem;

std::string human_bytes(double bytes) {
  char buffer[32];
  if (bytes >= 1e9) std::snprintf(buffer, sizeof buffer, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(buffer, sizeof buffer, "%.2f MB", bytes / 1e6);
  else if (bytes >= 1e3) std::snprintf(buffer, sizeof buffer, "%.1f kB", bytes / 1e3);
  else std::snprintf(buffer, sizeof buffer, "%.0f B", bytes);
  return buffer;
}

std::string seconds_text(double s) {
  char buffer[32];
  if (s >= 60) std::snprintf(buffer, sizeof buffer, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  else std::snprintf(buffer, sizeof buffer, "%.1fs", s);
  return buffer;
}

// Work of a case in attention "pair-dims": sum over sequences of L_q * L_kv * heads_q * (d_qk + d_v), times the
// runs the generator makes (oracle, non-CP peer, CP peer, and the float64 CP oracle with --trace).
double case_work(const sim::CaseSpec& spec, bool trace) {
  const std::vector<int32_t> kv = sim::seqlens_kv(spec);
  double pairs = 0;
  for (size_t b = 0; b < spec.seqlens_q.size(); ++b) pairs += double(spec.seqlens_q[b]) * kv[b];
  return pairs * spec.heads_q * (spec.dim_qk + sim::dim_v(spec)) * (trace ? 4 : 3);
}

// Uncompressed bytes: inputs, goldens + peer, per-rank copies of both.
double case_bytes(const sim::CaseSpec& spec) {
  const ThdLayout layout = sim::layout(spec);
  const double tq = double(layout.q.total_rows), tkv = double(layout.kv.total_rows);
  const double hq = spec.heads_q, hkv = sim::heads_kv(spec), dqk = spec.dim_qk, dv = sim::dim_v(spec);
  const double in = dtype_bytes(spec.dtype);
  const double inputs = (tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv)) * in;
  const double outputs = tq * hq * (dv + dqk + 1) + tkv * hkv * (dqk + dv);
  return 2 * inputs + outputs * (4 + in) + outputs * 4;
}

struct Job {
  std::string name, path;
  sim::CaseSpec spec;
  bool cpu_only = false;
  bool trace = false;  // the suite asks for step partials (golden)
};

struct Done {
  std::string name, status;
  bool cpu_only = false;
  int64_t bytes = 0;
  int datasets = 0;
  double seconds = 0;
};

// `--suite random --count N --seed S`: the seed flag names the suite's seed, not a case key.
std::vector<fx::SuiteCase> random_suite(CaseFlags& flags, int count) {
  const auto seed = flags.values.find("seed");
  if (count < 1) fail_input("--count", "--suite random needs --count N (N >= 1), got ", count);
  if (seed == flags.values.end()) fail_input("--seed", "--suite random needs --seed S");
  uint64_t value = 0;
  try {
    size_t used = 0;
    value = std::stoull(seed->second, &used);
    if (used != seed->second.size() || seed->second.starts_with('-')) throw std::invalid_argument(seed->second);
  } catch (const std::exception&) {
    fail_input("--seed", "value \"", seed->second, "\" is not a non-negative integer");
  }
  flags.values.erase(seed);
  return fx::random_cases(count, value);
}

int run_gen(CaseFlags flags, const std::string& suite, const std::string& output, bool force, bool trace,
            const std::vector<std::string>& only, bool manifest, int count) {
  std::vector<fx::SuiteCase> random;
  if (suite == "random") random = random_suite(flags, count);
  else if (count != 0) fail_input("--count", "only with --suite random");
  const bool case_given = !flags.case_json.empty() || !flags.values.empty();
  if (case_given == !suite.empty()) fail_input("gen", "give either a case (--case or case flags) or --suite, not both");
  if (manifest && (suite.empty() || !only.empty()))
    fail_input("--manifest", "needs --suite and the whole suite (no --only)");
  if (output.empty()) fail_input("-o", "an output path is required (a file for a case, a folder for a suite)");
  std::vector<Job> jobs;
  if (!suite.empty()) {
    std::error_code ec;
    fs::create_directories(output, ec);
    if (!fs::is_directory(output)) fail_input("-o", "cannot create output folder '", output, "'");
    for (const fx::SuiteCase& c : suite == "random" ? random : fx::suite_cases(suite)) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      jobs.push_back({c.name, (fs::path(output) / (c.name + ".h5")).string(), c.spec, c.cpu_only, c.trace});
    }
    if (jobs.empty()) fail_input("--only", "no case of suite ", suite, " matches");
  } else {
    const sim::CaseSpec spec = case_from_flags(flags);
    jobs.push_back({fs::path(output).stem().string(), output, spec, !fx::inside_gpu_table(spec)});
  }
  // Refuse before any work if a destination exists without --force.
  for (const Job& job : jobs)
    if (fs::exists(job.path) && !force) fail_input(job.path, "exists already; pass --force to replace it");

  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  double rate = 2.0e9;  // work units per second, refined after every case
  double total_work = 0;
  for (const Job& job : jobs) total_work += case_work(job.spec, trace || job.trace);
  double work_done = 0;
  const auto start = std::chrono::steady_clock::now();
  std::vector<Done> done;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& job = jobs[i];
    const double work = case_work(job.spec, trace || job.trace);
    const double estimate = work / rate;
    const double eta = (total_work - work_done) / rate;
    if (estimate > 2.0 || !terminal)
      std::fprintf(stderr, "[%zu/%zu] %s: about %s, %s (ETA %s)\n", i + 1, jobs.size(), job.name.c_str(),
                   human_bytes(case_bytes(job.spec)).c_str(), seconds_text(estimate).c_str(), seconds_text(eta).c_str());
    if (terminal) {
      const int width = 30;
      const int filled = static_cast<int>(width * (total_work > 0 ? work_done / total_work : 0));
      std::fprintf(stderr, "\r[%s%s] %zu/%zu %-40s ETA %s", std::string(filled, '#').c_str(),
                   std::string(width - filled, '.').c_str(), i, jobs.size(), job.name.c_str(), seconds_text(eta).c_str());
      std::fflush(stderr);
    }
    const auto t0 = std::chrono::steady_clock::now();
    fx::GenerateOptions options;
    options.trace = trace || job.trace;
    const fx::GoldenRun run = fx::generate(job.spec, options);
    fx::WriteOptions write_options;
    write_options.force = force;
    const fx::WriteSummary summary = fx::write_fixture(run, job.path, write_options);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    work_done += work;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > 0.5 && work_done > 0) rate = work_done / elapsed;  // cumulative: overheads included
    done.push_back({job.name, "written", job.cpu_only, summary.bytes, summary.datasets, seconds});
    if (!terminal) std::fprintf(stderr, "[%zu/%zu] %s: wrote %s in %s\n", i + 1, jobs.size(), summary.path.c_str(),
                                human_bytes(double(summary.bytes)).c_str(), seconds_text(seconds).c_str());
  }
  if (terminal) std::fprintf(stderr, "\r%-90s\r", "");
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%-34s %-8s %10s %8s %8s %s\n", "case", "status", "size", "datasets", "time", "label");
  int64_t bytes = 0;
  for (const Done& d : done) {
    std::printf("%-34s %-8s %10s %8d %8s %s\n", d.name.c_str(), d.status.c_str(), human_bytes(double(d.bytes)).c_str(),
                d.datasets, seconds_text(d.seconds).c_str(), d.cpu_only ? "cpu-only" : "gpu-table");
    bytes += d.bytes;
  }
  std::printf("%zu fixture(s), %s in %s (%.2f cases/s, %.2f MB/s)\n", done.size(), human_bytes(double(bytes)).c_str(),
              seconds_text(total).c_str(), done.size() / std::max(total, 1e-9), bytes / 1e6 / std::max(total, 1e-9));
  if (manifest) {
    std::vector<fx::FixtureDigest> digests;
    for (const Job& job : jobs) digests.push_back(fx::digest_fixture(job.path));
    std::printf("manifest: %s\n", fx::write_manifest(output, suite, digests).c_str());
  }
  return kExitPass;
}

const RegisterCommand registered("gen", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand("gen", "generate golden fixtures (HDF5) for a case or a suite");
  auto flags = std::make_shared<CaseFlags>();
  auto suite = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  auto force = std::make_shared<bool>(false);
  auto trace = std::make_shared<bool>(false);
  auto only = std::make_shared<std::vector<std::string>>();
  auto manifest = std::make_shared<bool>(false);
  auto count = std::make_shared<int>(0);
  add_case_flags(*sub, flags);
  sub->add_option("--suite", *suite, "suite name: quick, edge, te, full, golden, random (with --count and --seed)");
  sub->add_option("--count", *count, "with --suite random: number of cases (with --seed S: the same cases every time)");
  sub->add_option("-o,--output", *output, "output file (a case) or folder (a suite)");
  sub->add_flag("--force", *force, "replace existing fixtures");
  sub->add_flag("--trace", *trace, "also store the per-step partials of the forward and backward");
  sub->add_option("--only", *only, "with --suite: generate only these case names")->delimiter(',');
  sub->add_flag("--manifest", *manifest,
                "with --suite: also write MANIFEST.json (case JSON and SHA-256 of every dataset) into the folder");
  return [=] { return run_gen(*flags, *suite, *output, *force, *trace, *only, *manifest, *count); };
});

}  // namespace
}  // namespace cpgold::app
