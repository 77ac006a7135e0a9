// `cpgold gen`: a case or a suite to HDF5 fixtures. Before any work: the destinations, and the memory and disk
// estimates against what the machine has. Size and time estimate before each long case, progress during its compute
// (a bar on a terminal, a line every 10 s otherwise), a summary table at the end.
#include <sys/stat.h>
#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <nlohmann/json.hpp>

#include "apps/case_options.hpp"
#include "apps/command_registry.hpp"
#include "apps/machine_resources.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "fixtures/golden/fixture_part.hpp"
#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/gen_job.hpp"
#include "fixtures/golden/given_inputs_file.hpp"
#include "fixtures/golden/generate_admission.hpp"
#include "fixtures/golden/golden_manifest.hpp"
#include "fixtures/storage/output_file.hpp"
#include "fixtures/golden/suites.hpp"
#include "reference/attention_engine.hpp"
#include "reference/input_error.hpp"
#include "reference/progress.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::app {
namespace {

namespace fs = std::filesystem;

using fx::human_bytes;

std::string seconds_text(double s) {
  char buffer[32];
  if (s >= 60) std::snprintf(buffer, sizeof buffer, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  else std::snprintf(buffer, sizeof buffer, "%.1fs", s);
  return buffer;
}

// Progress of one phase of a case (compute: score-tile elements the kernels report from any thread; write: raw bytes
// from the writing thread) against its expected total, always with the time left: a bar on a terminal (at most 10
// updates a second), otherwise a line every 5 seconds, so that no phase of a long case is silent for long.
class PhaseProgress {
 public:
  PhaseProgress(std::string label, std::string done_word, double expected, bool terminal)
      : label_(std::move(label)), done_word_(std::move(done_word)), expected_(std::max(expected, 1.0)),
        terminal_(terminal), start_(std::chrono::steady_clock::now()), last_(start_) {
    // Between the kernels' reports (the budgets, gathers and copies between passes) a ticker keeps the line alive.
    ticker_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(ticker_mutex_);
      while (!finished_) {
        ticker_wake_.wait_for(lock, std::chrono::milliseconds(terminal_ ? 500 : 5000));
        if (!finished_) report(done_.load());
      }
    });
  }
  ~PhaseProgress() { finish(); }
  void add(double amount) { report(done_.fetch_add(amount) + amount); }
  void set(double done) {
    done_.store(done);
    report(done);
  }
  void finish() {
    {
      std::lock_guard<std::mutex> lock(ticker_mutex_);
      if (finished_) return;
      finished_ = true;
    }
    ticker_wake_.notify_all();
    if (ticker_.joinable()) ticker_.join();
    if (terminal_) std::fprintf(stderr, "\r%-110s\r", "");
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  void report(double done) {
    const auto now = std::chrono::steady_clock::now();
    const double since = std::chrono::duration<double>(now - last_.load()).count();
    if (since < (terminal_ ? 0.1 : 4.9)) return;
    std::unique_lock<std::mutex> lock(print_, std::try_to_lock);
    if (!lock.owns_lock()) return;
    last_ = now;
    const double fraction = std::min(0.99, done / expected_);
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double left = fraction > 0.02 ? elapsed * (1 - fraction) / fraction : -1;
    const std::string left_text = left >= 0 ? ", about " + seconds_text(left) + " left" : "";
    if (terminal_) {
      const int width = 30, filled = static_cast<int>(width * fraction);
      std::fprintf(stderr, "\r  %s [%s%s] %3.0f%% %s, %s elapsed%s   ", label_.c_str(), std::string(filled, '#').c_str(),
                   std::string(width - filled, '.').c_str(), 100 * fraction, done_word_.c_str(),
                   seconds_text(elapsed).c_str(), left_text.c_str());
    } else {
      std::fprintf(stderr, "  %s: %.0f%% %s after %s%s\n", label_.c_str(), 100 * fraction, done_word_.c_str(),
                   seconds_text(elapsed).c_str(), left_text.c_str());
    }
    std::fflush(stderr);
  }

  std::string label_, done_word_;
  double expected_;
  bool terminal_;
  std::chrono::steady_clock::time_point start_;
  std::atomic<std::chrono::steady_clock::time_point> last_;
  std::atomic<double> done_{0};
  std::mutex print_;
  std::mutex ticker_mutex_;
  std::condition_variable ticker_wake_;
  bool finished_ = false;
  std::thread ticker_;
};

// The compute phase as the kernels see it.
class ComputeProgress final : public ProgressSink {
 public:
  explicit ComputeProgress(PhaseProgress& phase) : phase_(phase) {}
  void advance(int64_t score_elements) override { phase_.add(static_cast<double>(score_elements)); }

