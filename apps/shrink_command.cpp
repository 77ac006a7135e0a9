// `cpgold shrink GOLDEN --run "COMMAND"`: from a fixture whose candidate fails its check, the smallest case whose
// candidate fails the same way (docs/shrink.md). COMMAND is run through /bin/sh with {fixture}, {candidate} and
// optionally {rank} replaced, once each, by paths shrink chose (safe characters only); every step generates its
// fixture (`cpgold gen` in a child process), runs COMMAND and checks what it wrote; the answer is confirmed by
// running it again (--confirm).
// Exit 0: a smaller failing case was found; 1: nothing smaller fails the same way (or the search stopped before one
// did); 2: bad input (the original passing or giving no candidate included); 4: the failure does not reproduce
// (the original failed its confirmation runs); 128 + N: ended by signal N (SIGINT 130, SIGTERM 143).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "check/engine.hpp"
#include "check/shrink.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "reference/input_error.hpp"

namespace cpgold::app {
namespace {

namespace fs = std::filesystem;

constexpr int kExitNotReproduced = 4;
// What is kept of a run's COMMAND output (stdout and stderr together): its first and its last this many bytes.
constexpr size_t kLogKeep = 64 * 1024;
constexpr double kDiagnosisBudget = 30;  // the check's default (check/engine.hpp)

struct ShrinkArgs {
  std::string golden, command, format = "text", work_dir, kinds, tensors, empty_row_lse = "neg-inf", pad_rows = "zero", dims;
  std::string seed = "0";
  bool any_failure = false, same_tensors = false, keep = false;
  double budget = 0, run_timeout = 300;
  int64_t max_runs = 0;
  int reseed = 0, confirm = 2;
};

// ---- signals --------------------------------------------------------------------------------------------------------

volatile sig_atomic_t g_signal = 0;
extern "C" void on_signal(int signal) { g_signal = signal; }

std::string signal_name(int s) {
  return s == SIGINT ? "SIGINT" : s == SIGTERM ? "SIGTERM" : "signal " + std::to_string(s);
}

// SIGINT and SIGTERM set g_signal while the search runs (the runs in progress are ended, the answer so far reported);
// the handlers before are restored at the end.
class SignalGuard {
 public:
  SignalGuard() {
    g_signal = 0;
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // reads in the check go on; the waits for COMMAND poll g_signal
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// ---- processes ------------------------------------------------------------------------------------------------------

// Kills and reaps every child process of shrink: with PR_SET_CHILD_SUBREAPER, a process a COMMAND started in a
// session or group of its own (setsid) comes to shrink when its parent ends, and ends with the run.
void reap_orphans() {
  const pid_t self = getpid();
  for (int round = 0; round < 100; ++round) {
    std::vector<pid_t> found;
    std::error_code ec;
    for (const fs::directory_entry& entry : fs::directory_iterator("/proc", ec)) {
      const std::string name = entry.path().filename().string();
      if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream in("/proc/" + name + "/stat");
      std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const size_t close = stat.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(stat.substr(close + 1));
      std::string state;
      long ppid = 0;
      if (rest >> state >> ppid && ppid == self) found.push_back(static_cast<pid_t>(std::stol(name)));
    }
    if (found.empty()) return;
    for (const pid_t pid : found) kill(pid, SIGKILL);
    for (const pid_t pid : found) waitpid(pid, nullptr, 0);
  }
}

// The output of a run's processes, at most kLogKeep bytes from its start and kLogKeep from its end.
class CappedLog {
 public:
  void add(const char* data, size_t n) {
    total_ += n;
    const size_t to_head = std::min(n, kLogKeep - std::min(kLogKeep, head_.size()));
    head_.append(data, to_head);
    data += to_head, n -= to_head;
    if (n == 0) return;
    if (n >= kLogKeep) {
      tail_.assign(data + n - kLogKeep, kLogKeep);
    } else {
      tail_.append(data, n);
      if (tail_.size() > 2 * kLogKeep) tail_.erase(0, tail_.size() - kLogKeep);
    }
  }
  uint64_t total() const { return total_; }
  std::string text() const {
    std::string tail = tail_.size() > kLogKeep ? tail_.substr(tail_.size() - kLogKeep) : tail_;
    const uint64_t dropped = total_ - head_.size() - tail.size();
    if (dropped == 0) return head_ + tail;
    return head_ + "\n[cpgold shrink: " + std::to_string(dropped) + " bytes of output left out here; the first and " +
           "last " + std::to_string(kLogKeep / 1024) + " KiB are kept]\n" + tail;
  }
  std::string end(size_t bytes = 1200) const {
    const std::string t = text();
    return t.size() > bytes ? t.substr(t.size() - bytes) : t;
  }

 private:
  std::string head_, tail_;
  uint64_t total_ = 0;
};

enum class Ended { exited, timeout, deadline, signal };

struct Processes {
  Ended ended = Ended::exited;
  std::vector<int> status;  // wait statuses, in the order given
};

// Runs the programs at once, each in a process group of its own, stdin from /dev/null and stdout and stderr into `log`;
// waits until all have ended, `timeout` seconds have passed (0: no limit; Ended::timeout) or `deadline` has (the
// budget; Ended::deadline), or a signal came (Ended::signal). The groups still running are then sent SIGTERM and,
// 2 s later, SIGKILL. Afterwards whatever the programs left running is killed: their groups, and processes that
// left their group and came to shrink as orphans.
Processes run_programs(const std::vector<std::vector<std::string>>& programs, CappedLog& log, double timeout,
                       std::optional<std::chrono::steady_clock::time_point> deadline) {
  using Clock = std::chrono::steady_clock;
  Processes out;
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) throw std::runtime_error(std::string("cannot create a pipe: ") + std::strerror(errno));
  fcntl(pipe_fds[0], F_SETFD, FD_CLOEXEC);
  fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  std::vector<pid_t> pids;
  for (const std::vector<std::string>& program : programs) {
    std::vector<char*> argv;
    for (const std::string& a : program) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::cout.flush();
    std::cerr.flush();
    const pid_t pid = fork();
    if (pid < 0) {  // the others still run and are waited for; this one has status -1
      pids.push_back(-1);
      out.status.push_back(-1);
      continue;
    }
    if (pid == 0) {
      setpgid(0, 0);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      const int in = open("/dev/null", O_RDONLY);
      if (in >= 0) dup2(in, 0);
      dup2(pipe_fds[1], 1);
      dup2(pipe_fds[1], 2);
      execv(argv[0], argv.data());
      _exit(127);
    }
    setpgid(pid, pid);
    pids.push_back(pid);
    out.status.push_back(-1);
  }
  close(pipe_fds[1]);
  const int fd = pipe_fds[0];
  char buffer[1 << 16];
  auto drain = [&] {
    for (int i = 0; i < 256; ++i) {  // at most 16 MiB at a time: the limits are looked at in between
      const ssize_t n = read(fd, buffer, sizeof buffer);
      if (n <= 0) return;
      log.add(buffer, static_cast<size_t>(n));
    }
  };
  const auto start = Clock::now();
  std::vector<bool> done(pids.size(), false);
  size_t left = pids.size();
  for (size_t i = 0; i < pids.size(); ++i)
    if (pids[i] < 0) done[i] = true, --left;
  std::optional<Clock::time_point> killed_at;
  auto end_all = [&](int signal) {
    for (size_t i = 0; i < pids.size(); ++i)
      if (!done[i]) kill(-pids[i], signal);
  };
  while (left > 0) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 5);
    drain();
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) done[i] = true, out.status[i] = st, --left;
    }
    if (left == 0) break;
    const auto now = Clock::now();
    if (!killed_at) {
      if (g_signal) out.ended = Ended::signal;
      else if (deadline && now >= *deadline) out.ended = Ended::deadline;
      else if (timeout > 0 && std::chrono::duration<double>(now - start).count() > timeout) out.ended = Ended::timeout;
      if (out.ended != Ended::exited) {
        killed_at = now;
        end_all(SIGTERM);
      }
    } else if (now - *killed_at > std::chrono::seconds(2)) {
      end_all(SIGKILL);
    }
  }
  drain();
  for (const pid_t pid : pids)
    if (pid > 0) kill(-pid, SIGKILL);  // anything a program left behind in its group
  close(fd);
  reap_orphans();
  return out;
}

