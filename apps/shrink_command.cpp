// `cpgold shrink GOLDEN --run "COMMAND"`: from a fixture whose candidate fails its check, the smallest case whose
// candidate fails the same way (docs/shrink.md). COMMAND is run through /bin/sh with {fixture}, {candidate} and
// optionally {rank} replaced; every step generates its fixture, runs COMMAND and checks what it wrote.
// Exit 0: a smaller failing case was found; 1: the original is already minimal; 2: bad input (the original passing
// or giving no candidate included).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "check/engine.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "check/shrink.hpp"
#include "reference/input_error.hpp"

namespace cpgold::app {
namespace {

struct ShrinkArgs {
  std::string golden, command, format = "text", work_dir, kinds, tensors, empty_row_lse = "neg-inf", pad_rows = "zero", dims;
  bool any_failure = false, same_tensors = false, keep = false;
  double budget = 0, run_timeout = 300;
  int64_t max_runs = 0;
  uint64_t seed = 0;
  int reseed = 0;
};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

std::string with_placeholders(const std::string& command, const std::string& fixture, const std::string& candidate,
                              const std::string& rank) {
  return replace_all(replace_all(replace_all(command, "{fixture}", fixture), "{candidate}", candidate), "{rank}", rank);
}

// Comma-separated items, none empty.
std::vector<std::string> items(const std::string& text, const std::string& field) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  size_t begin = 0;
  for (;;) {
    const size_t end = text.find(',', begin);
    out.push_back(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (out.back().empty()) fail_input(field, "empty item in \"", text, "\"");
    if (end == std::string::npos) return out;
    begin = end + 1;
  }
}

struct ProcessOutcome {
  bool ok = false;
  std::string detail;  // why not
};

// Runs the shell commands at once (one per rank), each in its own process group, output appended to `log`; kills
// every group still running after `timeout` seconds (0: no limit).
ProcessOutcome run_processes(const std::vector<std::string>& commands, const std::string& log, double timeout) {
  std::vector<pid_t> pids;
  for (const std::string& command : commands) {
    std::cout.flush();
    std::cerr.flush();
    const pid_t pid = fork();
    if (pid < 0) return {false, "cannot start /bin/sh (fork failed)"};
    if (pid == 0) {
      setpgid(0, 0);
      const int in = open("/dev/null", O_RDONLY);
      const int out = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (in >= 0) dup2(in, 0);
      if (out >= 0) dup2(out, 1), dup2(out, 2);
      execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    setpgid(pid, pid);
    pids.push_back(pid);
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> status(pids.size(), -1);
  std::vector<bool> done(pids.size(), false);
  size_t left = pids.size();
  bool timed_out = false;
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) done[i] = true, status[i] = st, --left;
    }
    if (left == 0) break;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout > 0 && seconds > timeout && !timed_out) {
      timed_out = true;
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) kill(-pids[i], SIGTERM);
      std::this_thread::sleep_for(std::chrono::seconds(2));
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) kill(-pids[i], SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (const pid_t pid : pids) kill(-pid, SIGKILL);  // anything a command left behind in its group
  if (timed_out) {
    std::ostringstream s;
    s << "COMMAND ran past --run-timeout " << timeout << " s and was killed";
    return {false, s.str()};
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    const std::string who = pids.size() > 1 ? "COMMAND of rank " + std::to_string(i) : "COMMAND";
    if (WIFSIGNALED(status[i])) return {false, who + " was killed by signal " + std::to_string(WTERMSIG(status[i]))};
    if (WIFEXITED(status[i]) && WEXITSTATUS(status[i]) != 0)
      return {false, who + " exited with status " + std::to_string(WEXITSTATUS(status[i]))};
  }
  return {true, ""};
}

std::string tail_of(const std::string& path, size_t bytes = 1200) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return "";
  std::fseek(f, 0, SEEK_END);
  const long size = std::ftell(f);
  std::fseek(f, size > static_cast<long>(bytes) ? size - static_cast<long>(bytes) : 0, SEEK_SET);
  std::string s(static_cast<size_t>(std::min<long>(size, static_cast<long>(bytes))), '\0');
  s.resize(std::fread(s.data(), 1, s.size(), f));
  std::fclose(f);
  return s;
}

std::string kinds_text(const std::vector<std::string>& kinds) {
  std::string s;
  for (const std::string& k : kinds) s += (s.empty() ? "" : ", ") + k;
  return s.empty() ? "no diagnosis" : s;
}

std::string tensors_text(const std::vector<std::string>& tensors) {
  std::string s;
  for (const std::string& t : tensors) s += (s.empty() ? "" : ", ") + t;
  return s.empty() ? "none" : s;
}