 private:
  PhaseProgress& phase_;
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

// What `cpgold gen` is asked for, as its options bind it.
struct GenArgs {
  CaseFlags flags;         // --case and the case flags
  std::string suite;       // --suite
  std::string output;      // -o
  bool force = false, trace = false, manifest = false, yes = false;
  std::vector<std::string> only;  // --only
  int count = 0;           // --count (--suite random)
  std::string inputs;      // --inputs FILE.h5: the case's q, k, v, dout given, not drawn from the seed
  bool allow_nonfinite = false;  // --allow-nonfinite-inputs
  std::string shard;       // --shard I/N: part I of N (KV-head groups), written as a part file for `cpgold merge`
  std::string engine = "cpu";  // --engine cpu|gpu|auto: what computes the oracle and the peers
};

// The engine `--engine` names (choose_engine, reference/attention_engine.hpp), said on stderr where not the default.
const AttentionEngine* choose_engine(const std::string& name, std::unique_ptr<AttentionEngine>& holder) {
  std::string chosen;
  const AttentionEngine* engine = choose_engine(name, "--engine", holder, chosen);
  if (name != "cpu") std::fprintf(stderr, "engine: %s\n", chosen.c_str());
  return engine;
}

// "I/N" with 1 <= I <= N: the shard's index and count (the case's heads bound N later, fx::shard_heads).
std::pair<int, int> parse_shard(const std::string& text) {
  const size_t slash = text.find('/');
  auto number = [&](const std::string& part, const char* what) {
    if (part.empty() || part.size() > 7 || part.find_first_not_of("0123456789") != std::string::npos)
      fail_input("--shard", "value \"", sim::excerpt(text, 40), "\": ", what, " is not a positive integer (--shard I/N, "
                 "e.g. --shard 2/8 for the second of eight parts)");
    return std::stoi(part);
  };
  if (slash == std::string::npos)
    fail_input("--shard", "value \"", sim::excerpt(text, 40), "\" is not I/N (e.g. --shard 2/8 for the second of eight "
               "parts)");
  const int index = number(text.substr(0, slash), "I"), count = number(text.substr(slash + 1), "N");
  if (count < 1) fail_input("--shard", "value \"", text, "\": N = ", count, ", at least 1");
  if (index < 1 || index > count)
    fail_input("--shard", "value \"", text, "\": I = ", index, " is not in 1..", count, " (shards count from 1)");
  return {index, count};
}

int run_gen(GenArgs args) {
  CaseFlags& flags = args.flags;
  const std::string& suite = args.suite;
  const std::string& output = args.output;
  const bool force = args.force, trace = args.trace, manifest = args.manifest, yes = args.yes;
  const std::vector<std::string>& only = args.only;
  const int count = args.count;
  std::vector<fx::SuiteCase> random;
  if (suite == "random") random = random_suite(flags, count);
  else if (count != 0) fail_input("--count", "only with --suite random");
  const bool case_given = !flags.case_json.empty() || !flags.values.empty();
  if (case_given && !suite.empty()) fail_input("gen", "give either a case (--case or case flags) or --suite, not both");
  if (!case_given && suite.empty()) fail_input("gen", "nothing to generate: give a case (--case or case flags) or --suite");
  if (manifest && (suite.empty() || !only.empty()))
    fail_input("--manifest", "needs --suite and the whole suite (no --only)");
  if (output.empty()) fail_input("-o", "an output path is required (a file for a case, a folder for a suite)");
  if (!args.inputs.empty() && !suite.empty())
    fail_input("--inputs", "gives the tensors of one case: give a case (--case or case flags), not --suite");
  if (args.allow_nonfinite && args.inputs.empty())
    fail_input("--allow-nonfinite-inputs", "only with --inputs (seeded inputs are always finite in valid rows)");
  std::pair<int, int> shard{0, 0};
  if (!args.shard.empty()) {
    if (!suite.empty()) fail_input("--shard", "splits one case: give a case (--case or case flags), not --suite");
    shard = parse_shard(args.shard);
  }
  // Each job's case is validated once (sim::parse_case) and its cost, Plan and memory computed once (admit_gen_jobs).
  std::vector<fx::GenJob> jobs;
  if (!suite.empty()) {
    // The suite's cases first: an unknown suite is refused before the folder is created.
    const std::vector<fx::SuiteCase> cases = suite == "random" ? random : fx::suite_cases(suite);
    for (const fx::SuiteCase& c : cases) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      jobs.push_back({c.name, (fs::path(output) / (c.name + ".h5")).string(), c.spec, trace || c.trace, c.cpu_only});
    }
    for (const std::string& name : only)
      if (std::none_of(cases.begin(), cases.end(), [&](const fx::SuiteCase& c) { return c.name == name; }))
        fail_input("--only", "no case named \"", name, "\" in suite ", suite);
    if (jobs.empty()) fail_input("--only", "no case of suite ", suite, " matches");
    std::error_code ec;
    struct stat info {};
    if (::lstat(output.c_str(), &info) == 0 && !S_ISDIR(info.st_mode))
      fail_input("-o", "'", output, "' exists and is not a folder (a suite is written into a folder)");
    fs::create_directories(output, ec);
    if (!fs::is_directory(output)) fail_input("-o", "cannot create output folder '", output, "'", ec ? " (" + ec.message() + ")" : "");
  } else {
    const sim::CaseSpec spec = case_from_flags(flags);
    jobs.push_back({fs::path(output).stem().string(), output, spec, trace, !fx::inside_gpu_table(spec)});
    if (shard.second > 0) {
      fx::GenJob& job = jobs.back();
      job.heads = fx::shard_heads(spec, shard.first, shard.second);
      job.shard_index = shard.first;
      job.shard_count = shard.second;
    }
  }
  // Refuse before any work: a missing or unwritable folder, a destination that exists (without --force) or is not a
  // regular file (with --force); the manifest's destination by the same rules.
  for (const fx::GenJob& job : jobs) fx::check_destination(job.path, force);
  const std::string manifest_path = (fs::path(output) / fx::kManifestName).string();
  if (manifest) fx::check_destination(manifest_path, force);

