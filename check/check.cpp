#include "check/check.hpp"
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
#include "fixtures/storage/hdf5_file.hpp"
#include "fixtures/schema/inputs_digest.hpp"
#include "reference/sha256.hpp"
#include "reference/attention.hpp"
#include "reference/input_error.hpp"
#include "sim/case_spec.hpp"
#include "sim/executor.hpp"

namespace cpgold::fx {

namespace {

// (rank, step, pass, quantity); rank -1 = global, step -1 = not a step partial, pass 0 forward / 1 backward.
using Key = CandidateSet::Key;
using Candidates = CandidateSet;

// Candidate element types (fixtures/SCHEMA.md): what kernels produce. float64 is refused rather than silently
// rounded to float32 on read.
bool is_candidate_float(h5::Element e) {
  return e == h5::Element::bf16 || e == h5::Element::fp16 || e == h5::Element::fp32;
}

// A group named by an index ("/ranks/<r>", ".../steps/<s>"): canonical decimal, no sign, no leading zero.
int index_of_group(const h5::Reader& reader, const std::string& group, const std::string& name, const char* what) {
  const bool digits = !name.empty() && name.size() <= 9 && name.find_first_not_of("0123456789") == std::string::npos;
  if (!digits || (name.size() > 1 && name[0] == '0'))
    fail_input(reader.where(group), "a ", what, " group's name must be the ", what, " in decimal (0, 1, 2, ...), found \"",
               name, "\"");
  return std::stoi(name);
}

// "/ranks/<r>"; the `rank` attribute, when present, must agree with the name.
int rank_of_group(const h5::Reader& reader, const std::string& name) {
  const std::string group = "/ranks/" + name;
  const int rank = index_of_group(reader, group, name, "rank");
  if (reader.has_attribute(group, "rank")) {
    const int64_t attribute = reader.attr_int64(group, "rank");
    if (attribute != rank)
      fail_input(reader.where(group), "attribute rank = ", attribute, " disagrees with the group name ", name);
  }
  return rank;
}

CandidateTensor load_tensor(const h5::Reader& reader, const std::string& path, Quantity quantity) {
  CandidateTensor t;
  t.where = reader.where(path);
  const h5::DatasetInfo info = reader.info(path);
  if (!is_candidate_float(info.element))
    fail_input(t.where, "expected float32, bf16 or fp16 values, found ", info.type_text, " ", h5::dims_text(info.dims));
  t.dims = info.dims;
  if (quantity == Quantity::lse) {
    std::string layout = "ht";
    if (reader.has_attribute(path, "lse_layout")) layout = reader.attr_string(path, "lse_layout");
    if (layout != "ht" && layout != "th")
      fail_input(t.where, "attribute lse_layout: expected \"ht\" ([h, t]) or \"th\" ([t, h] or [t, h, 1]), found \"",
                 layout, "\"");
    if (info.dims.size() == 3 && info.dims[2] == 1) layout = "th", t.dims.pop_back();
    t.lse_row_major = layout == "th";
  }
  // The values are read by read_candidate_files once the declared shape passed its gate (none read here).
  return t;
}

void add(Candidates& out, Key key, CandidateTensor tensor) { out.add(key, std::move(tensor)); }

void scan_outputs(const h5::Reader& reader, const std::string& group, int rank, Candidates& out) {
  for (Quantity q : kAllQuantities) {
    const std::string path = (group == "/" ? "" : group) + "/" + std::string(quantity_name(q));
    if (reader.exists(path) && !reader.is_group(path)) add(out, {rank, -1, 0, q}, load_tensor(reader, path, q));
  }
}

// The inputs a candidate file states (root attribute inputs_sha256, optionally inputs_case_json).
void scan_inputs_claim(const h5::Reader& reader, Candidates& out) {
  if (!reader.has_attribute("/", kInputsDigestAttribute)) return;
  InputsClaim claim;
  claim.source = reader.path();
  claim.sha256 = reader.attr_string("/", kInputsDigestAttribute);
  if (!is_sha256_hex(claim.sha256))
    fail_input(reader.where("/"), "attribute ", kInputsDigestAttribute, ": expected 64 lowercase hex digits, found \"",
               claim.sha256, "\"");
  if (reader.has_attribute("/", "inputs_case_json")) claim.case_json = reader.attr_string("/", "inputs_case_json");
  out.inputs.push_back(std::move(claim));
}

// A cpgold fixture given as a candidate: what it holds of an implementation's kind is its simulator's outputs (the CP
// peer in the case dtype, gathered to the global layout), so those are the candidate; its /ranks/<r>/o ... are oracle
// shards, which would pass whatever they were checked against.
bool scan_fixture_candidate(const h5::Reader& reader, Candidates& out) {
  if (!reader.is_group("/case") || !reader.has_attribute("/case", "schema_version")) return false;
  out.fixture_candidate = reader.path();
  out.global_scope = CandidateScope::cp_output;
  for (Quantity q : kAllQuantities)
    if (reader.exists(peer_path(q)) && !reader.is_group(peer_path(q))) add(out, {-1, -1, 0, q}, load_tensor(reader, peer_path(q), q));
  InputsClaim claim;
  claim.source = reader.path();
  claim.sha256 = reader.has_attribute("/case", kInputsDigestAttribute)
                     ? reader.attr_string("/case", kInputsDigestAttribute)
                     : inputs_sha256(reader);
  if (reader.has_attribute("/case", "case_json")) claim.case_json = reader.attr_string("/case", "case_json");
  out.inputs.push_back(std::move(claim));
  return true;
}

void scan_file(const h5::Reader& reader, Candidates& out) {
  if (scan_fixture_candidate(reader, out)) return;
  scan_inputs_claim(reader, out);
  int root_rank = -1;
  if (reader.has_attribute("/", "rank")) {
    const int64_t rank = reader.attr_int64("/", "rank");
    if (rank < 0 || rank > INT32_MAX)
      fail_input(reader.where("/"), "attribute rank: expected a rank >= 0, found ", rank);
    root_rank = static_cast<int>(rank);
  }
  if (reader.has_attribute("/", "scope")) {
    const std::string scope = reader.attr_string("/", "scope");
    if (scope == "cp_gathered") out.global_scope = CandidateScope::cp_output;
    else if (scope != "global") fail_input(reader.where("/"), "attribute scope: expected \"global\" or \"cp_gathered\", found \"", scope, "\"");
  }
  scan_outputs(reader, "/", root_rank, out);
  for (const std::string& name : reader.children("/ranks")) {
    const int rank = rank_of_group(reader, name);
    const std::string group = "/ranks/" + name;
    scan_outputs(reader, group, rank, out);
    for (const std::string& step : reader.children(group + "/steps")) {
      for (int pass = 0; pass < 2; ++pass) {
        const std::string sg = group + "/steps/" + step + (pass == 0 ? "/forward" : "/backward");
        for (Quantity q : kAllQuantities) {
          const std::string path = sg + "/" + std::string(quantity_name(q));
          if (reader.exists(path) && !reader.is_group(path))
            add(out, {rank, index_of_group(reader, group + "/steps/" + step, step, "step"), pass, q},
                load_tensor(reader, path, q));
        }
      }
    }
  }
}

struct Context {
  const h5::Reader& golden;
  const FixtureFile& fixture;
  EmptyRowLse empty_row_lse = EmptyRowLse::neg_inf;
  PadRows pad_rows = PadRows::zero;
  // Gathered CP peer, global layout: the fixture's verified copy (FixtureFile::outputs), else read into `read_peer`.
  std::map<Quantity, const Values<float>*> peer;
  std::map<Quantity, Values<float>> read_peer;
  Values<float> oracle;  // the oracle of the result being checked when it is not the verified global copy
};

void locate_global(const Context& ctx, bool kv_side, int64_t global_row, ElementLocation& loc) {
  const PackedSequences& side = kv_side ? ctx.fixture.layout.kv : ctx.fixture.layout.q;
  loc.global_row = global_row;
  for (int b = 0; b < side.batch(); ++b) {
    if (global_row >= side.offset(b) && global_row < side.offset(b) + side.padded_length(b)) {
      loc.sequence = b;
      loc.row_in_sequence = global_row - side.offset(b);
      loc.sequence_length = side.length(b);
      loc.pad_row = loc.row_in_sequence >= side.length(b);
    }
  }
}

ElementLocation locate(const Context& ctx, const TensorResult& result, Quantity quantity, const ElementIndex& index,
                       double candidate, double oracle) {
  ElementLocation loc;
  loc.rank = result.rank;
  loc.step = result.step;
  loc.row = index.row;
  loc.head = index.head;
  loc.dim = index.dim;
  loc.candidate = candidate;
  loc.oracle = oracle;
  const bool kv_side = is_kv_side(quantity);
  int64_t global_row = -1;
  if (result.step >= 0) {
    const sim::PassPlan& pass = result.pass == "forward" ? ctx.fixture.plan.forward : ctx.fixture.plan.backward;
    const AttentionCall& call = pass.tile(result.rank, result.step).call;
    for (size_t b = 0; b < call.sequences.size(); ++b)
      for (const RowSegment& seg : kv_side ? call.sequences[b].kv : call.sequences[b].q)
        if (index.row >= seg.first_row && index.row < seg.first_row + seg.count) {
          loc.sequence = static_cast<int>(b);
          loc.row_in_sequence = seg.position + (index.row - seg.first_row);
        }
    return loc;
  }
  if (result.rank >= 0) {
    const sim::SidePartition& side = kv_side ? ctx.fixture.plan.partition.kv : ctx.fixture.plan.partition.q;
    global_row = side.global_row(result.rank, index.row);
  } else {
    global_row = index.row;
  }
  locate_global(ctx, kv_side, global_row, loc);
  const auto peer = ctx.peer.find(quantity);
  if (peer != ctx.peer.end()) {
    const std::vector<int64_t>& d = ctx.golden.info(golden_path(quantity)).dims;
    const size_t at = quantity == Quantity::lse ? static_cast<size_t>(index.head * d[1] + global_row)
                                                : static_cast<size_t>((global_row * d[1] + index.head) * d[2] + index.dim);
    if (at < peer->second->size()) loc.peer = (*peer->second)[at];
  }
  return loc;
}

std::optional<ExactRule> rule_at(const Evaluation& e, const ElementIndex& index) {
  for (const ExactViolation& v : e.exact_violations)
    if (v.index == index) return v.rule;
  return std::nullopt;
}

// The stored oracle (float32) a result is compared with: the global output as open_fixture verified and kept it, a
// rank's rows of it (gathered, or the shard itself where it is not bit for bit those rows), else read from the file
// (step partials; a fixture opened without keeping its outputs).
const Values<float>& oracle_of(Context& ctx, const std::string& golden_dataset, Quantity quantity, int rank, int step) {
  const VerifiedOutputs* kept = ctx.fixture.outputs.get();
  if (kept && step < 0) {
    const VerifiedOutputs::Output& global = kept->global.at(quantity);
    if (rank < 0) return global.oracle;
    const auto shard = kept->shards.find({rank, quantity});
    if (shard != kept->shards.end()) return shard->second;
    const sim::SidePartition& side = is_kv_side(quantity) ? ctx.fixture.plan.partition.kv : ctx.fixture.plan.partition.q;
    gather_stored_rows_into(global.oracle, global.dims, quantity, side.gather_indices(rank), ctx.oracle);
    return ctx.oracle;
  }
  ctx.golden.read_float_values(golden_dataset, ctx.oracle);
  return ctx.oracle;
}

TensorResult check_one(Context& ctx, const std::string& golden_dataset, Quantity quantity, int rank, int step,
                       int pass, CandidateScope scope, const CandidateTensor* candidate, std::vector<uint8_t> valid) {
  TensorResult result;
  result.tensor = std::string(quantity_name(quantity));
  result.rank = rank;
  result.step = step;
  if (step >= 0) result.pass = pass == 0 ? "forward" : "backward";
  result.scope = scope;
  if (!candidate) {
    result.missing = true;
    result.dataset = "(missing)";
    return result;
  }
  result.dataset = candidate->where;
  const std::vector<int64_t> dims = ctx.golden.info(golden_dataset).dims;  // [t, h, d], LSE [h, t]
  const Values<float>& oracle_values = oracle_of(ctx, golden_dataset, quantity, rank, step);
  const TensorView<float> oracle =
      quantity == Quantity::lse
          ? TensorView<float>{oracle_values.data(), dims[1], dims[0], 1, 1, dims[1]}
          : TensorView<float>{oracle_values.data(), dims[0], dims[1], dims[2], dims[1] * dims[2], dims[2]};
  const StoredBudgets golden = read_output_budgets(ctx.golden, golden_dataset);
  std::vector<int64_t> expected = dims;
  TensorView<float> view;
  if (quantity == Quantity::lse) {
    const int64_t h = dims[0], t = dims[1];
    if (candidate->lse_row_major) {
      expected = {t, h};
      view = view_lse_row_major(candidate->values.data(), t, h);
    } else {
      view = {candidate->values.data(), t, h, 1, 1, t};
    }
  } else {
    view = {candidate->values.data(), dims[0], dims[1], dims[2], dims[1] * dims[2], dims[2]};
  }
  if (candidate->dims != expected)
    fail_input(candidate->where, "expected shape ", h5::dims_text(expected), " (from ", ctx.fixture.path, ":",
               golden_dataset, "), found ", h5::dims_text(candidate->dims));
  result.has_other = golden.has_non_cp;
  const Limits limits = deciding_limits(golden.budgets, scope);
  const Limits other = other_limits(golden.budgets, scope);
  result.evaluation = evaluate(quantity, oracle, view, valid, limits, other, ctx.empty_row_lse, ctx.pad_rows);
  const Evaluation& e = result.evaluation;
  if (e.worst) result.worst = locate(ctx, result, quantity, *e.worst, e.worst_candidate, e.worst_oracle);
  if (e.first_divergence) {
    result.first_divergence = locate(ctx, result, quantity, *e.first_divergence, e.first_candidate, e.first_oracle);
    if (!e.exact_ok()) result.first_divergence->rule = rule_at(e, *e.first_divergence);
  }
  for (const ExactViolation& v : e.exact_violations) {
    result.exact_violations.push_back(locate(ctx, result, quantity, v.index, v.candidate, v.oracle));
    result.exact_violations.back().rule = v.rule;
  }
  return result;
}

std::vector<Quantity> selected(const CheckOptions& options) {
  if (!options.tensors.empty()) return options.tensors;
  return {std::begin(kAllQuantities), std::end(kAllQuantities)};
}

// `golden` and `fixture`: the one open handle of the golden file and what it holds.
CheckReport run_checks(const h5::Reader& golden, const FixtureFile& fixture, const Candidates& cands,
                       const CheckOptions& options, std::vector<std::string> files) {
  for (int r : options.ranks)
    if (r < 0 || r >= fixture.plan.cp_size)
      fail_input("ranks", "rank ", r, " does not exist: the fixture has cp_size ", fixture.plan.cp_size, " (ranks 0..",
                 fixture.plan.cp_size - 1, ")");
  auto rank_selected = [&](int r) {
    return options.ranks.empty() || std::find(options.ranks.begin(), options.ranks.end(), r) != options.ranks.end();
  };
  const std::string& golden_path_text = golden.path();
  Context ctx{golden, fixture, options.empty_row_lse, options.pad_rows, {}, {}, {}};
  for (Quantity q : kAllQuantities) {
    if (fixture.outputs) ctx.peer[q] = &fixture.outputs->global.at(q).peer;  // verified when the fixture was opened
    else if (golden.exists(peer_path(q))) ctx.peer[q] = &(ctx.read_peer[q] = golden.read_float_values(peer_path(q)));
  }
  CheckReport report;
  report.golden = golden_path_text;
  report.case_json = fixture.case_json;
  report.candidates = std::move(files);
  report.empty_row_lse = options.empty_row_lse;
  report.pad_rows = options.pad_rows;
  report.fixture_candidate = cands.fixture_candidate;
  report.warnings = cands.warnings;
  report.inputs = cands.inputs;
  report.inputs_sha256 = fixture.inputs_sha256;
  if (!report.inputs.empty() && report.inputs_sha256.empty()) report.inputs_sha256 = inputs_sha256(golden);
  for (InputsClaim& claim : report.inputs) claim.matches = claim.sha256 == report.inputs_sha256;
  if (cands.tensors.empty())
    fail_input(report.candidates.empty() ? "candidate" : report.candidates.front(),
               "no output datasets found: expected /o, /lse, /dq, /dk, /dv at the root or under /ranks/<r>/");
  const std::vector<uint8_t> valid_q = valid_rows(fixture.layout.q), valid_kv = valid_rows(fixture.layout.kv);
  const std::vector<Quantity> wanted = selected(options);
  bool any_rank = false;
  for (const auto& [key, tensor] : cands.tensors) any_rank |= std::get<0>(key) >= 0 && std::get<1>(key) < 0;
  for (const auto& [key, tensor] : cands.tensors) {
    const auto [rank, step, pass, q] = key;
    if (rank >= fixture.plan.cp_size) fail_input(tensor.where, "rank ", rank, " does not exist: the fixture has cp_size ", fixture.plan.cp_size);
  }
  for (int r = 0; r < fixture.plan.cp_size; ++r)
    if (any_rank && rank_selected(r)) report.ranks.push_back(r);
  std::vector<int> unselected;
  for (const auto& [key, tensor] : cands.tensors) {
    const int rank = std::get<0>(key);
    if (rank >= 0 && !rank_selected(rank) && std::find(unselected.begin(), unselected.end(), rank) == unselected.end()) {
      unselected.push_back(rank);
      report.warnings.push_back("the candidates hold outputs of rank " + std::to_string(rank) +
                                ", which was not selected (ranks): not checked");
    }
  }
  for (Quantity q : wanted) {
    const auto global = cands.tensors.find({-1, -1, 0, q});
    const bool kv = is_kv_side(q);
    if (global != cands.tensors.end() || !any_rank)
      report.results.push_back(check_one(ctx, golden_path(q), q, -1, -1, 0, cands.global_scope,
                                         global == cands.tensors.end() ? nullptr : &global->second, kv ? valid_kv : valid_q));
    if (!any_rank) continue;
    for (int r = 0; r < fixture.plan.cp_size; ++r) {
      if (!rank_selected(r)) continue;
      const auto found = cands.tensors.find({r, -1, 0, q});
      const sim::SidePartition& side = kv ? fixture.plan.partition.kv : fixture.plan.partition.q;
      report.results.push_back(check_one(ctx, rank_output_path(r, q), q, r, -1, 0, CandidateScope::cp_output,
                                         found == cands.tensors.end() ? nullptr : &found->second,
                                         shard_row_flags(side, r, kv ? valid_kv : valid_q)));
    }
  }
  // What the fixture itself holds to compare in the selected tensors: an empty batch passes on its exact rules, a
  // selection of ranks holding only padding does not (check_one counts what was compared).
  for (Quantity q : wanted) {
    const std::vector<uint8_t>& valid = is_kv_side(q) ? valid_kv : valid_q;
    report.fixture_valid_rows += std::count(valid.begin(), valid.end(), uint8_t{1});
  }
  for (int r = 0; r < fixture.plan.cp_size; ++r) {
    bool holds = false;
    for (Quantity q : wanted) {
      const bool kv = is_kv_side(q);
      const std::vector<uint8_t> mine =
          shard_row_flags(kv ? fixture.plan.partition.kv : fixture.plan.partition.q, r, kv ? valid_kv : valid_q);
      holds |= std::find(mine.begin(), mine.end(), uint8_t{1}) != mine.end();
    }
    if (holds) report.ranks_with_tokens.push_back(r);
  }
  // Step partials: checked where both the fixture and the candidate carry them.
  for (const auto& [key, tensor] : cands.tensors) {
    const auto [rank, step, pass, q] = key;
    if (step < 0 || !rank_selected(rank) || std::find(wanted.begin(), wanted.end(), q) == wanted.end()) continue;
    const std::string dataset = step_group(rank, step, pass == 0 ? sim::PassKind::forward : sim::PassKind::backward) +
                                "/" + std::string(quantity_name(q));
    if (!fixture.traced || !golden.exists(dataset))
      fail_input(tensor.where, "the golden fixture has no ", dataset, " (generate it with gen --trace)");
    const sim::PassPlan& plan_pass = pass == 0 ? fixture.plan.forward : fixture.plan.backward;
    report.results.push_back(check_one(ctx, dataset, q, rank, step, pass, CandidateScope::cp_output, &tensor,
                                       rows_read(plan_pass.tile(rank, step).call, is_kv_side(q))));
  }
  if (options.diagnose && !report.pass()) {
    DiagnosisInput input;
    input.golden = &golden;
    input.fixture = &fixture;
    input.empty_row_lse = options.empty_row_lse;
    input.pad_rows = options.pad_rows;
    input.replay_budget_seconds = options.diagnosis_budget_seconds;
    for (const auto& [key, tensor] : cands.tensors)
      input.candidates.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), std::get<3>(key), &tensor.values,
                                  tensor.dims, tensor.lse_row_major});
    report.diagnosis = diagnose(input, report);
  }
  return report;
}

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

