#include "check/report.hpp"
#include "fixtures/golden/golden_run.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "fixtures/storage/hdf5_types.hpp"
#include "fixtures/schema/inputs_digest.hpp"
#include "reference/sha256.hpp"
#include "reference/attention.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/program/executor.hpp"

namespace cpgold::fx {

namespace {

std::string join_ints(const std::vector<int>& values) {
  std::string out;
  for (int v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
  return out;
}

std::string fmt(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.3e", x);
  return buffer;
}

std::string fmt_ratio(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.3f", x);
  return buffer;
}

// Numbers in JSON: JSON has no inf or NaN, so a non-finite value is null and the object's "nonfinite" map names it
// ({"candidate": "nan"}); a reader never meets a string where a number stands.
void put_number(nlohmann::ordered_json& j, const char* key, double x) {
  if (std::isfinite(x)) {
    j[key] = x;
    return;
  }
  j[key] = nullptr;
  j["nonfinite"][key] = std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf");
}

// Stable identifiers of the exact rules for JSON (exact_rule_name is the text for people).
const char* exact_rule_id(ExactRule rule) {
  switch (rule) {
    case ExactRule::pad_not_zero: return "pad_not_zero";
    case ExactRule::not_finite: return "not_finite";
    case ExactRule::lse_empty_mismatch: return "lse_empty_mismatch";
    case ExactRule::lse_empty_pos_inf: return "lse_empty_pos_inf";
    case ExactRule::lse_empty_not_pos_inf: return "lse_empty_not_pos_inf";
    case ExactRule::lse_not_finite: return "lse_not_finite";
  }
  return "?";
}

const char* row_kind(const ElementLocation& loc) {
  if (loc.sequence < 0) return loc.step >= 0 ? "outside_call" : "tail";
  return loc.pad_row ? "pad" : "token";
}

// has_dim: false for LSE, whose elements are (row, head).
std::string describe(const ElementLocation& loc, bool has_dim = true) {
  std::ostringstream out;
  if (loc.rank >= 0) out << "rank " << loc.rank << ", ";
  if (loc.step >= 0) out << "step " << loc.step << ", ";
  if (loc.sequence >= 0 && !loc.pad_row) out << "sequence " << loc.sequence << ", row " << loc.row_in_sequence << " of the sequence";
  else if (loc.sequence >= 0)
    out << "sequence " << loc.sequence << ", pad row (row " << loc.row_in_sequence << " of its padded range, past its "
        << loc.sequence_length << " token(s))";
  else if (loc.step >= 0) out << "a row outside every sequence of the call";
  else out << "tail row (past the last sequence)";
  out << " (tensor row " << loc.row;
  if (loc.global_row >= 0 && loc.rank >= 0) out << ", global row " << loc.global_row;
  out << "), head " << loc.head;
  if (has_dim) out << ", dim " << loc.dim;
  out << ": candidate " << loc.candidate << ", oracle " << loc.oracle;
  if (loc.peer) out << ", peer " << *loc.peer;
  return out.str();
}

nlohmann::ordered_json location_json(const ElementLocation& loc) {
  nlohmann::ordered_json j;
  j["rank"] = loc.rank;
  j["step"] = loc.step;
  j["sequence"] = loc.sequence;
  j["row_in_sequence"] = loc.row_in_sequence;
  j["row_kind"] = row_kind(loc);
  j["row"] = loc.row;
  j["global_row"] = loc.global_row;
  j["head"] = loc.head;
  j["dim"] = loc.dim;
  put_number(j, "candidate", loc.candidate);
  put_number(j, "oracle", loc.oracle);
  if (loc.peer) put_number(j, "peer", *loc.peer);
  else j["peer"] = nullptr;
  j["exact_rule_id"] = loc.rule ? nlohmann::ordered_json(exact_rule_id(*loc.rule)) : nlohmann::ordered_json(nullptr);
  return j;
}

std::string result_name(const TensorResult& r) {
  std::string name = r.tensor;
  if (r.rank >= 0) name += "@r" + std::to_string(r.rank);
  if (r.step >= 0) name += "/s" + std::to_string(r.step) + (r.pass == "forward" ? "f" : "b");
  return name;
}

}  // namespace

int64_t CheckReport::compared() const {
  int64_t n = 0;
  for (const TensorResult& r : results) n += r.missing ? 0 : r.evaluation.compared;
  return n;
}

bool CheckReport::every_result_ok() const {
  if (results.empty()) return false;
  for (const TensorResult& r : results)
    if (!r.ok()) return false;
  return true;
}

bool CheckReport::foreign_inputs() const {
  for (const InputsClaim& claim : inputs)
    if (!claim.matches) return true;
  return false;
}

// Comparing nothing proves nothing, unless the fixture has nothing to compare; a candidate computed from other inputs
// is not this fixture's candidate.
bool CheckReport::pass() const {
  return every_result_ok() && (compared() > 0 || no_valid_element()) && !foreign_inputs();
}

bool CheckReport::undecided() const {
  return !pass() && !foreign_inputs() && (compared() > 0 || no_valid_element()) && results_undecided();
}

bool CheckReport::results_undecided() const {
  bool any = false;
  for (const TensorResult& r : results) {
    if (r.ok()) continue;
    if (r.missing || !r.evaluation.undecided()) return false;
    any = true;
  }
  return any;
}

Margins margins(const CheckReport& report) {
  Margins m;
  for (const TensorResult& r : report.results) {
    if (r.missing) continue;
    const Evaluation& e = r.evaluation;
    const std::string name = result_name(r);
    auto worse = [&](double ratio, double& worst, std::string& at) {
      if (at.empty() || ratio > worst || std::isnan(ratio)) worst = ratio, at = name;
    };
    worse(e.max_ratio, m.deciding_max, m.deciding_max_at);
    worse(e.mean_ratio, m.deciding_mean, m.deciding_mean_at);
    if (!r.has_other) continue;
    worse(e.other_max_ratio, m.other_max, m.other_max_at);
    worse(e.other_mean_ratio, m.other_mean, m.other_mean_at);
  }
  return m;
}

namespace {
// "cp" / "max(cp,ncp)" for the deciding budget; the other one: "ncp" beside a CP output, "cp" beside a global-only one.
const char* deciding_name(const TensorResult& r) { return r.scope == CandidateScope::cp_output ? "cp" : "max(cp,ncp)"; }
const char* other_name(const TensorResult& r) {
  if (!r.has_other) return "-";
  return r.scope == CandidateScope::cp_output ? "ncp" : "cp";
}

std::string ratio_with_margin(double ratio) {
  char text[96];
  if (std::isnan(ratio)) return "nan (no margin: the error is not a number)";
  if (std::isinf(ratio)) return "inf (no margin: a compared value is not finite)";
  if (ratio > 1) std::snprintf(text, sizeof text, "%.3f (past the limit)", ratio);
  else std::snprintf(text, sizeof text, "%.3f (margin %.1f%%)", ratio, 100 * (1 - ratio));
  return text;
}

std::string margin_line(const char* what, double max_ratio, const std::string& max_at, double mean_ratio,
                        const std::string& mean_at) {
  if (max_at.empty()) return std::string(what) + ": none\n";
  return std::string(what) + ": worst max ratio " + ratio_with_margin(max_ratio) + " at " + max_at +
         ", worst mean ratio " + ratio_with_margin(mean_ratio) + " at " + mean_at + "\n";
}

std::string short_sha(const std::string& sha) { return sha.size() > 16 ? sha.substr(0, 16) + "..." : sha; }

// What the verdict line adds to PASS/FAIL: why a check fails beyond its table, and what was checked when the
// candidate is a fixture's stored simulator outputs.
std::string verdict_note(const CheckReport& report) {
  std::vector<std::string> notes;
  if (report.foreign_inputs()) notes.push_back("the candidate was computed from the inputs of another fixture");
  if (report.no_valid_element()) notes.push_back("no valid element: the fixture's batch holds no token to compare");
  else if (!report.results.empty() && report.compared() == 0) notes.push_back("nothing was compared");
  if (!report.fixture_candidate.empty())
    notes.push_back("checked the stored simulator outputs (/peer) of the cpgold fixture " + report.fixture_candidate +
                    ", not an implementation");
  std::string out;
  for (const std::string& n : notes) out += (out.empty() ? " (" : "; ") + n;
  return out.empty() ? out : out + ")";
}
}  // namespace

std::string forward_only_hint(const CheckReport& report) {
  std::vector<std::string> missing;
  bool forward_present = false;
  for (const TensorResult& r : report.results) {
    if (r.step >= 0) continue;
    const bool backward = r.tensor == "dq" || r.tensor == "dk" || r.tensor == "dv";
    if (r.missing && backward && std::find(missing.begin(), missing.end(), r.tensor) == missing.end())
      missing.push_back(r.tensor);
    forward_present |= !r.missing && !backward;
  }
  if (missing.empty() || !forward_present) return "";
  std::string names;
  for (const std::string& m : missing) names += (names.empty() ? "" : ", ") + m;
  return names + (missing.size() == 1 ? " is" : " are") +
         " missing in the candidate while o/lse are there: a forward-only candidate is checked with --tensors o,lse "
         "(Python: tensors=\"o,lse\")";
}

std::string verdict_line(const CheckReport& report) {
  if (report.undecided())
    return "verdict: UNDECIDED (a fixture of the " + report.engine + " engine: an error lies between what every limit "
           "within its bound of the CPU reference's allows and what some such limit allows; the CPU reference's "
           "fixture decides: cpgold gen ... --engine cpu)" + verdict_note(report);
  return std::string("verdict: ") + (report.pass() ? "PASS" : "FAIL") + verdict_note(report);
}

std::string render_text(const CheckReport& report) {
  std::ostringstream out;
  out << "golden     " << report.golden << "\n";
  for (const std::string& c : report.candidates)
    out << "candidate  " << c
        << (c == report.fixture_candidate ? "  (a cpgold fixture: its stored simulator outputs /peer are the candidate)"
                                          : "")
        << "\n";
  out << "\n";
  char line[320];
  const char* row_format = "%-14s %-11s %10s %10s %10s %10s %8s %8s %8s  %-5s %8s %8s  %s\n";
  std::snprintf(line, sizeof line, row_format, "tensor", "deciding", "max err", "max limit", "mean err", "mean limit",
                "max/lim", "p99/lim", "mean/lim", "other", "max/lim", "mean/lim", "verdict");
  out << line;
  for (const TensorResult& r : report.results) {
    const Evaluation& e = r.evaluation;
    if (r.missing) {
      std::snprintf(line, sizeof line, row_format, result_name(r).c_str(), deciding_name(r), "-", "-", "-", "-", "-",
                    "-", "-", other_name(r), "-", "-", "FAIL (missing in candidate)");
      out << line;
      continue;
    }
    std::string verdict = r.ok() ? "pass" : e.undecided() ? "undecided" : "FAIL";
    if (!e.exact_ok()) verdict += " (exact: " + std::to_string(e.exact_violation_count) + " x " +
                                  std::string(exact_rule_name(e.exact_violations.front().rule)) + ")";
    else if (e.undecided()) verdict += " (within the " + report.engine + " engine's bound)";
    else if (!e.max_ok) verdict += " (max)";
    else if (!e.mean_ok) verdict += " (mean)";
    std::snprintf(line, sizeof line, row_format, result_name(r).c_str(), deciding_name(r), fmt(e.max_err).c_str(),
                  fmt(e.limits.max).c_str(), fmt(e.mean_err).c_str(), fmt(e.limits.mean).c_str(),
                  fmt_ratio(e.max_ratio).c_str(), fmt_ratio(e.p99_ratio).c_str(), fmt_ratio(e.mean_ratio).c_str(),
                  other_name(r),
                  r.has_other ? fmt_ratio(e.other_max_ratio).c_str() : "-",
                  r.has_other ? fmt_ratio(e.other_mean_ratio).c_str() : "-", verdict.c_str());
    out << line;
  }
  out << "LSE of valid rows without keys: " << (report.empty_row_lse == EmptyRowLse::neg_inf
                                                   ? "-inf (the contract; --empty-row-lse neg-inf)"
                                                   : "+inf (FlashAttention-2's convention, --empty-row-lse pos-inf)")
      << "\n";
  if (report.pad_rows == PadRows::unwritten) {
    int64_t nonzero = 0, nonfinite = 0;
    for (const TensorResult& r : report.results)
      if (!r.missing) nonzero += r.evaluation.unwritten_nonzero, nonfinite += r.evaluation.unwritten_nonfinite;
    out << "pad and tail rows of o/dq/dk/dv: not compared (--pad-rows unwritten: FlashAttention-3/4 with seqused never "
           "write them); they hold "
        << nonzero << " non-zero element(s), " << nonfinite << " of them not finite (information, not part of the verdict)\n";
  } else {
    out << "pad and tail rows of o/dq/dk/dv: exactly 0 (the contract; --pad-rows zero)\n";
  }
  if (report.inputs_nonfinite_valid > 0) {
    int64_t skipped = 0;
    for (const TensorResult& r : report.results)
      if (!r.missing) skipped += r.evaluation.oracle_nonfinite;
    out << "inputs: FLAGGED: the fixture's given inputs hold " << report.inputs_nonfinite_valid
        << " NaN or infinite value(s) in valid rows (a finding about the run that produced them); " << skipped
        << " output element(s) whose exact value is therefore not finite were not compared\n";
  }
  for (const InputsClaim& claim : report.inputs) {
    if (claim.matches) {
      out << "inputs: " << claim.source << " states inputs_sha256 " << short_sha(claim.sha256)
          << ", this fixture's inputs\n";
      continue;
    }
    out << "inputs: " << claim.source << " was computed from the inputs of another fixture"
        << (claim.case_json.empty() ? "" : " (case " + claim.case_json + ")") << ": its inputs_sha256 is "
        << short_sha(claim.sha256) << ", this fixture's inputs are " << short_sha(report.inputs_sha256)
        << ". Check it against the fixture it was computed from, or recompute it from this fixture's inputs.\n";
  }
  for (const std::string& w : report.warnings) out << "warning: " << w << "\n";
  out << "(max/lim = max err / max limit, p99/lim = 99th percentile of err / max limit (within 2.2% above), mean/lim =\n"
         " mean err / mean limit; first against the deciding budget, the last pair against the other one: ncp = non-CP\n"
         " peer, cp = CP peer; step partials carry the CP budget only)\n";
  const Margins m = margins(report);
  out << "\n" << margin_line("margin to the deciding budget", m.deciding_max, m.deciding_max_at, m.deciding_mean, m.deciding_mean_at);
  out << margin_line("margin to the other budget   ", m.other_max, m.other_max_at, m.other_mean, m.other_mean_at);
  bool any_failure = false;
  for (const TensorResult& r : report.results) {
    if (r.ok() || r.missing) continue;
    any_failure = true;
    const Evaluation& e = r.evaluation;
    out << "\n" << result_name(r) << " (" << r.dataset << ")\n";
    if (!e.exact_ok()) {
      out << "  exact rule violated: " << e.exact_violation_count << " element(s)"
          << (e.exact_violation_count == 1 ? ":" : "; the first " + std::to_string(std::min<size_t>(3, r.exact_violations.size())) + " in layout order:")
          << "\n";
      for (size_t i = 0; i < r.exact_violations.size() && i < 3; ++i)
        out << "    " << exact_rule_name(*r.exact_violations[i].rule) << ": "
            << describe(r.exact_violations[i], r.tensor != "lse") << "\n";
    }
    // The worst element is the largest error under the budget rule: shown when a budget failed, not when only an
    // exact rule did (it may then sit where candidate and oracle agree).
    if (r.worst && (!e.max_ok || !e.mean_ok)) out << "  worst element:    " << describe(*r.worst, r.tensor != "lse") << "\n";
    if (r.first_divergence)
      out << "  first divergence: "
          << (r.first_divergence->rule ? "(" + std::string(exact_rule_name(*r.first_divergence->rule)) + ") " : "")
          << describe(*r.first_divergence, r.tensor != "lse") << "\n";
  }
  const std::string forward_only = forward_only_hint(report);
  if (!forward_only.empty()) out << "\n" << forward_only << "\n";
  if (!report.diagnosis.empty()) out << "\n" << render_diagnosis_text(report.diagnosis);
  if (any_failure) out << "\nreproduce: cpgold gen --case '" << report.case_json << "' -o case.h5\n";
  if (report.no_valid_element())
    out << "\nno valid element: the fixture's batch holds no token in the selected tensors (an empty batch); only the "
           "exact rules were checked (shapes, pad rows exactly 0, LSE of rows without keys)\n";
  else if (!report.results.empty() && report.compared() == 0)
    out << "\nno element was compared: every selected row is padding, though the fixture holds "
        << report.fixture_valid_rows << " valid row(s) in the selected tensors"
        << (report.ranks_with_tokens.empty() ? std::string()
                                             : " (on " + std::string(report.ranks_with_tokens.size() == 1 ? "rank " : "ranks ") +
                                                   join_ints(report.ranks_with_tokens) + ")")
        << ": a check that compares nothing fails; check the outputs that hold tokens\n";
  out << "\n" << verdict_line(report) << "\n";
  return out.str();
}

nlohmann::ordered_json to_json(const CheckReport& report) {
  nlohmann::ordered_json j;
  j["golden"] = report.golden;
  j["candidates"] = report.candidates;
  j["case"] = sim::parse_ordered_json(report.case_json, "case_json");  // bounded (length, depth), as everywhere
  j["pass"] = report.pass();
  j["undecided"] = report.undecided();
  j["engine"] = report.engine;
  j["verdict"] = verdict_line(report);
  j["empty_row_lse"] = std::string(empty_row_lse_name(report.empty_row_lse));
  j["pad_rows"] = std::string(pad_rows_name(report.pad_rows));
  j["warnings"] = report.warnings;
  j["compared"] = report.compared();
  j["no_valid_element"] = report.no_valid_element();
  const std::string hint = forward_only_hint(report);
  j["hint"] = hint.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(hint);
  j["ranks"] = report.ranks;
  j["fixture_candidate"] =
      report.fixture_candidate.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(report.fixture_candidate);
  nlohmann::ordered_json inputs;
  inputs["fixture_sha256"] =
      report.inputs_sha256.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(report.inputs_sha256);
  inputs["candidates"] = nlohmann::ordered_json::array();
  for (const InputsClaim& claim : report.inputs)
    inputs["candidates"].push_back(
        {{"source", claim.source}, {"sha256", claim.sha256},
         {"case_json", claim.case_json.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(claim.case_json)},
         {"matches", claim.matches}});
  inputs["fixture_source"] = report.inputs_source;
  inputs["fixture_nonfinite_valid"] = report.inputs_nonfinite_valid;
  j["inputs"] = inputs;
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const TensorResult& r : report.results) {
    nlohmann::ordered_json t;
    t["tensor"] = r.tensor;
    t["rank"] = r.rank;
    t["step"] = r.step;
    // "forward" or "backward" for a step partial (/ranks/<r>/steps/<s>/forward|backward); null for an output.
    t["pass_kind"] = r.pass.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.pass);
    t["dataset"] = r.dataset;
    t["budget"] = r.scope == CandidateScope::cp_output ? "cp" : "max(cp,non_cp)";
    t["missing"] = r.missing;
    const Evaluation& e = r.evaluation;
    t["compared"] = e.compared;
    put_number(t, "max_err", e.max_err);
    put_number(t, "mean_err", e.mean_err);
    t["max_limit"] = e.limits.max;
    t["mean_limit"] = e.limits.mean;
    t["other_max_limit"] = e.other.max;
    t["other_mean_limit"] = e.other.mean;
    put_number(t, "max_ratio", e.max_ratio);
    // 99th percentile of |error| / max limit over the compared elements (a bin edge: within 2.2% above the true one)
    put_number(t, "p99_ratio", e.p99_ratio);
    put_number(t, "mean_ratio", e.mean_ratio);
    t["other_budget"] = other_name(r);
    if (r.has_other) {
      put_number(t, "other_max_ratio", e.other_max_ratio);
      put_number(t, "other_mean_ratio", e.other_mean_ratio);
    } else {
      t["other_max_ratio"] = nullptr;
      t["other_mean_ratio"] = nullptr;
    }
    t["exact_violations"] = e.exact_violation_count;
    t["oracle_nonfinite"] = e.oracle_nonfinite;
    if (report.pad_rows == PadRows::unwritten) {  // information only: rows the convention leaves out
      t["unwritten_nonzero"] = e.unwritten_nonzero;
      t["unwritten_nonfinite"] = e.unwritten_nonfinite;
    }
    if (!e.exact_violations.empty()) {
      t["exact_rule"] = std::string(exact_rule_name(e.exact_violations.front().rule));
      t["exact_rule_id"] = exact_rule_id(e.exact_violations.front().rule);
    }
    nlohmann::ordered_json listed = nlohmann::ordered_json::array();
    for (const ElementLocation& v : r.exact_violations) listed.push_back(location_json(v));
    t["exact_violations_listed"] = listed;
    t["pass"] = r.ok();
    t["undecided"] = !r.missing && r.evaluation.undecided();
    t["engine_bound"] = r.evaluation.engine_bound;
    t["worst"] = r.worst ? location_json(*r.worst) : nlohmann::ordered_json(nullptr);
    t["first_divergence"] = r.first_divergence ? location_json(*r.first_divergence) : nlohmann::ordered_json(nullptr);
    results.push_back(t);
  }
  j["results"] = results;
  j["diagnosis"] = diagnosis_json(report.diagnosis);
  const Margins m = margins(report);
  nlohmann::ordered_json margin;
  put_number(margin, "deciding_max_ratio", m.deciding_max);
  margin["deciding_max_at"] = m.deciding_max_at;
  put_number(margin, "deciding_mean_ratio", m.deciding_mean);
  margin["deciding_mean_at"] = m.deciding_mean_at;
  put_number(margin, "other_max_ratio", m.other_max);
  margin["other_max_at"] = m.other_max_at;
  put_number(margin, "other_mean_ratio", m.other_mean);
  margin["other_mean_at"] = m.other_mean_at;
  j["margins"] = margin;
  return j;
}

}  // namespace cpgold::fx