  // Given inputs: read and checked once the destination is known to be free, before any estimate or compute. The
  // case's pad_fill becomes what their pad rows hold (sim::check_given_inputs).
  std::shared_ptr<sim::CaseInputs> given;
  sim::GivenInputsSummary given_summary;
  if (!args.inputs.empty()) {
    std::error_code same_ec;
    if (fs::exists(output) && fs::equivalent(args.inputs, output, same_ec))
      fail_input("--inputs", "'", args.inputs, "' is also the output (-o): a fixture never replaces its own inputs");
    given = std::make_shared<sim::CaseInputs>(fx::read_given_inputs(args.inputs, jobs.front().spec));
    jobs.front().given_inputs = true;
    const sim::PadFill asked = jobs.front().spec.pad_fill;
    given_summary = sim::check_given_inputs(jobs.front().spec, *given, args.allow_nonfinite);
    std::fprintf(stderr, "inputs: given from %s (not drawn from the seed)%s\n", args.inputs.c_str(),
                 asked == given_summary.pad_fill
                     ? ""
                     : ("; pad_fill " + std::string(sim::pad_fill_name(asked)) + " -> " +
                        std::string(sim::pad_fill_name(given_summary.pad_fill)) + ", what their pad rows hold")
                           .c_str());
    if (given_summary.nonfinite_valid > 0)
      std::fprintf(stderr, "inputs: FLAGGED: %lld NaN or infinite value(s) in valid rows, the first at %s "
                   "(--allow-nonfinite-inputs); the fixture records it\n",
                   static_cast<long long>(given_summary.nonfinite_valid), given_summary.first_nonfinite.c_str());
  }