std::string seconds_text(double s) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(1) << s << " s";
  return o.str();
}

int run_shrink(const ShrinkArgs& args) {
  namespace fs = std::filesystem;
  if (args.format != "text" && args.format != "json") fail_input("--format", "expected text or json, got \"", args.format, "\"");
  if (args.command.find("{candidate}") == std::string::npos)
    fail_input("--run", "COMMAND must contain {candidate} (where it writes its outputs), got \"", args.command, "\"");
  if (args.command.find("{fixture}") == std::string::npos)
    fail_input("--run", "COMMAND must contain {fixture} (the fixture whose inputs it reads), got \"", args.command, "\"");
  if (!(args.budget >= 0) || !std::isfinite(args.budget)) fail_input("--budget", "expected seconds >= 0, got ", args.budget);
  if (!(args.run_timeout >= 0) || !std::isfinite(args.run_timeout))
    fail_input("--run-timeout", "expected seconds >= 0 (0: no limit), got ", args.run_timeout);
  if (args.max_runs < 0) fail_input("--max-runs", "expected a number of runs >= 0 (0: no limit), got ", args.max_runs);
  if (args.reseed < 0) fail_input("--reseed", "expected a number of seeds >= 0, got ", args.reseed);
  if (args.any_failure && !args.kinds.empty()) fail_input("--kind", "cannot be combined with --any-failure: give one of them");
  const bool per_rank = args.command.find("{rank}") != std::string::npos;

  fx::ShrinkOptions options;
  options.any_failure = args.any_failure;
  options.same_tensors = args.same_tensors;
  for (const std::string& k : items(args.kinds, "--kind")) {
    if (!fx::parse_diagnosis_kind(k)) fail_input("--kind", "unknown diagnosis kind \"", k, "\" (docs/diagnosis.md lists them)");
    options.kinds.push_back(k);
  }
  for (const std::string& d : items(args.dims, "--dims")) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(d, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != d.size() || v < 1) fail_input("--dims", "expected head dims >= 1 separated by commas, got \"", d, "\"");
    options.dims.push_back(v);
  }
  options.budget_seconds = args.budget;
  options.max_runs = args.max_runs;
  options.seed = args.seed;
  options.reseed = args.reseed;
  fx::CheckOptions check_options;
  fx::set_conventions(check_options, args.empty_row_lse, "--empty-row-lse", args.pad_rows, "--pad-rows");
  if (!args.tensors.empty()) check_options.tensors = fx::parse_tensor_list(args.tensors, "--tensors");

  fx::OpenOptions open;
  open.verify_checksums = false;
  const fx::FixtureFile golden = fx::open_fixture(args.golden, open);

  // Where the runs' fixtures and candidates go.
  std::string work = args.work_dir;
  bool made_work = false;
  if (work.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/cpgold-shrink-XXXXXX";
    if (!mkdtemp(templ.data())) fail_input("--work-dir", "cannot create a temporary folder from ", templ);
    work = templ;
    made_work = true;
  } else {
    std::error_code ec;
    fs::create_directories(work, ec);
    if (!fs::is_directory(work)) fail_input("--work-dir", "not a folder where runs can be written: ", work);
  }

  std::map<std::string, fx::CheckReport> reports;  // failing runs' reports, by normalised case
  std::string original_log;
  auto run_case = [&](const sim::CaseSpec& spec, int64_t run) -> fx::ShrinkVerdict {
    const std::string dir = work + "/run-" + std::to_string(run);
    fs::create_directories(dir);
    std::string fixture = args.golden;
    if (run > 1) {
      fixture = dir + "/fixture.h5";
      fx::GenerateOptions gen;
      gen.trace = golden.traced;
      fx::write_fixture(fx::generate(spec, gen), fixture);
    }
    const std::string log = dir + "/command.log";
    std::vector<std::string> commands, candidates;
    for (int r = 0; r < (per_rank ? spec.cp_size : 1); ++r) {
      candidates.push_back(dir + (per_rank ? "/candidate.rank" + std::to_string(r) + ".h5" : "/candidate.h5"));
      commands.push_back(with_placeholders(args.command, shell_quote(fixture), shell_quote(candidates.back()),
                                           std::to_string(r)));
    }
    fx::ShrinkVerdict v;
    const ProcessOutcome outcome = run_processes(commands, log, args.run_timeout);
    if (run == 1) original_log = tail_of(log);
    if (!outcome.ok) {
      v.detail = outcome.detail;
    } else {
      for (const std::string& c : candidates)
        if (!fs::exists(c)) v.detail = "COMMAND exited 0 but wrote no candidate " + c;
      if (v.detail.empty()) {
        try {
          fx::CheckReport report = fx::check(fixture, candidates, check_options);
          v.status = report.pass() ? fx::ShrinkStatus::passes : fx::ShrinkStatus::fails;
          for (const fx::Diagnosis& d : report.diagnosis) v.kinds.emplace_back(fx::diagnosis_kind_name(d.kind));
          v.tensors = fx::failing_tensors(report);
          v.detail = report.pass() ? "check passed" : "check failed: " + kinds_text(v.kinds);
          if (!report.pass()) reports[sim::normalized_json(spec)] = std::move(report);
        } catch (const InputError& e) {
          v.detail = std::string("the candidate is unusable: ") + e.what();
        }
      }
    }
    if (!args.keep) fs::remove_all(dir);
    return v;
  };
  options.progress = [&](const fx::ShrinkProgress& p) {
    std::cerr << "shrink: run " << p.run << " (" << seconds_text(p.seconds) << "): " << p.change << ": "
              << (p.verdict.status == fx::ShrinkStatus::fails
                      ? "fails (" + kinds_text(p.verdict.kinds) +
                            (args.same_tensors ? " in " + tensors_text(p.verdict.tensors) : std::string()) + ")"
                      : std::string(fx::shrink_status_name(p.verdict.status)))
              << (p.kept ? ", kept" : "") << "; smallest " << fx::case_rows_q(p.smallest) << " q rows\n";
  };

  fx::ShrinkResult result;
  try {
    result = fx::shrink(golden.spec, run_case, options);
  } catch (...) {
    if (made_work && !args.keep) fs::remove_all(work);
    throw;
  }
  if (made_work && !args.keep) fs::remove_all(work);
  if (!result.original_fails) {
    if (result.original_verdict.status == fx::ShrinkStatus::passes)
      fail_input("GOLDEN", "the candidate of the original fixture ", args.golden,
                 " passes its check: there is no failure to shrink");
    fail_input("--run", "COMMAND gave no candidate for the original fixture ", args.golden, ": ",
               result.original_verdict.detail, original_log.empty() ? "" : "; its output ends with:\n" + original_log);
  }

  const sim::CaseSpec& s = result.smallest;
  const std::string json = fx::compact_case_json(s);
  const int code = result.smaller() ? kExitPass : kExitFail;
  std::vector<std::string> reproduce = {"cpgold gen --case " + shell_quote(json) + " -o case.h5" +
                                        (golden.traced ? " --trace" : "")};
  std::string check_line = "cpgold check case.h5";
  if (per_rank) {
    std::string ranks;
    for (int r = 0; r < s.cp_size; ++r) ranks += (r ? " " : "") + std::to_string(r);
    reproduce.push_back("for rank in " + ranks + "; do " +
                        with_placeholders(args.command, "case.h5", "candidate.rank$rank.h5", "$rank") + " & done; wait");
    for (int r = 0; r < s.cp_size; ++r) check_line += " candidate.rank" + std::to_string(r) + ".h5";
  } else {
    reproduce.push_back(with_placeholders(args.command, "case.h5", "candidate.h5", "0"));
    check_line += " candidate.h5";
  }
  if (!args.tensors.empty()) check_line += " --tensors " + args.tensors;
  if (args.empty_row_lse != "neg-inf") check_line += " --empty-row-lse " + args.empty_row_lse;
  if (args.pad_rows != "zero") check_line += " --pad-rows " + args.pad_rows;
  reproduce.push_back(check_line);
  const auto found = reports.find(sim::normalized_json(s));

  if (args.format == "json") {
    nlohmann::ordered_json j;
    auto side = [&](const sim::CaseSpec& c, const fx::ShrinkVerdict& v) {
      nlohmann::ordered_json o;
      o["case"] = nlohmann::ordered_json::parse(fx::compact_case_json(c));
      o["case_json"] = fx::compact_case_json(c);
      o["rows_q"] = fx::case_rows_q(c);
      o["rows_kv"] = fx::case_rows_kv(c);
      o["tokens_q"] = fx::case_tokens_q(c);
      o["sequences"] = c.seqlens_q.size();
      o["diagnosis"] = v.kinds;
      o["failing_tensors"] = v.tensors;
      return o;
    };
    j["original"] = side(result.original, result.original_verdict);
    j["kinds"] = result.kinds;
    j["any_failure"] = args.any_failure;
    j["same_tensors"] = args.same_tensors;
    j["smallest"] = side(s, result.smallest_verdict);
    if (found != reports.end()) j["smallest"]["report"] = fx::to_json(found->second);
    j["smaller"] = result.smaller();
    j["steps"] = result.steps;
    j["reproduce"] = reproduce;
    j["runs"] = result.runs;
    j["passed"] = result.passed;
    j["failed_otherwise"] = result.failed_otherwise;
    j["no_candidate"] = result.no_candidate;
    j["seconds"] = result.seconds;
    j["stopped"] = result.stopped;
    j["exit_code"] = code;
    std::cout << json_text(j);
    return code;
  }
  std::cout << "original: " << fx::case_rows_q(result.original) << " q rows, " << fx::case_tokens_q(result.original)
            << " tokens in " << result.original.seqlens_q.size() << " sequences; fails: "
            << kinds_text(result.original_verdict.kinds) << "\n";
  std::cout << "kept when: " << (args.any_failure ? std::string("any failure") : "the diagnosis names " + kinds_text(result.kinds))
            << (args.same_tensors ? " and the failing tensors are " + tensors_text(result.original_verdict.tensors)
                                  : std::string())
            << "\n";
  std::cout << (result.smaller() ? "smallest failing case: " : "the original is already minimal: ") << fx::case_rows_q(s)
            << " q rows, " << fx::case_tokens_q(s) << " tokens in " << s.seqlens_q.size() << " sequences ("
            << result.steps.size() << " steps kept; stopped: " << result.stopped << ")\n";
  std::cout << json << "\n";
  if (!result.steps.empty()) {
    std::cout << "steps kept:\n";
    for (const std::string& step : result.steps) std::cout << "  " << step << "\n";
  }
  if (found != reports.end()) std::cout << "\nits check:\n" << fx::render_text(found->second) << "\n";
  std::cout << "reproduce:\n";
  for (const std::string& line : reproduce) std::cout << "  " << line << "\n";
  std::cout << "runs: " << result.runs << " (" << result.passed << " passed, " << result.failed_otherwise
            << " failed otherwise, " << result.no_candidate << " without a candidate) in " << seconds_text(result.seconds)
            << "\n";
  return code;
}