namespace {
// Datasets named like an output (o, lse, dq, dk, dv) anywhere in a candidate file that the scan did not read: a
// tensor written to the wrong path (/outputs/o, /golden/o) must not look checked.
void note_unread(const h5::Reader& reader, const Candidates& cands, const std::string& group,
                 std::vector<std::string>& warnings) {
  for (const std::string& name : reader.children(group)) {
    const std::string path = (group == "/" ? "" : group) + "/" + name;
    if (reader.is_group(path)) {
      note_unread(reader, cands, path, warnings);
      continue;
    }
    if (!parse_quantity(name)) continue;
    const std::string where = reader.where(path);
    bool read = false;
    for (const auto& [key, tensor] : cands.tensors) read |= tensor.where == where;
    if (!read)
      warnings.push_back(where + " is not read by check (outputs are read at the root, /o ..., and under "
                                 "/ranks/<r>/ and /ranks/<r>/steps/<s>/forward|backward/): it was not checked");
  }
}
}  // namespace

void set_conventions(CheckOptions& options, const std::string& empty_row_lse, const std::string& empty_row_field,
                     const std::string& pad_rows, const std::string& pad_rows_field) {
  const auto lse = parse_empty_row_lse(empty_row_lse);
  if (!lse) fail_input(empty_row_field, "expected neg-inf or pos-inf, got \"", empty_row_lse, "\"");
  const auto pads = parse_pad_rows(pad_rows);
  if (!pads) fail_input(pad_rows_field, "expected zero or unwritten, got \"", pad_rows, "\"");
  options.empty_row_lse = *lse;
  options.pad_rows = *pads;
}