  // Refuse before any work when the estimates exceed what the machine has, with a margin (unless --yes):
  // fx::admit_gen_jobs, which cpgold.generate in Python goes through too.
  const std::string folder = fs::absolute(fs::path(jobs.front().path)).parent_path().string();
  std::unique_ptr<AttentionEngine> engine_holder;
  const AttentionEngine* engine = choose_engine(args.engine, engine_holder);
  const bool on_gpu = engine->name() != "cpu";
  (void)fx::admit_gen_jobs(jobs, folder, yes, "--yes");
  // The GPU engine's time model replaces the CPU's (fx::gpu_generate_estimate); memory on the host is the CPU run's.
  if (on_gpu)
    for (fx::GenJob& job : jobs) {
      const fx::GpuEstimate e = fx::gpu_generate_estimate(job, omp_get_max_threads());
      job.cost.seconds = e.seconds();
      if (job.cost.seconds > 2.0 || jobs.size() == 1)
        std::fprintf(stderr, "%s: GPU engine estimate %s: device %s, host-device copies %s, host %s, write %s\n",
                     job.name.c_str(), seconds_text(e.seconds()).c_str(), seconds_text(e.device).c_str(),
                     seconds_text(e.transfers).c_str(), seconds_text(e.host).c_str(), seconds_text(e.write).c_str());
    }
  auto out_of_memory = [&](const fx::GenJob& job, double needed) {
    const ThdLayout layout = sim::layout(job.spec);
    fail_input(job.name, "out of memory: total_tokens_q = ", layout.q.total_rows, ", total_tokens_kv = ",
               layout.kv.total_rows, ", heads_q = ", job.spec.heads_q, ", dim_qk = ", job.spec.dim_qk,
               ", cp_size = ", job.spec.cp_size, " need about ", human_bytes(needed), ", ",
               human_bytes(double(machine_resources(folder).memory_available)), " are available");
  };

  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  double total_estimate = 0;
  for (const fx::GenJob& job : jobs) total_estimate += job.cost.seconds;
  double correction = 1.0;  // measured / estimated, refined after every case
  double estimated_done = 0;
  const auto start = std::chrono::steady_clock::now();
  std::vector<Done> done;
  for (size_t i = 0; i < jobs.size(); ++i) {
    fx::GenJob& job = jobs[i];
    const bool job_trace = job.trace;
    const sim::CaseCost& cost = job.cost;
    const double estimate = cost.seconds;
    const double eta = (total_estimate - estimated_done) * correction;
    if (estimate * correction > 2.0 || !terminal)
      std::fprintf(stderr, "[%zu/%zu] %s: at most %s on disk, about %s of memory (peak: %s), %s (ETA %s)\n", i + 1,
                   jobs.size(), job.name.c_str(), human_bytes(job.disk_bound).c_str(),
                   human_bytes(job.memory.peak()).c_str(), job.memory.peak_phase().c_str(),
                   seconds_text(estimate * correction).c_str(), seconds_text(eta).c_str());
    const auto t0 = std::chrono::steady_clock::now();
    const std::string label = "[" + std::to_string(i + 1) + "/" + std::to_string(jobs.size()) + "] " + job.name;
    if (job.shard_count > 0)
      std::fprintf(stderr, "%s: shard %d/%d: KV heads %d..%d with query heads %d..%d of %d\n", label.c_str(),
                   job.shard_index, job.shard_count, job.heads.kv_begin, job.heads.kv_end - 1, job.heads.q_begin,
                   job.heads.q_end - 1, job.spec.heads_q);
    PhaseProgress compute_phase(label, "computed", cost.pairs * sim::kernel_passes(job_trace), terminal);
    ComputeProgress progress(compute_phase);
    fx::GenerateOptions options;
    options.trace = job_trace;
    options.heads = job.heads;
    options.progress = &progress;
    options.given_inputs = given;
    options.nonfinite_valid = given_summary.nonfinite_valid;
    options.engine = engine;
    fx::GoldenRun run = [&] {
      try {
        return fx::generate(job, options);
      } catch (const std::bad_alloc&) {  // with --yes, or when the estimate was too low
        out_of_memory(job, job.memory.peak());
      }
    }();
    compute_phase.finish();
    const double compute_seconds = compute_phase.seconds();
    const double raw_bytes = static_cast<double>(job.shard_count > 0 ? fx::part_payload_bytes(run) : fx::payload_bytes(run));
    const bool long_case = estimate * correction > 2.0 || !terminal;
    if (long_case) {
      std::fprintf(stderr, "%s: computed in %s; writing %s of data (shuffle + deflate + Fletcher32 on %d threads)\n",
                   label.c_str(), seconds_text(compute_seconds).c_str(), human_bytes(raw_bytes).c_str(),
                   omp_get_max_threads());
      std::fprintf(stderr, "%s: engine %s: oracle %s, non-CP peer %s, CP simulator %s%s%s\n", label.c_str(),
                   run.engine.c_str(), seconds_text(run.times.oracle).c_str(), seconds_text(run.times.peer).c_str(),
                   seconds_text(run.times.simulator).c_str(), job_trace ? ", CP oracle (trace) " : "",
                   job_trace ? seconds_text(run.times.trace).c_str() : "");
    }
    PhaseProgress write_phase(label, "written", raw_bytes, terminal);
    fx::WriteOptions write_options;
    write_options.force = force;
    write_options.progress = [&](int64_t written, int64_t) { write_phase.set(static_cast<double>(written)); };
    const fx::WriteSummary summary =
        job.shard_count > 0 ? fx::write_part(run, job.shard_index, job.shard_count, job.path, write_options)
                            : fx::write_fixture(std::move(run), job.path, write_options);
    write_phase.finish();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    estimated_done += estimate;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > 0.5 && estimated_done > 0) correction = elapsed / estimated_done;  // cumulative: overheads included
    done.push_back({job.name, job.shard_count > 0 ? "part" : "written", job.cpu_only, summary.bytes, summary.datasets,
                    seconds});
    if (long_case)
      std::fprintf(stderr, "[%zu/%zu] %s: wrote %s in %s (compute %s, write %s; estimated %s)\n", i + 1, jobs.size(),
                   summary.path.c_str(), human_bytes(double(summary.bytes)).c_str(), seconds_text(seconds).c_str(),
                   seconds_text(compute_seconds).c_str(), seconds_text(write_phase.seconds()).c_str(),
                   seconds_text(estimate).c_str());
  }
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
  if (suite == "random")  // each case as one line, pasteable into `cpgold gen --case` to reproduce it alone
    for (const fx::SuiteCase& c : random)
      if (only.empty() || std::find(only.begin(), only.end(), c.name) != only.end())
        std::printf("case %s %s\n", c.name.c_str(), c.json.c_str());
  if (shard.second > 0)
    std::printf("part %d/%d written: `cpgold merge` of all %d parts writes the fixture (cpgold merge PART... -o FIXTURE)\n",
                shard.first, shard.second, shard.second);
  if (manifest) {
    std::vector<fx::FixtureDigest> digests;
    for (const fx::GenJob& job : jobs) digests.push_back(fx::digest_fixture(job.path));
    std::printf("manifest: %s\n", fx::write_manifest(output, suite, digests, force).c_str());
  }
  return kExitPass;
}