const RegisterCommand registered("shrink", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand(
      "shrink", "from a fixture whose candidate fails, the smallest case whose candidate fails the same way");
  auto args = std::make_shared<ShrinkArgs>();
  sub->add_option("golden", args->golden, "the failing fixture (its case is the start)")->required();
  sub->add_option("--run", args->command,
                  "shell command that reads {fixture} and writes {candidate}; with {rank}: one process per rank, "
                  "all at once, each writing its rank's candidate")
      ->required();
  sub->add_flag("--any-failure", args->any_failure, "keep any failing case, whatever its diagnosis");
  sub->add_flag("--same-tensors", args->same_tensors,
                "keep a failing case only when it fails exactly the tensors the original fails (with a wide diagnosis "
                "such as unexplained, a smaller case can fail another way under the same name)");
  sub->add_option("--kind", args->kinds,
                  "comma-separated diagnosis kinds a kept failure must name (default: the original's)");
  sub->add_option("--budget", args->budget, "stop after this many seconds (default: no bound); the smallest so far is the answer");
  sub->add_option("--max-runs", args->max_runs, "stop after this many runs of COMMAND, the original's included");
  sub->add_option("--run-timeout", args->run_timeout,
                  "seconds one run of COMMAND may take (default 300; 0: no limit); past it, no candidate");
  sub->add_option("--seed", args->seed, "seed of the other input seeds --reseed tries");
  sub->add_option("--reseed", args->reseed, "run a smaller case that passes again with this many other input seeds (default 0)");
  sub->add_option("--dims", args->dims, "head dims the implementation supports, e.g. 64,128 (default: any)");
  sub->add_option("--tensors", args->tensors, "as for check: comma-separated subset of o,lse,dq,dk,dv");
  sub->add_option("--empty-row-lse", args->empty_row_lse, "as for check: neg-inf (default) or pos-inf");
  sub->add_option("--pad-rows", args->pad_rows, "as for check: zero (default) or unwritten (FlashAttention-3/4)");
  sub->add_option("--work-dir", args->work_dir, "folder for the runs' fixtures and candidates (default: a new temporary folder)");
  sub->add_flag("--keep", args->keep, "keep every run's fixture, candidate and COMMAND output (run-N/ in the work folder)");
  sub->add_option("--format", args->format, "text or json");
  return [=] { return run_shrink(*args); };
});

}  // namespace
}  // namespace cpgold::app
