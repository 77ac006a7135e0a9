// `cpgold check`: candidate files against a golden fixture (exit 0 pass, 1 fail, 2 unusable input);
// `--identical A B` compares two candidates bit for bit; `--self GOLDEN` checks an independent CPU path.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "apps/command_registry.hpp"
#include "apps/json_output.hpp"
#include "check/check_request.hpp"
#include "check/engine.hpp"
#include "check/identical.hpp"
#include "reference/input_error.hpp"

namespace cpgold::app {
namespace {

struct CheckArgs {
  std::vector<std::string> files;
  bool identical = false, self = false;
  std::string format = "text";
  fx::CheckRequest request;  // the options of the check itself, bound below
  bool no_diagnosis = false;
};

int run_check(const CheckArgs& args) {
  if (args.format != "text" && args.format != "json") fail_input("--format", "expected text or json, got \"", args.format, "\"");
  if (args.identical && args.self) fail_input("--self", "cannot be combined with --identical: give one of them");
  if (args.identical) {
    if (args.files.size() != 2) fail_input("--identical", "expects exactly two candidate files, got ", args.files.size());
    const fx::IdenticalReport report = fx::identical(args.files[0], args.files[1]);
    if (args.format == "json") {
      nlohmann::ordered_json j;
      j["datasets"] = report.datasets;
      j["differences"] = report.differences;
      j["identical"] = report.pass();
      std::cout << json_text(j);
    } else {
      std::cout << fx::render_text(report);
    }
    return report.pass() ? kExitPass : kExitFail;
  }
  fx::CheckRequest request = args.request;
  request.diagnose = !args.no_diagnosis;
  const fx::CheckOptions options = fx::check_options(request, fx::kCommandLineFields);
  fx::CheckReport report;
  if (args.self) {
    if (args.files.size() != 1) fail_input("--self", "expects exactly one golden file, got ", args.files.size());
    report = fx::self_check(args.files[0], options);
  } else {
    if (args.files.size() < 2) fail_input("check", "expects GOLDEN CANDIDATE... (one merged file or one file per rank)");
    report = fx::check(args.files[0], {args.files.begin() + 1, args.files.end()}, options);
  }
  if (args.format == "json") std::cout << json_text(fx::to_json(report));
  else std::cout << fx::render_text(report);
  if (report.undecided()) return kExitUndecided;
  return report.pass() ? kExitPass : kExitFail;
}

void add_check_options(CLI::App& sub, CheckArgs& args) {
  sub.add_option("files", args.files, "GOLDEN CANDIDATE... | --identical RUN1 RUN2 | --self GOLDEN")->required();
  sub.add_flag("--identical", args.identical, "compare two candidate files bit for bit");
  sub.add_flag("--self", args.self, "check an independent CPU path (peer, scale on K, other tile size)");
  sub.add_option("--format", args.format, "text or json");
  sub.add_option("--empty-row-lse", args.request.empty_row_lse,
                 "LSE of a valid row without visible keys: neg-inf (the contract, default) or pos-inf "
                 "(FlashAttention-2's convention, accepted knowingly)");
  sub.add_option("--pad-rows", args.request.pad_rows,
                 "pad and tail rows of o/dq/dk/dv: zero (the contract, default: exactly 0) or unwritten (not compared, "
                 "their non-zero and non-finite counts reported: FlashAttention-3/4 with seqused_q/k never write them)");
  sub.add_option("--tensors", args.request.tensors, "comma-separated subset of o,lse,dq,dk,dv (e.g. o,lse for forward only)");
  sub.add_option("--ranks", args.request.ranks,
                 "comma-separated ranks whose per-rank outputs are checked (default: every rank of the fixture)");
  sub.add_flag("--allow-same-file", args.request.allow_same_file,
               "accept the golden file as a candidate: checks its stored simulator outputs (/peer), on purpose");
  sub.add_flag("--no-diagnosis", args.no_diagnosis,
               "skip the diagnosis of a failed check (what kind of CP bug the failures fit; docs/diagnosis.md)");
  sub.add_option("--diagnosis-budget", args.request.diagnosis_budget,
                 "seconds the diagnosis's replay of modelled CP mistakes may start new simulations (default 30; 0: "
                 "no replay); mistakes left out are named in the report")
      ->check(CLI::Number);
  // With --format json, main prints every error as one JSON object ({"error": ...}) on stdout as well.
}

const RegisterCommand registered("check", "check candidate outputs against a golden fixture", add_check_options,
                                 run_check);

}  // namespace
}  // namespace cpgold::app