const RegisterCommand registered("gen", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand("gen", "generate golden fixtures (HDF5) for a case or a suite");
  auto args = std::make_shared<GenArgs>();
  add_case_flags(*sub, std::shared_ptr<CaseFlags>(args, &args->flags));
  sub->add_option("--suite", args->suite, "suite name: quick, edge, te, full, golden, random (with --count and --seed)");
  sub->add_option("--count", args->count, "with --suite random: number of cases, 1..10000 (with --seed S: the same cases every time; the bound: gen "
                  "builds the whole list and checks every case's estimates before it writes the first fixture, and "
                  "10000 fixtures take hours; use several seeds for more)");
  sub->add_option("-o,--output", args->output, "output file (a case) or folder (a suite)");
  sub->add_flag("--force", args->force, "replace existing fixtures");
  sub->add_flag("--trace", args->trace, "also store the per-step partials of the forward and backward");
  sub->add_option("--only", args->only, "with --suite: generate only these case names")->delimiter(',');
  sub->add_flag("--manifest", args->manifest,
                "with --suite: also write MANIFEST.json (case JSON and SHA-256 of every dataset) into the folder");
  sub->add_option("--inputs", args->inputs,
                  "HDF5 file with datasets q, k, v, dout (the global padded THD layout of the case, values of its "
                  "dtype): the fixture's golden, peer, per-rank and per-step data are computed from them instead of "
                  "from the seed (docs/capture.md)");
  sub->add_flag("--allow-nonfinite-inputs", args->allow_nonfinite,
                "with --inputs: accept NaN or infinite values in valid rows (refused otherwise); the fixture is flagged");
  sub->add_option("--shard", args->shard,
                  "I/N: compute part I of N of the fixture (KV-head groups with their query heads; N at most heads_kv) "
                  "and write it as a part file to -o; `cpgold merge` of all N parts writes the fixture, bit for bit the "
                  "one gen writes without --shard (docs/cli.md)");
  sub->add_option("--engine", args->engine,
                  "cpu (default): the CPU reference computes the oracle and the peers; gpu: a CUDA device does (exit 2 "
                  "when none can be used, never a silent fallback; the fixture records the engine and its versions); "
                  "auto: gpu where a device can be used, else cpu, and says which (docs/scale.md)");
  sub->add_flag("--yes", args->yes, "go ahead although the memory or disk estimate exceeds what is available");
  return [=] { return run_gen(*args); };
});

}  // namespace
}  // namespace cpgold::app