// ---- paths handed to COMMAND ----------------------------------------------------------------------------------------

// An absolute path of letters, digits and . _ / - only: nothing in it a shell expands or splits, however COMMAND
// quotes its placeholders.
bool safe_path(const std::string& p) {
  if (p.empty() || p[0] != '/') return false;
  for (char c : p)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '/' || c == '-')) return false;
  return true;
}

// COMMAND with each placeholder replaced once: the values are never searched for placeholders themselves.
std::string with_placeholders(const std::string& command, const std::string& fixture, const std::string& candidate,
                              const std::string& rank) {
  static const std::pair<std::string_view, int> kNames[] = {{"{fixture}", 0}, {"{candidate}", 1}, {"{rank}", 2}};
  const std::string* values[] = {&fixture, &candidate, &rank};
  std::string out;
  for (size_t at = 0; at < command.size();) {
    bool replaced = false;
    for (const auto& [name, index] : kNames)
      if (command.compare(at, name.size(), name) == 0) {
        out += *values[index];
        at += name.size();
        replaced = true;
        break;
      }
    if (!replaced) out += command[at++];
  }
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Where the runs go: `real`, a folder this search created, and `handed`, the same folder as COMMAND is given it (a
// safe path: `real` itself, or a symbolic link to it in a folder of /tmp this search created). Everything it created
// is removed at the end unless --keep (the runs' folder then stays, with every run-N/).
class Workspace {
 public:
  explicit Workspace(const ShrinkArgs& args) : keep_(args.keep) {
    try {
      make(args);
    } catch (...) {
      keep_ = false;  // nothing of a search that did not start is kept
      cleanup();
      throw;
    }
  }
  ~Workspace() { cleanup(); }
  const std::string& real() const { return real_; }
  const std::string& handed() const { return handed_; }
  void cleanup() {
    std::error_code ec;
    if (!link_dir_.empty()) fs::remove_all(link_dir_, ec), link_dir_.clear();  // the link, not what it points to
    if (!keep_)
      for (const std::string& p : remove_) fs::remove_all(p, ec);
    remove_.clear();
  }

 private:
  void make(const ShrinkArgs& args) {
    if (args.work_dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/cpgold-shrink-XXXXXX";
      if (!mkdtemp(templ.data()))
        fail_input("TMPDIR", "cannot create a temporary folder from ", templ, " (", std::strerror(errno), ")");
      real_ = fs::absolute(templ).lexically_normal().string();
      remove_.push_back(real_);
    } else {
      // --work-dir: a new folder shrink-K inside it (the first K free), so nothing there is ever reused or removed.
      const fs::path dir = fs::absolute(args.work_dir).lexically_normal();
      std::error_code ec;
      fs::path top;  // the outermost folder this search creates
      for (fs::path p = dir; !p.empty() && !fs::exists(fs::symlink_status(p, ec)); p = p.parent_path()) {
        top = p;
        if (p == p.parent_path()) break;
      }
      fs::create_directories(dir, ec);
      if (!fs::is_directory(dir))
        fail_input("--work-dir", "not a folder where runs can be written: ", args.work_dir,
                   ec ? " (" + ec.message() + ")" : "");
      if (!top.empty()) remove_.push_back(top.string());
      for (int k = 1;; ++k) {
        const fs::path folder = dir / ("shrink-" + std::to_string(k));
        if (::mkdir(folder.c_str(), 0755) == 0) {
          real_ = folder.string();
          break;
        }
        if (errno != EEXIST || k >= 100000)
          fail_input("--work-dir", "cannot create a folder in ", args.work_dir, ": ", folder.string(), " (",
                     std::strerror(errno), ")");
      }
      if (top.empty()) remove_.push_back(real_);
    }
    handed_ = real_;
    if (!safe_path(real_)) {
      std::string link = "/tmp/cpgold-shrink-XXXXXX";
      if (!mkdtemp(link.data()))
        fail_input(args.work_dir.empty() ? "TMPDIR" : "--work-dir", "the folder ", real_,
                   " has characters a shell treats specially, and no folder for a safe link to it could be made in "
                   "/tmp (", std::strerror(errno), ")");
      link_dir_ = link;
      handed_ = link + "/runs";
      if (symlink(real_.c_str(), handed_.c_str()) != 0)
        fail_input(args.work_dir.empty() ? "TMPDIR" : "--work-dir", "cannot link ", handed_, " to ", real_, " (",
                   std::strerror(errno), ")");
    }
  }

  bool keep_;
  std::string real_, handed_, link_dir_;
  std::vector<std::string> remove_;
};

// ---- text -----------------------------------------------------------------------------------------------------------

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

uint64_t parse_seed(const std::string& text) {
  const bool digits = !text.empty() && text.size() <= 20 && text.find_first_not_of("0123456789") == std::string::npos;
  errno = 0;
  const unsigned long long v = digits ? std::strtoull(text.c_str(), nullptr, 10) : 0;
  if (!digits || errno == ERANGE)
    fail_input("--seed", "expected an integer from 0 to ", std::numeric_limits<uint64_t>::max(), ", got \"", text,
               "\"");
  return static_cast<uint64_t>(v);
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

std::string exit_text(int status, const std::string& who) {
  if (WIFSIGNALED(status)) return who + " was killed by signal " + std::to_string(WTERMSIG(status));
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
    return who + " exited with status " + std::to_string(WEXITSTATUS(status));
  return "";
}

std::string size_text(const sim::CaseSpec& s) {
  return std::to_string(fx::case_rows_q(s)) + " q rows, " + std::to_string(fx::case_tokens_q(s)) + " tokens in " +
         std::to_string(s.seqlens_q.size()) + " sequences";
}

// ---- the command ----------------------------------------------------------------------------------------------------

int run_shrink(const ShrinkArgs& args) {
  using Clock = std::chrono::steady_clock;
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
  if (args.confirm < 0) fail_input("--confirm", "expected a number of confirmation runs >= 0 (0: none), got ", args.confirm);
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
  options.seed = parse_seed(args.seed);
  options.reseed = args.reseed;
  fx::CheckOptions check_options;
  fx::set_conventions(check_options, args.empty_row_lse, "--empty-row-lse", args.pad_rows, "--pad-rows");
  if (!args.tensors.empty()) check_options.tensors = fx::parse_tensor_list(args.tensors, "--tensors");

  fx::OpenOptions open;
  open.verify_checksums = false;
  const fx::FixtureFile golden = fx::open_fixture(args.golden, open);
  // A fixture of given inputs holds a run's tensors (a captured call's, say); the search below makes every case with
  // seeded inputs, so it would shrink the case without those values. Such a start is refused, not shrunk.
  if (golden.inputs_source == "given")
    fail_input("GOLDEN", "the fixture ", args.golden,
               " was made from given inputs (inputs_source \"given\": its inputs are a run's tensors, such as a "
               "captured call's), and shrink searches over cases with seeded inputs, which would drop those values; "
               "to shrink a captured call keeping its values use `python3 -m cpgold.capture shrink CALL_DIR --run "
               "\"COMMAND {fixture} {candidate}\"` or cpgold.capture.shrink(call_dir, fn) (docs/capture.md, shrink)");
  const std::string golden_path = fs::absolute(args.golden).lexically_normal().string();
  const std::string original_json = fx::compact_case_json(golden.spec);

  // Orphans of COMMAND (a process it started with setsid, say) come to shrink, which ends them after each run.
  prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  SignalGuard signals;
  Workspace work(args);

  // The time model for --budget: generation and check measured on the runs made (scaled by the work of the case,
  // fx::shrink_work), gen's own estimate before the first generation, and the shortest COMMAND run.
  struct Timing {
    double work, seconds;
  };
  std::vector<Timing> gens, checks;
  double shortest_command = 0;
  bool any_command = false;
  auto scaled = [](const std::vector<Timing>& list, double work) {
    const Timing* largest = &list.front();
    for (const Timing& t : list)
      if (t.work > largest->work || (t.work == largest->work && t.seconds > largest->seconds)) largest = &t;
    return largest->seconds * work / largest->work;
  };
  auto estimate_check = [&](const sim::CaseSpec& spec) {
    return checks.empty() ? 0.0 : scaled(checks, fx::shrink_work(spec, golden.traced));
  };
  options.estimate_seconds = [&](const sim::CaseSpec& spec) {
    const double work = fx::shrink_work(spec, golden.traced);
    const double gen = gens.empty() ? sim::case_cost(spec, golden.traced).seconds : scaled(gens, work);
    return gen + estimate_check(spec) + (any_command ? shortest_command : 0.0);
  };

  const auto start = Clock::now();
  bool confirming = false;  // confirmation runs are bounded by --run-timeout only
  auto budget_left = [&]() -> std::optional<double> {
    if (args.budget <= 0 || confirming) return std::nullopt;
    return args.budget - std::chrono::duration<double>(Clock::now() - start).count();
  };

  std::map<std::string, fx::CheckReport> reports;  // failing runs' reports, by normalised case
  std::string original_log;
  int64_t folders = 0;  // run-N/ folders made: a run that could not be made does not give its N to another
  auto run_case = [&](const sim::CaseSpec& spec, int64_t run) -> fx::ShrinkVerdict {
    fx::ShrinkVerdict v;
    auto stop = [&](std::string why, std::string detail) {
      v.stop = std::move(why);
      v.detail = std::move(detail);
      return v;
    };
    if (g_signal) return stop("interrupted", signal_name(g_signal) + " came");
    const bool original = fx::compact_case_json(spec) == original_json;
    const bool bounded = !original;  // the original's run is what there is to shrink: never cut short
    const std::string name = "run-" + std::to_string(std::max(run, ++folders));
    folders = std::max(run, folders);
    const std::string dir = work.real() + "/" + name, handed = work.handed() + "/" + name;
    if (::mkdir(dir.c_str(), 0755) != 0)
      return stop("error", "cannot create the folder of run " + std::to_string(run) + ", " + dir + " (" +
                               std::strerror(errno) + ")");
    struct RemoveRun {
      const std::string& dir;
      bool keep;
      ~RemoveRun() {
        std::error_code ec;
        if (!keep) fs::remove_all(dir, ec);
      }
    } remove_run{dir, args.keep};
    std::string fixture = golden_path, fixture_handed = golden_path;
    if (original) {
      if (!safe_path(golden_path)) {  // COMMAND gets a link of a safe name to GOLDEN
        fixture_handed = handed + "/fixture.h5";
        if (symlink(golden_path.c_str(), (dir + "/fixture.h5").c_str()) != 0)
          return stop("error",
                      "cannot link " + dir + "/fixture.h5 to " + golden_path + " (" + std::strerror(errno) + ")");
      }
    } else {
      fixture = dir + "/fixture.h5";
      fixture_handed = handed + "/fixture.h5";
      // `cpgold gen` in a child process: ended at once when the budget runs out or a signal comes.
      std::vector<std::string> gen = {"/proc/self/exe", "gen", "--case", fx::compact_case_json(spec), "-o", fixture};
      if (golden.traced) gen.push_back("--trace");
      const std::optional<double> left = budget_left();
      if (left && *left <= 0) return stop("budget", "the budget of " + seconds_text(args.budget) + " was spent");
      CappedLog gen_log;
      const auto t0 = Clock::now();
      const Processes p = run_programs(
          {gen}, gen_log, 0, left ? std::optional(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                                     std::chrono::duration<double>(*left)))
                                  : std::nullopt);
      if (p.ended == Ended::signal) return stop("interrupted", signal_name(g_signal) + " came while run " +
                                                                   std::to_string(run) + "'s fixture was generated");
      if (p.ended == Ended::deadline)
        return stop("budget", "the budget of " + seconds_text(args.budget) + " ran out while run " +
                                  std::to_string(run) + "'s fixture was generated");
      const std::string failed = exit_text(p.status[0], "gen");
      if (!failed.empty() || !fs::exists(fixture)) {
        // gen's error line (its last line naming an error; else its last line)
        std::string said;
        std::istringstream lines(gen_log.end(4000));
        for (std::string line; std::getline(lines, line);)
          if (!line.empty() && (said.empty() || line.find("error") != std::string::npos ||
                                said.find("error") == std::string::npos))
            said = line;
        return stop("error", "cannot write the fixture of run " + std::to_string(run) + " (" +
                                 (failed.empty() ? "gen wrote no file" : failed) + ")" +
                                 (said.empty() ? "" : ": " + said));
      }
      gens.push_back({fx::shrink_work(spec, golden.traced), std::chrono::duration<double>(Clock::now() - t0).count()});
    }

    std::vector<std::string> candidates;
    std::vector<std::vector<std::string>> commands;
    for (int r = 0; r < (per_rank ? spec.cp_size : 1); ++r) {
      const std::string file = per_rank ? "/candidate.rank" + std::to_string(r) + ".h5" : "/candidate.h5";
      candidates.push_back(dir + file);
      if (fs::exists(fs::symlink_status(candidates.back())))
        return stop("error", "the candidate path " + candidates.back() + " exists before run " + std::to_string(run));
      commands.push_back(
          {"/bin/sh", "-c", with_placeholders(args.command, fixture_handed, handed + file, std::to_string(r))});
    }
    // COMMAND's time: --run-timeout, and within the budget what the check is expected to leave.
    double timeout = args.run_timeout;
    std::optional<Clock::time_point> deadline;
    if (const std::optional<double> left = budget_left(); left && bounded) {
      const double for_command = *left - estimate_check(spec);
      if (for_command <= 0)
        return stop("budget", "the budget of " + seconds_text(args.budget) + " left no time to run COMMAND for run " +
                                  std::to_string(run) + " and check it");
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(for_command));
    }
    CappedLog log;
    const auto t0 = Clock::now();
    const Processes p = run_programs(commands, log, timeout, deadline);
    const double command_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    {
      std::ofstream out(dir + "/command.log", std::ios::binary);
      out << log.text();
    }
    if (original && original_log.empty()) original_log = log.end();
    if (p.ended == Ended::signal)
      return stop("interrupted", signal_name(g_signal) + " came while COMMAND ran for run " + std::to_string(run));
    if (p.ended == Ended::deadline)
      return stop("budget", "the budget of " + seconds_text(args.budget) + " ran out while COMMAND ran for run " +
                                std::to_string(run));
    if (p.ended == Ended::timeout) {
      std::ostringstream s;
      s << "COMMAND ran past --run-timeout " << timeout << " s and was killed";
      v.detail = s.str();
      return v;
    }
    if (!any_command || command_seconds < shortest_command) shortest_command = command_seconds, any_command = true;
    for (size_t i = 0; i < p.status.size() && v.detail.empty(); ++i) {
      if (p.status[i] == -1) v.detail = "cannot start /bin/sh (fork failed)";
      else v.detail = exit_text(p.status[i], p.status.size() > 1 ? "COMMAND of rank " + std::to_string(i) : "COMMAND");
    }
    if (!v.detail.empty()) return v;
    for (const std::string& c : candidates)
      if (!fs::exists(c)) v.detail = "COMMAND exited 0 but wrote no candidate " + c;
    if (!v.detail.empty()) return v;
    fx::CheckOptions this_check = check_options;
    const std::optional<double> left = bounded ? budget_left() : std::nullopt;
    const bool cut = left && *left < kDiagnosisBudget;
    if (cut) this_check.diagnosis_budget_seconds = std::max(*left, 0.001);
    try {
      const auto c0 = Clock::now();
      fx::CheckReport report = fx::check(fixture, candidates, this_check);
      checks.push_back(
          {fx::shrink_work(spec, golden.traced), std::chrono::duration<double>(Clock::now() - c0).count()});
      if (cut && !report.diagnosis.empty() && report.diagnosis.back().where.contains("not_tested") &&
          report.diagnosis.back().where["not_tested"].dump().find("budget") != std::string::npos)
        return stop("budget", "the budget of " + seconds_text(args.budget) + " ran out during the diagnosis of run " +
                                  std::to_string(run) + "'s check");
      v.status = report.pass() ? fx::ShrinkStatus::passes : fx::ShrinkStatus::fails;
      for (const fx::Diagnosis& d : report.diagnosis) v.kinds.emplace_back(fx::diagnosis_kind_name(d.kind));
      v.tensors = fx::failing_tensors(report);
      v.detail = report.pass() ? "check passed" : "check failed: " + kinds_text(v.kinds);
      if (!report.pass()) reports[sim::normalized_json(spec)] = std::move(report);
    } catch (const InputError& e) {
      v.detail = std::string("the candidate is unusable: ") + e.what();
    }
    return v;
  };
  options.progress = [&](const fx::ShrinkProgress& p) {
    std::cerr << "shrink: run " << p.run << " (" << seconds_text(p.seconds) << "): " << p.change << ": "
              << (p.verdict.status == fx::ShrinkStatus::fails
                      ? "fails (" + kinds_text(p.verdict.kinds) +
                            (args.same_tensors ? " in " + tensors_text(p.verdict.tensors) : std::string()) + ")"
                      : std::string(fx::shrink_status_name(p.verdict.status)))
              << (confirming ? (p.kept ? ", the same way" : ", not the same way") : p.kept ? ", kept" : "")
              << "; smallest " << fx::case_rows_q(p.smallest) << " q rows\n";
  };

  fx::ShrinkResult result = fx::shrink(golden.spec, run_case, options);
  if (result.original_fails && result.stopped != "interrupted") {
    confirming = true;
    fx::confirm_smallest(result, run_case, args.confirm, options);
    result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  const bool interrupted = result.stopped == "interrupted" || result.confirmation_stopped == "interrupted";
  const int signal_code = 128 + (g_signal ? g_signal : SIGINT);
  if (!result.original_fails) {
    work.cleanup();
    if (interrupted) {
      std::cerr << "cpgold shrink: " << result.stop_detail << " before the original's run ended; nothing was found\n";
      if (args.format == "json")
        std::cout << json_error_text("signal", result.stop_detail + " before the original's run ended", signal_code);
      return signal_code;
    }
    if (!result.stopped.empty() && result.stopped != "original does not fail")
      fail_input("--run", "the original's run could not be made: ", result.stop_detail);
    if (result.original_verdict.status == fx::ShrinkStatus::passes)
      fail_input("GOLDEN", "the candidate of the original fixture ", args.golden,
                 " passes its check: there is no failure to shrink");
    fail_input("--run", "COMMAND gave no candidate for the original fixture ", args.golden, ": ",
               result.original_verdict.detail, original_log.empty() ? "" : "; its output ends with:\n" + original_log);
  }
  if (args.keep) std::cerr << "shrink: the runs are kept in " << work.real() << "\n";
  work.cleanup();

  const sim::CaseSpec& s = result.smallest;
  const std::string json = fx::compact_case_json(s);
  const bool not_reproduced = result.not_reproduced();
  const int code = interrupted ? signal_code
                   : not_reproduced ? kExitNotReproduced
                   : result.smaller() ? kExitPass
                                      : kExitFail;
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

  // What the answer is, in words.
  const bool stopped_early = result.stopped != "minimal";
  const std::string stop_text = result.stopped + (result.stop_detail.empty() ? "" : ": " + result.stop_detail);
  std::string headline;
  if (not_reproduced) {
    headline = "the failure does not reproduce: no case of the search, the original included, failed the same way "
               "in every confirmation run (flaky); the original: ";
  } else if (result.smaller()) {
    headline = std::string(result.confirmed ? "smallest failing case (confirmed): "
                           : result.confirm > 0 ? "smallest failing case (not confirmed): "
                                                : "smallest failing case: ");
  } else if (result.flaky) {
    headline = "no smaller case failed the same way in every confirmation run (flaky); the original: ";
  } else if (!stopped_early) {
    headline = "the original is already minimal: ";
  } else if (result.runs <= 1) {
    headline =
        "no smaller case was tried: the search stopped before its first step (" + stop_text + "); the original: ";
  } else {
    headline = "no smaller case failed the same way before the search stopped (" + stop_text + "); the original: ";
  }
  std::vector<std::string> notes;
  if (stopped_early && (result.smaller() || not_reproduced))
    notes.push_back("the search stopped early (" + stop_text + "): this is the smallest failing case found so far");
  if (!result.confirmation_stopped.empty())
    notes.push_back("the confirmation runs stopped early (" + result.confirmation_stopped + ": " + result.stop_detail +
                    "): the answer is not confirmed");
  if (const std::string name = fx::shrink_name_note(result); !name.empty()) notes.push_back(name);
  // "the original", "the search's smallest" or "step K" (the case after K steps).
  auto which = [&](const fx::ShrinkConfirmation& c) {
    if (c.original) return std::string("the original");
    if (fx::compact_case_json(c.spec) == fx::compact_case_json(result.search_smallest))
      return std::string("the search's smallest");
    return "step " + std::to_string(c.step);
  };
  std::vector<std::string> confirmation_lines;
  for (const fx::ShrinkConfirmation& c : result.confirmations) {
    confirmation_lines.push_back(
        which(c) + " (" + std::to_string(fx::case_rows_q(c.spec)) + " q rows) failed the same way in " +
        std::to_string(c.failed_same_way) + " of " + std::to_string(c.reruns) + " reruns" +
        (c.failed_same_way == c.reruns ? ""
         : c.original ? ": the original's failure is flaky"
                      : ": flaky, not the answer"));
  }

  if (args.format == "json") {
    auto side = [&](const sim::CaseSpec& c, const fx::ShrinkVerdict& v) {
      return nlohmann::ordered_json{{"case", nlohmann::ordered_json::parse(fx::compact_case_json(c))},
                                    {"case_json", fx::compact_case_json(c)},
                                    {"rows_q", fx::case_rows_q(c)},
                                    {"rows_kv", fx::case_rows_kv(c)},
                                    {"tokens_q", fx::case_tokens_q(c)},
                                    {"sequences", c.seqlens_q.size()},
                                    {"diagnosis", v.kinds},
                                    {"failing_tensors", v.tensors}};
    };
    nlohmann::ordered_json smallest = side(s, result.smallest_verdict);
    if (found != reports.end()) smallest["report"] = fx::to_json(found->second);
    nlohmann::ordered_json confirmations = nlohmann::ordered_json::array();
    for (const fx::ShrinkConfirmation& c : result.confirmations)
      confirmations.push_back({{"case_json", fx::compact_case_json(c.spec)},
                               {"rows_q", fx::case_rows_q(c.spec)},
                               {"original", c.original},
                               {"which", which(c)},
                               {"reruns", c.reruns},
                               {"failed_same_way", c.failed_same_way}});
    const nlohmann::ordered_json j = {{"original", side(result.original, result.original_verdict)},
                                      {"kinds", result.kinds},
                                      {"any_failure", args.any_failure},
                                      {"same_tensors", args.same_tensors},
                                      {"smallest", smallest},
                                      {"smaller", result.smaller()},
                                      {"steps", result.steps},
                                      {"reproduce", reproduce},
                                      {"runs", result.runs},
                                      {"passed", result.passed},
                                      {"failed_otherwise", result.failed_otherwise},
                                      {"no_candidate", result.no_candidate},
                                      {"seconds", result.seconds},
                                      {"stopped", result.stopped},
                                      {"stop_detail", result.stop_detail},
                                      {"confirm", result.confirm},
                                      {"confirmed", result.confirmed},
                                      {"flaky", result.flaky},
                                      {"not_reproduced", not_reproduced},
                                      {"search_smallest", fx::compact_case_json(result.search_smallest)},
                                      {"confirmations", confirmations},
                                      {"confirmation_runs", result.confirmation_runs},
                                      {"confirmation_stopped", result.confirmation_stopped},
                                      {"notes", notes},
                                      {"exit_code", code}};
    std::cout << json_text(j);
    return code;
  }
  std::cout << "original: " << size_text(result.original) << "; fails: " << kinds_text(result.original_verdict.kinds)
            << "\n";
  std::cout << "kept when: " << (args.any_failure ? std::string("any failure") : "the diagnosis names " + kinds_text(result.kinds))
            << (args.same_tensors ? " and the failing tensors are " + tensors_text(result.original_verdict.tensors)
                                  : std::string())
            << "\n";
  std::cout << headline << size_text(s) << " (" << result.steps.size() << " steps kept; stopped: " << result.stopped
            << ")\n";
  std::cout << json << "\n";
  for (const std::string& n : notes) std::cout << "note: " << n << "\n";
  if (!result.steps.empty()) {
    std::cout << "steps kept:\n";
    for (const std::string& step : result.steps) std::cout << "  " << step << "\n";
  }
  if (!confirmation_lines.empty()) {
    std::cout << "confirmation (" << result.confirm << " reruns of each case):\n";
    for (const std::string& line : confirmation_lines) std::cout << "  " << line << "\n";
  }
  if (found != reports.end()) std::cout << "\nits check:\n" << fx::render_text(found->second) << "\n";
  std::cout << "reproduce:\n";
  for (const std::string& line : reproduce) std::cout << "  " << line << "\n";
  std::cout << "runs: " << result.runs << " (" << result.passed << " passed, " << result.failed_otherwise
            << " failed otherwise, " << result.no_candidate << " without a candidate)"
            << (result.confirmation_runs ? " and " + std::to_string(result.confirmation_runs) + " confirmation runs"
                                         : std::string())
            << " in " << seconds_text(result.seconds) << "\n";
  return code;
}

void add_shrink_options(CLI::App& sub, ShrinkArgs& args) {
  sub.add_option("golden", args.golden, "the failing fixture (its case is the start)")->required();
  sub.add_option("--run", args.command,
                 "shell command that reads {fixture} and writes {candidate}; with {rank}: one process per rank, "
                 "all at once, each writing its rank's candidate (the paths are absolute, of letters, digits and "
                 "._/- only)")
      ->required();
  sub.add_flag("--any-failure", args.any_failure, "keep any failing case, whatever its diagnosis");
  sub.add_flag("--same-tensors", args.same_tensors,
               "keep a failing case only when it fails exactly the tensors the original fails (with a wide diagnosis "
               "such as unexplained, a smaller case can fail another way under the same name)");
  sub.add_option("--kind", args.kinds,
                 "comma-separated diagnosis kinds a kept failure must name (default: the original's)");
  sub.add_option("--budget", args.budget,
                 "seconds the search may take, generation and check included (default: no bound); the smallest so far "
                 "is the answer");
  sub.add_option("--max-runs", args.max_runs, "stop after this many runs of COMMAND, the original's included");
  sub.add_option("--run-timeout", args.run_timeout,
                 "seconds one run of COMMAND may take (default 300; 0: no limit); past it, no candidate");
  sub.add_option("--confirm", args.confirm,
                 "run the answer again this many times (default 2; 0: none); a case that does not fail the same way "
                 "every time gives way to the one before it");
  sub.add_option("--seed", args.seed, "seed of the other input seeds --reseed tries (0 to 2^64-1)");
  sub.add_option("--reseed", args.reseed, "run a smaller case that passes again with this many other input seeds (default 0)");
  sub.add_option("--dims", args.dims, "head dims the implementation supports, e.g. 64,128 (default: any)");
  sub.add_option("--tensors", args.tensors, "as for check: comma-separated subset of o,lse,dq,dk,dv");
  sub.add_option("--empty-row-lse", args.empty_row_lse, "as for check: neg-inf (default) or pos-inf");
  sub.add_option("--pad-rows", args.pad_rows, "as for check: zero (default) or unwritten (FlashAttention-3/4)");
  sub.add_option("--work-dir", args.work_dir,
                 "folder for the runs' fixtures and candidates: each search makes a new shrink-K/ in it (default: a "
                 "new temporary folder)");
  sub.add_flag("--keep", args.keep,
               "keep every run's fixture, candidate and COMMAND output (run-N/ in the runs' folder)");
  sub.add_option("--format", args.format, "text or json");
}

const RegisterCommand registered(
    "shrink", "from a fixture whose candidate fails, the smallest case whose candidate fails the same way",
    add_shrink_options, run_shrink);

}  // namespace
}  // namespace cpgold::app