std::vector<Quantity> parse_tensor_list(const std::string& text, const std::string& field) {
  std::vector<Quantity> out;
  size_t begin = 0;
  for (int i = 0;; ++i) {
    const size_t end = text.find(',', begin);
    const std::string name = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const auto quantity = parse_quantity(name);
    if (name.empty()) fail_input(field, "empty item ", i, " in \"", text, "\" (expected o, lse, dq, dk, dv)");
    if (!quantity) fail_input(field, "unknown tensor \"", name, "\" (expected o, lse, dq, dk, dv)");
    if (std::find(out.begin(), out.end(), *quantity) != out.end())
      fail_input(field, "tensor \"", name, "\" is given twice in \"", text, "\"");
    out.push_back(*quantity);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

std::vector<int> parse_rank_list(const std::string& text, const std::string& field) {
  std::vector<int> out;
  size_t begin = 0;
  for (;;) {
    const size_t end = text.find(',', begin);
    const std::string item = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    size_t used = 0;
    int rank = -1;
    try {
      rank = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || rank < 0 || item[0] == '+' || item[0] == ' ')
      fail_input(field, "expected ranks as non-negative integers separated by commas (e.g. 0,2), got \"", text, "\"");
    if (std::find(out.begin(), out.end(), rank) != out.end())
      fail_input(field, "rank ", rank, " is given twice in \"", text, "\"");
    out.push_back(rank);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

void CandidateSet::add(const Key& key, CandidateTensor tensor) {
  auto [it, inserted] = tensors.emplace(key, std::move(tensor));
  if (!inserted) fail_input(it->second.where, "the same tensor is given twice (also ", tensor.where, ")");
}

CandidateSet read_candidate_files(const std::vector<std::string>& files, const ExpectedShape& expected_shape) {
  if (files.empty()) fail_input("candidate", "give at least one candidate file");
  Candidates cands;
  cands.sources = files;
  for (const std::string& file : files) {  // one open per file: the scan, the unread-dataset warnings, the reads
    const h5::Reader reader(file);
    std::set<Key> before;
    for (const auto& [key, tensor] : cands.tensors) before.insert(key);
    scan_file(reader, cands);
    if (cands.fixture_candidate != file) note_unread(reader, cands, "/", cands.warnings);
    // The tensors of this file, described by the scan: each declared shape against the golden's first, then the
    // values (a file may declare any shape; nothing is allocated for one that does not fit).
    for (auto& [key, tensor] : cands.tensors) {
      if (before.count(key)) continue;
      if (expected_shape) {
        const auto [expected, from] = expected_shape(key, tensor);
        if (tensor.dims != expected)
          fail_input(tensor.where, "expected shape ", h5::dims_text(expected), " (from ", from, "), found ",
                     h5::dims_text(tensor.dims));
      }
      tensor.values = reader.read_float_values(tensor.where.substr(reader.path().size() + 1));
    }
  }
  return cands;
}

namespace {
// The golden given again as a candidate: almost always swapped or repeated arguments.
void refuse_same_file(const std::string& golden, const std::vector<std::string>& candidates, const CheckOptions& options) {
  if (options.allow_same_file) return;
  for (const std::string& file : candidates) {
    std::error_code ec;
    if (file == golden || std::filesystem::equivalent(golden, file, ec))
      fail_input(file, "is the golden fixture itself: a fixture checked against itself reads its own stored simulator "
                 "outputs (/peer) as the candidate and says nothing about an implementation. The order is GOLDEN "
                 "CANDIDATE... (were the arguments swapped?); to check the stored simulator outputs on purpose, pass "
                 "--allow-same-file (Python: allow_same_file=True)");
  }
}
}  // namespace

CheckReport check(const std::string& golden, const std::vector<std::string>& candidates, const CheckOptions& options) {
  if (candidates.empty()) fail_input("candidate", "give at least one candidate file");
  refuse_same_file(golden, candidates, options);
  const h5::Reader reader(golden);
  // The outputs whose budgets open_fixture verifies are kept for the comparison: each is read and decoded once.
  return check(reader, open_fixture(reader, OpenOptions{false, true}), candidates, options);
}

ExpectedShape expected_shapes(const h5::Reader& golden, const FixtureFile& fixture) {
  // Each candidate tensor's shape is the golden dataset's it is checked against: rank and step groups the fixture
  // lacks are refused here as run_checks would, before anything is read.
  return [&golden, &fixture](const CandidateSet::Key& key, const CandidateTensor& tensor) {
    const auto [rank, step, pass, q] = key;
    if (rank >= fixture.plan.cp_size)
      fail_input(tensor.where, "rank ", rank, " does not exist: the fixture has cp_size ", fixture.plan.cp_size);
    std::string dataset = rank < 0 ? golden_path(q) : rank_output_path(rank, q);
    if (step >= 0) {
      dataset = step_group(rank, step, pass == 0 ? sim::PassKind::forward : sim::PassKind::backward) + "/" +
                std::string(quantity_name(q));
      if (!fixture.traced || !golden.is_dataset(dataset))
        fail_input(tensor.where, "the golden fixture has no ", dataset, " (generate it with gen --trace)");
    }
    std::vector<int64_t> dims = golden.info(dataset).dims;
    if (q == Quantity::lse && tensor.lse_row_major && dims.size() == 2) std::swap(dims[0], dims[1]);
    return std::pair{dims, fixture.path + ":" + dataset};
  };
}

CheckReport check(const h5::Reader& golden, const FixtureFile& fixture, const std::vector<std::string>& candidates,
                  const CheckOptions& options) {
  if (candidates.empty()) fail_input("candidate", "give at least one candidate file");
  refuse_same_file(golden.path(), candidates, options);
  const ExpectedShape expected_shape = expected_shapes(golden, fixture);
  return check(golden, fixture, read_candidate_files(candidates, expected_shape), options);
}

CheckReport check(const h5::Reader& golden, const FixtureFile& fixture, const CandidateSet& candidates,
                  const CheckOptions& options) {
  return run_checks(golden, fixture, candidates, options, candidates.sources);
}

CheckReport self_check(const std::string& golden, const CheckOptions& options) {
  const h5::Reader reader(golden);
  const FixtureFile fixture = open_fixture(reader, OpenOptions{false});
  auto input = [&](const char* name) {
    const h5::DatasetInfo info = reader.info(std::string("/inputs/") + name);
    Tensor3<float> t(info.dims[0], info.dims[1], info.dims[2]);
    t.values = reader.read_float(std::string("/inputs/") + name);
    return t;
  };
  const sim::CaseInputs inputs{input("q"), input("k"), input("v"), input("dout")};
  sim::ExecutorOptions executor;
  executor.record_trace = fixture.traced;
  executor.kernel.row_block = 48;     // another tile size than the reference's 64
  executor.kernel.scale_on_k = true;  // the scale applied to K (in float32) instead of the scores
  const sim::CpRun<float> cp = sim::run_cp_peer(fixture.plan, inputs, fixture.spec.dtype, executor);
  const sim::GlobalOutputs<float> gathered = sim::gather_outputs(fixture.plan, cp.ranks);

  Candidates cands;
  cands.global_scope = CandidateScope::cp_output;  // gathered CP outputs: the CP budget decides
  auto put = [&](Key key, const std::string& path, const std::vector<float>& values, std::vector<int64_t> dims) {
    cands.tensors[key] = CandidateTensor{"self-check:" + path, Values<float>(values.begin(), values.end()),
                                         std::move(dims), false};
  };
  auto put_outputs = [&](int rank, const std::string& prefix, const Tensor3<float>& o, const LseTensor<float>& lse,
                         const Tensor3<float>& dq, const Tensor3<float>& dk, const Tensor3<float>& dv) {
    put({rank, -1, 0, Quantity::o}, prefix + "/o", o.values, {o.rows, o.heads, o.dim});
    put({rank, -1, 0, Quantity::lse}, prefix + "/lse", lse.values, {lse.heads, lse.rows});
    put({rank, -1, 0, Quantity::dq}, prefix + "/dq", dq.values, {dq.rows, dq.heads, dq.dim});
    put({rank, -1, 0, Quantity::dk}, prefix + "/dk", dk.values, {dk.rows, dk.heads, dk.dim});
    put({rank, -1, 0, Quantity::dv}, prefix + "/dv", dv.values, {dv.rows, dv.heads, dv.dim});
  };
  put_outputs(-1, "", gathered.o, gathered.lse, gathered.dq, gathered.dk, gathered.dv);
  for (int r = 0; r < fixture.plan.cp_size; ++r) {
    const sim::RankOutputs<float>& mine = cp.ranks[static_cast<size_t>(r)];
    put_outputs(r, rank_group(r), mine.o, mine.lse, mine.dq, mine.dk, mine.dv);
  }
  for (const sim::ForwardStepTrace<float>& t : cp.trace.forward) {
    const std::string g = step_group(t.rank, t.step, sim::PassKind::forward);
    put({t.rank, t.step, 0, Quantity::o}, g + "/o", t.o.values, {t.o.rows, t.o.heads, t.o.dim});
    put({t.rank, t.step, 0, Quantity::lse}, g + "/lse", t.lse.values, {t.lse.heads, t.lse.rows});
  }
  for (const sim::BackwardStepTrace<float>& t : cp.trace.backward) {
    const std::string g = step_group(t.rank, t.step, sim::PassKind::backward);
    put({t.rank, t.step, 1, Quantity::dq}, g + "/dq", t.dq.values, {t.dq.rows, t.dq.heads, t.dq.dim});
    put({t.rank, t.step, 1, Quantity::dk}, g + "/dk", t.dk.values, {t.dk.rows, t.dk.heads, t.dk.dim});
    put({t.rank, t.step, 1, Quantity::dv}, g + "/dv", t.dv.values, {t.dv.rows, t.dv.heads, t.dv.dim});
  }
  return run_checks(reader, fixture, cands, options,
                    {"self-check: CP simulator in " + std::string(dtype_name(fixture.spec.dtype)) +
                     ", scale on K, row block 48 (" + std::string(sim::comm_name(fixture.plan.comm)) + ", W=" +
                     std::to_string(fixture.plan.cp_size) + ")"});
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
  const char* row_format = "%-14s %-11s %10s %10s %10s %10s %8s %8s  %-5s %8s %8s  %s\n";
  std::snprintf(line, sizeof line, row_format, "tensor", "deciding", "max err", "max limit", "mean err", "mean limit",
                "max/lim", "mean/lim", "other", "max/lim", "mean/lim", "verdict");
  out << line;
  for (const TensorResult& r : report.results) {
    const Evaluation& e = r.evaluation;
    if (r.missing) {
      std::snprintf(line, sizeof line, row_format, result_name(r).c_str(), deciding_name(r), "-", "-", "-", "-", "-",
                    "-", other_name(r), "-", "-", "FAIL (missing in candidate)");
      out << line;
      continue;
    }
    std::string verdict = r.ok() ? "pass" : "FAIL";
    if (!e.exact_ok()) verdict += " (exact: " + std::to_string(e.exact_violation_count) + " x " +
                                  std::string(exact_rule_name(e.exact_violations.front().rule)) + ")";
    else if (!e.max_ok) verdict += " (max)";
    else if (!e.mean_ok) verdict += " (mean)";
    std::snprintf(line, sizeof line, row_format, result_name(r).c_str(), deciding_name(r), fmt(e.max_err).c_str(),
                  fmt(e.limits.max).c_str(), fmt(e.mean_err).c_str(), fmt(e.limits.mean).c_str(),
                  fmt_ratio(e.max_ratio).c_str(), fmt_ratio(e.mean_ratio).c_str(), other_name(r),
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
  out << "(max/lim = max err / max limit, mean/lim = mean err / mean limit; first pair against the deciding budget,\n"
         " second pair against the other one: ncp = non-CP peer, cp = CP peer; step partials carry the CP budget only)\n";
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
